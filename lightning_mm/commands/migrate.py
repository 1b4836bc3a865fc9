"""``lightning-mm migrate``: a MindSpeed MM / Megatron launch turned into a LightningCLI YAML.

    lightning-mm migrate pretrain_custom.sh -o config.yaml
    lightning-mm migrate -o config.yaml -- --use-torch-fsdp2 --fsdp2-config-path fsdp2_config.yaml --lr 1e-4 ...

Shell scripts are read the way Megatron launch scripts are written: ``VAR=value`` / ``export`` lines, ``$VAR``
expansion, line continuations, and a ``torchrun ... pretrain_xxx.py ...`` (or ``python ...``) line. Every flag is
either mapped or listed in the report with the reason; nothing is dropped silently.
"""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["main", "Launch", "parse_script", "parse_args", "migrate"]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_LAUNCHERS = ("torchrun", "python", "python3", "python -m torch.distributed.launch")


@dataclass
class Launch:
    """What a launch consists of: launcher options, the entry script, and the training flags."""

    launcher: dict[str, str] = field(default_factory=dict)
    script: str | None = None
    flags: list[tuple[str, str | None]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def _expand(text: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), text)


def _split_flags(tokens: list[str]) -> list[tuple[str, str | None]]:
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            flags.append((token, None))  # a stray value, reported as unmapped
            i += 1
            continue
        if "=" in token:
            name, value = token.split("=", 1)
            flags.append((name, value))
            i += 1
            continue
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if nxt is not None and (not nxt.startswith("--") or re.fullmatch(r"-[\d.e+-]+", nxt)):
            flags.append((token, nxt))
            i += 2
        else:
            flags.append((token, None))
            i += 1
    return flags


def parse_args(tokens: Sequence[str]) -> Launch:
    """A launch given as an argument list (training flags only)."""
    return Launch(flags=_split_flags(list(tokens)))


def _logical_lines(text: str) -> list[str]:
    """Shell lines with continuations joined and quoted values spanning several lines kept together."""
    text = re.sub(r"\\\r?\n", " ", text)
    lines: list[str] = []
    buffer = ""
    for raw in text.splitlines():
        if not buffer and raw.strip().startswith("#"):
            continue
        buffer = f"{buffer} {raw}" if buffer else raw
        try:
            shlex.split(buffer, comments=True)
        except ValueError:  # an open quote: the value goes on on the next line
            continue
        lines.append(buffer.strip())
        buffer = ""
    if buffer:
        raise ValueError(f"unterminated quote in the launch script near: {buffer[:80]!r}")
    return [line for line in lines if line]


def parse_script(text: str) -> Launch:
    """A launch given as a shell script."""
    env: dict[str, str] = {}
    launch_line = None
    for line in _logical_lines(text):
        is_launch = bool(re.search(r"(^|\s)(torchrun|python3?)\s", line)) and ".py" in line
        assign = _ASSIGN.match(line)
        if assign and not is_launch:
            value = assign.group(2).strip()
            try:
                value = " ".join(shlex.split(_expand(value, env)))
            except ValueError:
                value = _expand(value.strip("\"'"), env)
            env[assign.group(1)] = value
            continue
        if is_launch:
            launch_line = _expand(line, env)
    if launch_line is None:
        raise ValueError("no `torchrun ... xxx.py` or `python ... xxx.py` launch line found in the script")
    tokens = shlex.split(launch_line)
    while tokens and not re.search(r"(^|/)(torchrun|python3?)$", tokens[0]):
        tokens.pop(0)  # e.g. `nohup`, environment prefixes
    tokens.pop(0)
    launcher: dict[str, str] = {}
    script = None
    while tokens:
        token = tokens.pop(0)
        if token.endswith(".py"):
            script = token
            break
        if token in ("-m",):
            tokens.pop(0) if tokens else None
            continue
        if token.startswith("--"):
            name, _, value = token.partition("=")
            if not value and tokens and not tokens[0].startswith("-") and not tokens[0].endswith(".py"):
                value = tokens.pop(0)
            launcher[name.lstrip("-").replace("-", "_")] = value
    return Launch(launcher=launcher, script=script, flags=_split_flags(tokens), env=env)


# ------------------------------------------------------------------------------------------ mapping
@dataclass
class Migration:
    config: dict[str, Any]
    mapped: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"mapped {len(self.mapped)} flag(s):", *(f"  {m}" for m in self.mapped)]
        lines.append(f"NOT mapped {len(self.unmapped)} flag(s) (review these by hand):")
        lines += [f"  {u}" for u in self.unmapped] or ["  (none)"]
        return "\n".join(lines)


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    node = config
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _number(value: str | None, flag: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{flag} needs a number, got {value!r}") from None


def migrate(launch: Launch) -> Migration:
    """Map a launch onto a LightningCLI config; everything not mapped is listed with the reason."""
    from lightning_mm import MMFSDP2Strategy

    cfg: dict[str, Any] = {"trainer": {}, "model": {"class_path": "lightning_mm.MMLightningModule", "init_args": {}},
                           "data": {"class_path": "lightning_mm.MMDataModule", "init_args": {}}}
    out = Migration(cfg)
    strategy_args = set(inspect.signature(MMFSDP2Strategy.__init__).parameters)
    values: dict[str, Any] = {}

    world = None
    nproc = launch.launcher.get("nproc_per_node")
    nnodes = launch.launcher.get("nnodes")
    if nproc and nproc.isdigit():
        _set(cfg, "trainer.devices", int(nproc))
        out.mapped.append(f"torchrun --nproc_per_node {nproc} -> trainer.devices")
        world = int(nproc) * (int(nnodes) if nnodes and nnodes.isdigit() else 1)
    if nnodes and nnodes.isdigit():
        _set(cfg, "trainer.num_nodes", int(nnodes))
        out.mapped.append(f"torchrun --nnodes {nnodes} -> trainer.num_nodes")
    for key in launch.launcher:
        if key not in ("nproc_per_node", "nnodes"):
            out.unmapped.append(f"torchrun --{key}: set by the launcher / cluster environment, not in the YAML")

    if launch.script:
        module = Path(launch.script).stem
        for fn in ("model_provider", "forward_step"):
            _set(cfg, f"model.init_args.{fn}", f"{module}.{fn}")
        out.mapped.append(f"{launch.script} -> model.init_args.model_provider / forward_step = {module}.<function> "
                          "(remove Megatron globals such as get_args() from them)")

    def strategy(key: str, value: Any, flag: str) -> None:
        if key not in strategy_args:
            out.unmapped.append(f"{flag}: MMFSDP2Strategy has no `{key}` argument in this version")
            return
        cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
        cfg["trainer"]["strategy"]["init_args"][key] = value

    for flag, value in launch.flags:
        shown = f"{flag} {value}" if value is not None else flag
        try:
            if flag == "--use-torch-fsdp2":
                cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
                out.mapped.append(f"{shown} -> trainer.strategy: lightning_mm.MMFSDP2Strategy")
            elif flag == "--fsdp2-config-path":
                strategy("fsdp2_config", value, shown)
                out.mapped.append(f"{shown} -> trainer.strategy.init_args.fsdp2_config")
            elif flag == "--ckpt-format":
                if value not in ("torch_dcp", "torch"):
                    out.unmapped.append(f"{shown}: only torch_dcp and torch are supported")
                elif "checkpoint_format" in strategy_args:
                    strategy("checkpoint_format", value, shown)
                    out.mapped.append(f"{shown} -> trainer.strategy.init_args.checkpoint_format")
                else:
                    out.unmapped.append(f"{shown}: this version writes torch_dcp checkpoints only")
            elif flag == "--distributed-backend":
                strategy("process_group_backend", value, shown)
                out.mapped.append(f"{shown} -> trainer.strategy.init_args.process_group_backend")
            elif flag == "--micro-batch-size":
                values["mbs"] = int(_number(value, flag))
                _set(cfg, "data.init_args.batch_size", values["mbs"])
                out.mapped.append(f"{shown} -> data.init_args.batch_size")
            elif flag == "--global-batch-size":
                values["gbs"] = int(_number(value, flag))
            elif flag == "--lr":
                _set(cfg, "model.init_args.lr", _number(value, flag))
                out.mapped.append(f"{shown} -> model.init_args.lr")
            elif flag == "--min-lr":
                _set(cfg, "model.init_args.min_lr", _number(value, flag))
                out.mapped.append(f"{shown} -> model.init_args.min_lr")
            elif flag == "--weight-decay":
                _set(cfg, "model.init_args.weight_decay", _number(value, flag))
                out.mapped.append(f"{shown} -> model.init_args.weight_decay")
            elif flag in ("--adam-beta1", "--adam-beta2"):
                values[flag] = _number(value, flag)
            elif flag == "--lr-decay-style":
                if value in ("cosine", "linear", "constant"):
                    _set(cfg, "model.init_args.lr_decay_style", value)
                    out.mapped.append(f"{shown} -> model.init_args.lr_decay_style")
                else:
                    out.unmapped.append(f"{shown}: only cosine, linear and constant decay are built in")
            elif flag == "--lr-warmup-iters":
                _set(cfg, "model.init_args.warmup_steps", int(_number(value, flag)))
                out.mapped.append(f"{shown} -> model.init_args.warmup_steps")
            elif flag == "--lr-warmup-fraction":
                values["warmup_fraction"] = _number(value, flag)
            elif flag == "--train-iters":
                values["train_iters"] = int(_number(value, flag))
                _set(cfg, "trainer.max_steps", values["train_iters"])
                out.mapped.append(f"{shown} -> trainer.max_steps")
            elif flag == "--clip-grad":
                _set(cfg, "trainer.gradient_clip_val", _number(value, flag))
                out.mapped.append(f"{shown} -> trainer.gradient_clip_val")
            elif flag == "--bf16":
                _set(cfg, "trainer.precision", "bf16-mixed")
                out.mapped.append(f"{shown} -> trainer.precision: bf16-mixed")
            elif flag == "--fp16":
                out.unmapped.append(f"{shown}: fp16 mixed precision needs a sharded grad scaler; use --bf16 "
                                    "(bf16-mixed) or param_dtype: fp16 in the FSDP2 YAML")
            elif flag == "--seed":
                cfg["seed_everything"] = int(_number(value, flag))
                out.mapped.append(f"{shown} -> seed_everything")
            elif flag == "--log-interval":
                _set(cfg, "trainer.log_every_n_steps", int(_number(value, flag)))
                out.mapped.append(f"{shown} -> trainer.log_every_n_steps")
            elif flag == "--eval-interval":
                _set(cfg, "trainer.val_check_interval", int(_number(value, flag)))
                _set(cfg, "trainer.check_val_every_n_epoch", None)
                out.mapped.append(f"{shown} -> trainer.val_check_interval")
            elif flag == "--eval-iters":
                _set(cfg, "trainer.limit_val_batches", int(_number(value, flag)))
                out.mapped.append(f"{shown} -> trainer.limit_val_batches")
            elif flag == "--save":
                values["save"] = value
            elif flag == "--save-interval":
                values["save_interval"] = int(_number(value, flag))
            elif flag == "--load":
                cfg["ckpt_path"] = "last"
                values["load"] = value
                out.mapped.append(f"{shown} -> ckpt_path: last (resumes from the ModelCheckpoint directory)")
            elif flag == "--mm-data":
                _set(cfg, "data.init_args.data_config", value)
                out.mapped.append(f"{shown} -> data.init_args.data_config (check it against lightning-mm's data "
                                  "config format, docs/migration.md)")
            elif flag == "--mm-model":
                out.unmapped.append(f"{shown}: MindSpeed's model.json has no direct equivalent; build the model in "
                                    "model_provider (or TransformersModel) from it")
            elif flag == "--untie-embeddings-and-output-weights":
                out.unmapped.append(f"{shown}: a model property; build untied embedding/output weights in "
                                    "model_provider (tied ones are grouped into one FSDP unit automatically)")
            else:
                out.unmapped.append(f"{shown}: unknown to lightning-mm migrate")
        except ValueError as err:
            out.unmapped.append(f"{shown}: {err}")

    if "--adam-beta1" in values or "--adam-beta2" in values:
        _set(cfg, "model.init_args.betas", [values.get("--adam-beta1", 0.9), values.get("--adam-beta2", 0.999)])
        out.mapped.append("--adam-beta1/--adam-beta2 -> model.init_args.betas")
    if "warmup_fraction" in values:
        if "train_iters" in values:
            _set(cfg, "model.init_args.warmup_steps", round(values["warmup_fraction"] * values["train_iters"]))
            out.mapped.append("--lr-warmup-fraction -> model.init_args.warmup_steps (fraction x train-iters)")
        else:
            out.unmapped.append("--lr-warmup-fraction: needs --train-iters to become a step count")
    if "gbs" in values:
        mbs = values.get("mbs", 1)
        if world and values["gbs"] % (mbs * world) == 0:
            _set(cfg, "trainer.accumulate_grad_batches", values["gbs"] // (mbs * world))
            out.mapped.append(f"--global-batch-size {values['gbs']} -> trainer.accumulate_grad_batches "
                              f"({values['gbs']} / ({mbs} x {world} ranks))")
        else:
            out.unmapped.append(f"--global-batch-size {values['gbs']}: cannot derive accumulate_grad_batches "
                                "(world size unknown or not a divisor); set trainer.accumulate_grad_batches")
    if "save" in values or "save_interval" in values:
        checkpoint: dict[str, Any] = {"save_last": True}
        if values.get("save"):
            checkpoint["dirpath"] = values["save"]
        if values.get("save_interval"):
            checkpoint["every_n_train_steps"] = values["save_interval"]
        cfg["trainer"]["callbacks"] = [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": checkpoint}
        ]
        out.mapped.append("--save/--save-interval -> trainer.callbacks: ModelCheckpoint(dirpath, every_n_train_steps)")
        if values.get("load") and values.get("save") and values["load"] != values["save"]:
            out.unmapped.append(f"--load {values['load']}: differs from --save; set ckpt_path to the checkpoint")
    if not cfg["data"]["init_args"].get("data_config") and launch.script:
        module = Path(launch.script).stem
        _set(cfg, "data.init_args.train_valid_test_datasets_provider",
             f"{module}.train_valid_test_datasets_provider")
    for name in launch.env:
        if name in ("CUDA_DEVICE_MAX_CONNECTIONS",):
            out.unmapped.append(f"{name}: Megatron tuning variable, not needed by FSDP2")
    return out


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-mm migrate", description=__doc__.splitlines()[0])
    parser.add_argument("script", nargs="?", help="a MindSpeed MM / Megatron launch script (.sh)")
    parser.add_argument("-o", "--output", help="write the YAML here (default: standard output)")
    parser.epilog = "Training flags may be given instead of a script, after `--`."
    argv = list(argv)
    flags: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, flags = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if bool(args.script) == bool(flags):
        parser.error("give a launch script, or `--` followed by the flags (one of them)")
    if args.script:
        path = Path(args.script)
        if not path.is_file():
            parser.error(f"launch script not found: {path}")
        launch = parse_script(path.read_text())
    else:
        launch = parse_args(flags)
    result = migrate(launch)
    header = f"# Generated by `lightning-mm migrate` from {args.script or 'a flag list'}. Review the report.\n"
    text = header + yaml.safe_dump(result.config, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    print(result.report(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
