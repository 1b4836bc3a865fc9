"""The ``lightning-mm`` command.

``lightning-mm fit|validate|test|predict --config cfg.yaml`` is LightningCLI (``lightning_mm.commands.train``).
Other sub-commands (``env``, ``plan``, ``migrate``, ``convert``) live in ``lightning_mm/commands/<name>.py``, each
with a ``main(argv) -> int``, and are imported only when used; this module imports nothing heavy, so ``--help``
and the commands that do not train start without Lightning. The package root, which Python runs first, does not
import Lightning either: it registers ``mm_fsdp2``, ``single_npu`` and ``npu`` only once Lightning is imported (see
``lightning_mm/__init__.py``), the same whether this runs as the ``lightning-mm`` console script, as
``python -m lightning_mm.cli`` or from a user's program.

Errors that are the user's to fix (bad config, data, checkpoint, arguments: see
``lightning_mm.commands.failure``) print as one line and exit 1; ``--traceback`` (anywhere on the command line)
or ``LIGHTNING_MM_TRACEBACK=1`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from lightning_mm.commands.failure import TRACEBACK_ENV, one_line, traceback_requested, user_error

__all__ = ["main", "COMMANDS"]

# name -> (module, one-line help). A module is listed here once it exists.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("lightning_mm.commands.env", "versions, accelerators and backends of this machine (for bug reports)"),
    "plan": (
        "lightning_mm.commands.plan_command",
        "print the resolved sharding plan and per-rank memory, no processes",
    ),
    "migrate": ("lightning_mm.commands.migrate", "turn a MindSpeed MM / Megatron launch into a LightningCLI YAML"),
    "convert": (
        "lightning_mm.commands.convert_command",
        "checkpoints: dcp-to-torch, dcp-to-hf, hf-to-dcp (one process)",
    ),
    "extract-features": (
        "lightning_mm.commands.extract_features",
        "Wan text-to-video features (VAE latents, text embeddings) from videos, as MindSpeed MM's extraction",
    ),
}
_TRAINING = ("fit", "validate", "test", "predict")
_READS_CLASS_PATHS = (*_TRAINING, "plan")


def _usage() -> str:
    lines = ["usage: lightning-mm {fit,validate,test,predict" + "".join(f",{c}" for c in COMMANDS) + "} ...", ""]
    lines.append("  fit, validate, test, predict   LightningCLI (see `lightning-mm fit --help`)")
    lines += [f"  {name:<30} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", f"Errors in your input print as one line; --traceback (or {TRACEBACK_ENV}=1) shows the traceback."]
    return "\n".join(lines)


def _add_working_directory() -> None:
    """Let class paths in a config (``examples.captioning.module.CaptioningModule``) resolve from the working directory.

    Appended, not prepended: a file in the working directory never shadows an installed module.
    """
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in _READS_CLASS_PATHS:
        _add_working_directory()
    if argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    from lightning_mm.commands.train import run_lightning_cli

    run_lightning_cli(argv)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``lightning-mm`` command; returns the exit status."""
    from_sys_argv = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    if "--traceback" in args:
        args = [a for a in args if a != "--traceback"]
        os.environ[TRACEBACK_ENV] = "1"  # inherited by the ranks Lightning starts
        if from_sys_argv:
            sys.argv = [sys.argv[0], *args]  # the ranks are started with sys.argv
    try:
        return _dispatch(args)
    except Exception as error:
        cause = None if traceback_requested() else user_error(error)
        if cause is None:
            raise
        command = args[0] if args else ""
        print(f"lightning-mm {command}: error: {one_line(cause)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
