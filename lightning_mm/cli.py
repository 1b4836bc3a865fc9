"""The ``lightning-mm`` command.

``lightning-mm fit|validate|test|predict --config cfg.yaml`` is LightningCLI. Other sub-commands (``env``,
``plan``, ``migrate``, ``convert``) live in ``lightning_mm/commands/<name>.py``, each with a ``main(argv) -> int``,
and are imported only when used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main", "COMMANDS"]

# name -> (module, one-line help). A module is listed here once it exists.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("lightning_mm.commands.env", "versions, accelerators and backends of this machine (for bug reports)"),
}


def _usage() -> str:
    lines = ["usage: lightning-mm {fit,validate,test,predict" + "".join(f",{c}" for c in COMMANDS) + "} ...", ""]
    lines.append("  fit, validate, test, predict   LightningCLI (see `lightning-mm fit --help`)")
    lines += [f"  {name:<30} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def run_lightning_cli(argv: Sequence[str]) -> None:
    """LightningCLI over MMLightningModule / MMDataModule subclasses (``class_path`` / ``init_args``)."""
    from lightning.pytorch.cli import LightningCLI

    import lightning_mm  # noqa: F401  (registers the mm_fsdp2 strategy)
    from lightning_mm import MMDataModule, MMLightningModule

    LightningCLI(
        MMLightningModule,
        MMDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=list(argv),
        save_config_kwargs={"overwrite": True},
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    run_lightning_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
