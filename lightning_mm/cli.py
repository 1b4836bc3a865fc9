"""The ``lightning-mm`` command.

``lightning-mm fit|validate|test|predict --config cfg.yaml`` is LightningCLI. Other sub-commands (``env``,
``plan``, ``migrate``, ``convert``) live in ``lightning_mm/commands/<name>.py``, each with a ``main(argv) -> int``,
and are imported only when used.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["main", "COMMANDS"]

# name -> (module, one-line help). A module is listed here once it exists.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("lightning_mm.commands.env", "versions, accelerators and backends of this machine (for bug reports)"),
    "plan": ("lightning_mm.commands.plan", "print the resolved sharding plan and per-rank memory, no processes"),
    "migrate": ("lightning_mm.commands.migrate", "turn a MindSpeed MM / Megatron launch into a LightningCLI YAML"),
    "convert": ("lightning_mm.commands.convert", "checkpoints: dcp-to-torch, dcp-to-hf, hf-to-dcp (one process)"),
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
        args=None if list(argv) == sys.argv[1:] else list(argv),  # LightningCLI warns when given both
        save_config_kwargs={"overwrite": True},
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # class paths resolve from the working directory, as with `python -m`
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
