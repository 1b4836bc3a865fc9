"""``lightning-mm migrate``: a MindSpeed MM / Megatron launch turned into a LightningCLI YAML.

    lightning-mm migrate pretrain_custom.sh -o config.yaml
    lightning-mm migrate -o config.yaml -- --use-torch-fsdp2 --fsdp2-config-path fsdp2_config.yaml --lr 1e-4 ...

Shell scripts are read the way Megatron launch scripts are written: ``VAR=value`` / ``export`` lines, ``$VAR``
expansion, line continuations, and a ``torchrun ... pretrain_xxx.py ...`` (or ``python ...``) line. Every flag is
either mapped or listed in the report with the reason; nothing is dropped silently.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["main", "Launch", "parse_script", "parse_args", "migrate", "STRATEGY_ARGS", "SEED_FUNCTIONS"]

# MMFSDP2Strategy's __init__ arguments, listed here so that migrating never imports Lightning
# (tests/test_migrate.py checks the list against the class).
STRATEGY_ARGS = frozenset({
    "fsdp2_config", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "empty_init", "checkpoint_format", "strict_loading", "fused_optimizer_step",
    "stop_timeout", "context_parallel_size", "context_parallel_algo", "stop_on_nonfinite",
})
# The seed's functions and where each goes (MMLightningModule / MMDataModule arguments).
SEED_FUNCTIONS = {
    "model_provider": "model.init_args.model_provider",
    "forward_step": "model.init_args.forward_step",
    "get_batch": "model.init_args.get_batch",
    "loss_func": "model.init_args.loss_func",
    "train_valid_test_datasets_provider": "data.init_args.train_valid_test_datasets_provider",
}

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
    notes: list[str] = field(default_factory=list)
    import_root: Path | None = None

    def report(self) -> str:
        lines = [f"mapped {len(self.mapped)} item(s):", *(f"  {m}" for m in self.mapped)]
        if self.notes:
            lines.append("notes:")
            lines += [f"  {n}" for n in self.notes]
        lines.append(f"NOT mapped {len(self.unmapped)} item(s) (review these by hand):")
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


def _defined_functions(script: Path) -> set[str] | None:
    """Names of the top-level functions of an entry script (read, never imported); None if it cannot be read."""
    try:
        tree = ast.parse(script.read_text(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return None
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _module_path(script: Path, import_root: Path) -> str:
    """The dotted import path of ``script`` seen from ``import_root`` (``examples.migration.pretrain_custom``)."""
    relative = script.resolve().with_suffix("").relative_to(import_root.resolve())
    return ".".join(relative.parts)


# ------------------------------------------------------------------------------------------ flag table
@dataclass
class _Flags:
    """What the flag handlers read and write while one launch is migrated."""

    cfg: dict[str, Any]
    out: Migration
    values: dict[str, Any]
    base: Path
    keep_backend: bool

    def path_of(self, value: str | None) -> Path:
        return (self.base / (value or "")).resolve()

    def strategy(self, key: str, value: Any) -> None:
        self.cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
        self.cfg["trainer"]["strategy"]["init_args"][key] = value


# A handler maps one flag: handler(state, flag, value, shown), ``shown`` being the flag as written in the report.
_Handler = Callable[[_Flags, str, "str | None", str], None]


def _to(path: str, kind: type = float, keep: str | None = None, also: dict[str, Any] | None = None) -> _Handler:
    """``--flag N`` -> ``path`` as ``kind`` (kept in ``values[keep]`` too; ``also`` sets further keys)."""

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        number = kind(_number(value, flag))
        if keep:
            state.values[keep] = number
        _set(state.cfg, path, number)
        for other, fixed in (also or {}).items():
            _set(state.cfg, other, fixed)
        state.out.mapped.append(f"{shown} -> {path}")

    return handle


def _keep(name: str | None = None, kind: type | None = float) -> _Handler:
    """Remember the value (under ``name``, default the flag) for a mapping that needs other flags too."""

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        state.values[name or flag] = value if kind is None else kind(_number(value, flag))

    return handle


def _const(path: str, fixed: Any) -> _Handler:
    """A switch that sets ``path`` to ``fixed``."""

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        _set(state.cfg, path, fixed)
        state.out.mapped.append(f"{shown} -> {path}: {fixed}")

    return handle


def _refuse(reason: str) -> _Handler:
    """Not mapped, with the reason."""

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        state.out.unmapped.append(f"{shown}: {reason}")

    return handle


def _choice(path: str, choices: tuple[str, ...], reason: str) -> _Handler:
    """``--flag VALUE`` -> ``path`` when the value is one of ``choices``; otherwise not mapped, with ``reason``."""

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        if value not in choices:
            state.out.unmapped.append(f"{shown}: {reason}")
            return
        _set(state.cfg, path, value)
        state.out.mapped.append(f"{shown} -> {path}")

    return handle


def _strategy_arg(key: str, kind: type = str, choices: tuple[str, ...] = (), reason: str = "") -> _Handler:
    """``--flag VALUE`` -> ``MMFSDP2Strategy(key=VALUE)`` (as ``kind``; only one of ``choices`` when given)."""
    if key not in STRATEGY_ARGS:
        raise ValueError(f"MMFSDP2Strategy has no `{key}` argument")

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        if choices and value not in choices:
            state.out.unmapped.append(f"{shown}: {reason}")
            return
        state.strategy(key, kind(_number(value, flag)) if kind in (int, float) else value)
        state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.{key}")

    return handle


def _use_fsdp2(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
    state.out.mapped.append(f"{shown} -> trainer.strategy: lightning_mm.MMFSDP2Strategy")


def _fsdp2_config(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    path = state.path_of(value)
    state.strategy("fsdp2_config", str(path))
    state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.fsdp2_config ({path})")
    if not path.is_file():
        state.out.unmapped.append(f"{shown}: {path} does not exist; write it before training")


def _backend(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    if state.keep_backend:
        state.strategy("process_group_backend", value)
        state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.process_group_backend (--keep-backend)")
    else:
        state.out.notes.append(f"{shown}: left out; the backend follows the accelerator (nccl on CUDA, hccl on "
                               "Ascend, gloo on CPU). `migrate --keep-backend` keeps it")


def _load(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.cfg["ckpt_path"] = "last"
    state.values["load"] = value
    state.out.mapped.append(f"{shown} -> ckpt_path: last (resumes from the ModelCheckpoint directory)")


def _mm_data(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.values["mm_data"] = (shown, state.path_of(value))


def _context_parallel_size(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    _CP_SIZE(state, flag, value, shown)
    state.values["cp"] = int(_number(value, flag))  # the global batch size counts data-parallel ranks only


_CP_SIZE = _strategy_arg("context_parallel_size", int)


def _context_parallel_algo(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    if value not in ("ulysses_cp_algo", "ulysses"):
        state.out.unmapped.append(f"{shown}: only Ulysses context parallelism (ulysses_cp_algo) is supported")
        return
    state.strategy("context_parallel_algo", "ulysses")
    state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.context_parallel_algo: ulysses")


# Every Megatron / MindSpeed MM flag migrate knows, in one table. Flags kept in ``values`` are mapped after the
# loop, where they meet the flags they depend on (batch sizes, betas, warmup fraction, checkpoint callback, data).
# A new flag is one line: ``_to(config path, type)`` for a Trainer / module / data key, ``_strategy_arg(name, type)``
# for an MMFSDP2Strategy argument, ``_refuse(reason)`` for one that has no equivalent.
FLAGS: dict[str, _Handler] = {
    "--use-torch-fsdp2": _use_fsdp2,
    "--fsdp2-config-path": _fsdp2_config,
    "--ckpt-format": _strategy_arg("checkpoint_format", choices=("torch_dcp", "torch"),
                                   reason="only torch_dcp and torch are supported"),
    "--distributed-backend": _backend,
    "--micro-batch-size": _to("data.init_args.batch_size", int, keep="mbs"),
    "--global-batch-size": _keep("gbs", int),
    "--lr": _to("model.init_args.lr"),
    "--min-lr": _to("model.init_args.min_lr"),
    "--weight-decay": _to("model.init_args.weight_decay"),
    "--adam-beta1": _keep(),
    "--adam-beta2": _keep(),
    "--lr-decay-style": _choice("model.init_args.lr_decay_style", ("cosine", "linear", "constant"),
                                "only cosine, linear and constant decay are built in"),
    "--lr-warmup-iters": _to("model.init_args.warmup_steps", int),
    "--lr-warmup-fraction": _keep("warmup_fraction"),
    "--train-iters": _to("trainer.max_steps", int, keep="train_iters"),
    "--clip-grad": _to("trainer.gradient_clip_val"),
    "--bf16": _const("trainer.precision", "bf16-mixed"),
    "--fp16": _refuse("fp16 mixed precision needs a sharded grad scaler; use --bf16 (bf16-mixed) or "
                      "param_dtype: fp16 in the FSDP2 YAML"),
    "--seed": _to("seed_everything", int),
    "--log-interval": _to("trainer.log_every_n_steps", int),
    "--eval-interval": _to("trainer.val_check_interval", int, also={"trainer.check_val_every_n_epoch": None}),
    "--eval-iters": _to("trainer.limit_val_batches", int),
    "--save": _keep("save", None),
    "--save-interval": _keep("save_interval", int),
    "--load": _load,
    "--mm-data": _mm_data,
    "--context-parallel-size": _context_parallel_size,
    "--context-parallel-algo": _context_parallel_algo,
    "--mm-model": _refuse("MindSpeed's model.json has no direct equivalent; build the model in model_provider "
                          "(or TransformersModel) from it"),
    "--untie-embeddings-and-output-weights": _refuse(
        "a model property; build untied embedding/output weights in model_provider (tied ones are grouped into one "
        "FSDP unit automatically)"),
}


def migrate(launch: Launch, base_dir: Path | None = None, import_root: Path | None = None,
            keep_backend: bool = False) -> Migration:
    """Map a launch onto a LightningCLI config; everything not mapped is listed with the reason.

    Relative paths in the launch are taken from ``base_dir`` (the launch script's folder; default: the working
    directory) and written as absolute paths, so that the config works wherever it is written. The entry script's
    functions are named by their import path from ``import_root`` (default: the working directory when the script
    lies below it, else the script's folder): LightningCLI resolves class paths from the directory it runs in.
    ``--distributed-backend`` is left to the accelerator (nccl, hccl or gloo) unless ``keep_backend``.
    """
    cfg: dict[str, Any] = {"trainer": {}, "model": {"class_path": "lightning_mm.MMLightningModule", "init_args": {}},
                           "data": {"class_path": "lightning_mm.MMDataModule", "init_args": {}}}
    state = _Flags(cfg, Migration(cfg), {}, Path.cwd() if base_dir is None else Path(base_dir), keep_backend)
    world = _map_launcher(state, launch)
    functions = _map_entry_script(state, launch, import_root)
    for flag, value in launch.flags:
        shown = f"{flag} {value}" if value is not None else flag
        handler = FLAGS.get(flag)
        if handler is None:
            state.out.unmapped.append(f"{shown}: unknown to lightning-mm migrate")
            continue
        try:
            handler(state, flag, value, shown)
        except ValueError as err:
            state.out.unmapped.append(f"{shown}: {err}")
    _map_combined(state, world)
    _map_checkpointing(state)
    _map_data(state, launch, functions)
    for name in launch.env:
        if name in ("CUDA_DEVICE_MAX_CONNECTIONS",):
            state.out.unmapped.append(f"{name}: Megatron tuning variable, not needed by FSDP2")
    return state.out


def _map_launcher(state: _Flags, launch: Launch) -> int | None:
    """torchrun's process counts; returns the world size when it is known."""
    cfg, out = state.cfg, state.out
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
    return world


def _map_entry_script(state: _Flags, launch: Launch, import_root: Path | None) -> set[str]:
    """The seed functions the entry script defines, named by import path; returns their names."""
    cfg, out = state.cfg, state.out
    if not launch.script:
        return set()
    script = state.path_of(launch.script)
    defined = _defined_functions(script)
    if import_root is None:
        import_root = Path.cwd() if script.is_relative_to(Path.cwd().resolve()) else script.parent
    out.import_root = Path(import_root).resolve()
    module = _module_path(script, out.import_root) if script.is_relative_to(out.import_root) else script.stem
    if defined is None:
        out.unmapped.append(f"{launch.script}: entry script not found or not Python ({script}); add "
                            "model.init_args.model_provider / forward_step by hand")
        return set()
    functions = defined & set(SEED_FUNCTIONS)
    if "forward_step" in functions:  # forward_step calls get_batch and returns loss_func itself
        functions -= {"get_batch", "loss_func"}
    for fn in sorted(functions, key=list(SEED_FUNCTIONS).index):
        _set(cfg, SEED_FUNCTIONS[fn], f"{module}.{fn}")
        out.mapped.append(f"{launch.script}: {fn} -> {SEED_FUNCTIONS[fn]} = {module}.{fn}")
    if functions:
        out.notes.append(f"the entry script's functions are imported as `{module}`: run lightning-mm from "
                         f"{out.import_root} (remove Megatron globals such as get_args() from them)")
    for fn in sorted({"model_provider"} - functions):
        out.unmapped.append(f"{launch.script}: defines no `{fn}`; set {SEED_FUNCTIONS[fn]} by hand")
    return functions


def _map_combined(state: _Flags, world: int | None) -> None:
    """Flags that become one key together: Adam betas, the warmup fraction, the global batch size."""
    cfg, out, values = state.cfg, state.out, state.values
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
        if world and values.get("cp", 1) > 1 and world % values["cp"] == 0:
            world //= values["cp"]  # the ranks of a context-parallel group share their samples
        if world and values["gbs"] % (mbs * world) == 0:
            _set(cfg, "trainer.accumulate_grad_batches", values["gbs"] // (mbs * world))
            out.mapped.append(f"--global-batch-size {values['gbs']} -> trainer.accumulate_grad_batches "
                              f"({values['gbs']} / ({mbs} x {world} ranks))")
        else:
            out.unmapped.append(f"--global-batch-size {values['gbs']}: cannot derive accumulate_grad_batches "
                                "(world size unknown or not a divisor); set trainer.accumulate_grad_batches")


def _map_checkpointing(state: _Flags) -> None:
    """--save / --save-interval / --load: a ModelCheckpoint callback and ``ckpt_path``."""
    cfg, out, values = state.cfg, state.out, state.values
    if "save" not in values and "save_interval" not in values:
        return
    # "link": last.ckpt points at the newest checkpoint instead of being a second full copy of it
    checkpoint: dict[str, Any] = {"save_last": "link"}
    if values.get("save"):
        checkpoint["dirpath"] = str(state.path_of(values["save"]))
    if values.get("save_interval"):
        checkpoint["every_n_train_steps"] = values["save_interval"]
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": checkpoint}
    cfg["trainer"]["callbacks"] = [callback]
    out.mapped.append("--save/--save-interval -> trainer.callbacks: ModelCheckpoint(dirpath, every_n_train_steps, "
                      "save_last: link)")
    if values.get("load") and values.get("save") and state.path_of(values["load"]) != state.path_of(values["save"]):
        out.unmapped.append(f"--load {values['load']}: differs from --save; set ckpt_path to the checkpoint")


def _map_data(state: _Flags, launch: Launch, functions: set[str]) -> None:
    """--mm-data, unless the entry script's dataset provider reads it."""
    out = state.out
    if "mm_data" in state.values:
        shown, data_path = state.values["mm_data"]
        if "train_valid_test_datasets_provider" in functions:
            out.unmapped.append(f"{shown}: read by the entry script's train_valid_test_datasets_provider, which is "
                                "used instead; pass the file to it, or turn it into a lightning-mm data config "
                                "(docs/migration.md)")
        elif data_path.is_file():
            _set(state.cfg, "data.init_args.data_config", str(data_path))
            out.mapped.append(f"{shown} -> data.init_args.data_config ({data_path}; check it against lightning-mm's "
                              "data config format, docs/migration.md)")
        else:
            out.unmapped.append(f"{shown}: {data_path} does not exist and the entry script defines no "
                                "train_valid_test_datasets_provider; set data.init_args by hand")
    elif launch.script and "train_valid_test_datasets_provider" not in functions:
        out.unmapped.append("no --mm-data and no train_valid_test_datasets_provider in the entry script; "
                            "set data.init_args by hand")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-mm migrate", description=__doc__.splitlines()[0])
    parser.add_argument("script", nargs="?", help="a MindSpeed MM / Megatron launch script (.sh)")
    parser.add_argument("-o", "--output", help="write the YAML here (default: standard output)")
    parser.add_argument("--base-dir", default=None,
                        help="directory the launch's relative paths start from (default: the script's folder; with "
                             "a flag list, the working directory)")
    parser.add_argument("--import-root", default=None,
                        help="directory lightning-mm will run from, where the entry script's import path starts "
                             "(default: the working directory if the script lies below it, else the script's folder)")
    parser.add_argument("--keep-backend", action="store_true",
                        help="keep --distributed-backend instead of letting the accelerator choose it")
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
        if path.suffix == ".py":
            parser.error(f"{path} is the entry script; give the shell script that launches it (torchrun ... "
                         f"{path.name} ...), or its training flags after `--`")
        launch = parse_script(path.read_text())
        base_dir = Path(args.base_dir) if args.base_dir else path.resolve().parent
    else:
        launch = parse_args(flags)
        base_dir = Path(args.base_dir) if args.base_dir else None
    import_root = Path(args.import_root) if args.import_root else None
    result = migrate(launch, base_dir=base_dir, import_root=import_root, keep_backend=args.keep_backend)
    header = f"# Generated by `lightning-mm migrate` from {args.script or 'a flag list'}. Review the report.\n"
    if result.import_root is not None:
        header += (f"# Run from {result.import_root}: lightning-mm fit --config "
                   f"{Path(args.output).resolve() if args.output else 'THIS_FILE'}\n")
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
