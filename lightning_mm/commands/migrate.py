"""``lightning-mm migrate``: a MindSpeed MM / Megatron launch turned into a LightningCLI YAML.

    lightning-mm migrate pretrain_custom.sh -o config.yaml
    lightning-mm migrate -o config.yaml -- --use-torch-fsdp2 --fsdp2-config-path fsdp2_config.yaml --lr 1e-4 ...
    lightning-mm migrate finetune_qwen3vl_8B.sh -o config.yaml     # torchrun ... pretrain_transformers.py cfg.yaml
    lightning-mm migrate qwen3vl_full_sft_8B.yaml -o config.yaml   # MindSpeed MM's single YAML itself
    lightning-mm migrate qwen3vl_30B_config_v1.yaml -o config.yaml # its native FSDP2 route's six-section YAML

    lightning-mm migrate finetune_qwen3_5_35B.sh -o config.yaml  # torchrun ... mindspeed_mm/fsdp/train/trainer.py cfg
    lightning-mm migrate model_7b.json -o config.yaml              # one component (model.json, data config, FSDP2)

A file of a kind this project does not train (audio models, DeepSpeed or MindSpore launches, RL post-training,
inference scripts, ...) is refused with a reason of :mod:`lightning_mm.mindspeed.refusals`, decided from its content
(:mod:`lightning_mm.mindspeed.launch_kinds`). Shell scripts are read by :mod:`lightning_mm.mindspeed.launch_script`;
a Wan model.json becomes MMWanModule (:mod:`lightning_mm.mindspeed.diffusion`), and a Megatron-route VLM
model.json its Transformers twin (``--hf-path``, or the data config's ``model_name_or_path``).

MindSpeed MM's single-YAML form (``gpt_args``, ``data``, ``model`` sections) is read with the project's safe YAML
loader: ``gpt_args`` go through the same flag table as the flags of a script, ``data`` becomes
``MMDataModule(data_config=<that YAML>)`` and ``model`` a TransformersModel config
(:mod:`lightning_mm.mindspeed.model_config`). Every flag and key is either mapped or listed in the report with the
reason; nothing is dropped silently. An existing output file is never overwritten without ``--force``, and the input
never.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_mm.mindspeed.keys import MindSpeedConfigError
from lightning_mm.mindspeed.load import migrate_file, migrate_flags
from lightning_mm.mindspeed.report import MigrationReport

__all__ = ["main", "launch_lines"]


def _write_output(output: Path, text: str, inputs: list[Path], force: bool) -> None:
    """Write ``text`` to ``output`` atomically; never over an input, nor over an existing file without ``force``."""
    target = output.resolve()
    for source in inputs:
        if source.exists() and (target == source.resolve() or (output.exists() and os.path.samefile(output, source))):
            raise MindSpeedConfigError(f"-o {output} is the input {source}; migrate never overwrites its input")
    if output.is_dir():
        raise MindSpeedConfigError(f"-o {output} is a directory; give a file name")
    if output.exists() and not force:
        raise MindSpeedConfigError(f"-o {output} exists; pass --force to overwrite it")
    if not target.parent.is_dir():
        raise MindSpeedConfigError(f"-o {output}: the directory {target.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-mm migrate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "script", nargs="?", help="a MindSpeed MM / Megatron launch script (.sh), or MindSpeed MM's single YAML (.yaml)"
    )
    parser.add_argument("-o", "--output", help="write the YAML here (default: standard output); never the input")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument(
        "--base-dir",
        default=None,
        help="the launch directory, where the launch's relative paths start (default: the script's "
        "folder, or the working directory when the files the script names are found only "
        "there; for a YAML or a flag list, the working directory)",
    )
    parser.add_argument(
        "--import-root",
        default=None,
        help="directory lightning-mm will run from, where the entry script's import path starts "
        "(default: the working directory if the script lies below it, else the script's folder)",
    )
    parser.add_argument(
        "--hf-path",
        default=None,
        help="the Hugging Face (or diffusers transformer) directory the weights start from, for a model.json that "
        "names none: a Megatron-route VLM model.json (default: its data config's model_name_or_path) or a Wan "
        "model.json (default: --load)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="the launch's process count (NPUs per node x nodes) for a native-route YAML given by itself, or a "
        "script whose counts are shell: records MindSpeed MM's global batch size (GlobalBatchSize)",
    )
    parser.add_argument(
        "--keep-backend",
        action="store_true",
        help="keep --distributed-backend instead of letting the accelerator choose it",
    )
    parser.epilog = "Training flags may be given instead of a script, after `--`."
    return parser


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    argv = list(argv)
    flags: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, flags = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if bool(args.script) == bool(flags):
        parser.error("give a launch script, or `--` followed by the flags (one of them)")
    if args.world_size is not None and (args.world_size < 1 or flags):
        parser.error("--world-size: a process count >= 1, for a launch script or a native-route YAML")
    import_root = Path(args.import_root) if args.import_root else None
    if args.script:
        path = Path(args.script)
        if not path.is_file():
            parser.error(f"launch script not found: {path}")
        if path.suffix == ".py":
            parser.error(
                f"{path} is the entry script; give the shell script that launches it (torchrun ... "
                f"{path.name} ...), or its training flags after `--`"
            )
        result, inputs = migrate_file(
            path,
            base_dir=Path(args.base_dir) if args.base_dir else None,
            import_root=import_root,
            keep_backend=args.keep_backend,
            hf_path=Path(args.hf_path) if args.hf_path else None,
            world_size=args.world_size,
        )
    else:
        inputs = []
        result = migrate_flags(
            flags,
            base_dir=Path(args.base_dir) if args.base_dir else None,
            import_root=import_root,
            keep_backend=args.keep_backend,
            hf_path=Path(args.hf_path) if args.hf_path else None,
        )
    _emit(result, inputs, args)
    return 0


def _emit(result: MigrationReport, inputs: list[Path], args: argparse.Namespace) -> None:
    """Write the config (to ``-o`` or standard output) with its header, then the report and the launch lines."""
    header = f"# Generated by `lightning-mm migrate` from {args.script or 'a flag list'}. Review the report.\n"
    run_from = result.import_root or result.run_from
    if run_from is not None:
        header += (
            f"# Run from {Path(run_from).resolve()}: lightning-mm fit --config "
            f"{Path(args.output).resolve() if args.output else 'THIS_FILE'}\n"
        )
    launch_text = launch_lines(
        result.config, str(Path(args.output).resolve()) if args.output else "THIS_FILE", result.rendezvous
    )
    header += "".join(f"# {line}\n" for line in launch_text)
    text = header + yaml.safe_dump(result.config, sort_keys=False)
    if args.output:
        _write_output(Path(args.output), text, inputs, args.force)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    print(result.report(), file=sys.stderr)
    if launch_text:
        print("\n".join(launch_text), file=sys.stderr)


def launch_lines(config: Mapping[str, Any], config_path: str, rendezvous: Mapping[str, str] | None = None) -> list[str]:
    """The command lines that start the migrated job on ``trainer.num_nodes`` nodes x ``trainer.devices`` processes,
    with torchrun (run on every node; Lightning reads torchrun's environment) and with SLURM (Lightning reads
    SLURM's; ``--ntasks-per-node`` must equal ``trainer.devices``). Empty when the counts are not in the config.
    ``rendezvous``: the launch script's literal ``master_addr`` / ``master_port`` (else ``$MASTER_ADDR`` ...)."""
    given = rendezvous or {}
    trainer = config.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if not isinstance(devices, int) or not isinstance(nodes, int) or nodes < 2:
        return []
    fit = f"-m lightning_mm.cli fit --config {config_path}"
    return [
        f"launch on {nodes} nodes x {devices} processes (trainer.num_nodes {nodes}, trainer.devices {devices}):",
        f"  torchrun (on each node, NODE_RANK 0..{nodes - 1}): torchrun --nnodes {nodes} --nproc_per_node {devices} "
        f"--node_rank $NODE_RANK --master_addr {given.get('master_addr', '$MASTER_ADDR')} "
        f"--master_port {given.get('master_port', '$MASTER_PORT')} {fit}",
        f"  SLURM: srun --nodes {nodes} --ntasks-per-node {devices} python {fit}",
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
