"""``lightning-mm migrate``: a MindSpeed MM / Megatron launch turned into a LightningCLI YAML.

    lightning-mm migrate pretrain_custom.sh -o config.yaml
    lightning-mm migrate -o config.yaml -- --use-torch-fsdp2 --fsdp2-config-path fsdp2_config.yaml --lr 1e-4 ...
    lightning-mm migrate finetune_qwen3vl_8B.sh -o config.yaml     # torchrun ... pretrain_transformers.py cfg.yaml
    lightning-mm migrate qwen3vl_full_sft_8B.yaml -o config.yaml   # MindSpeed MM's single YAML itself
    lightning-mm migrate qwen3vl_30B_config_v1.yaml -o config.yaml # its native FSDP2 route's six-section YAML

    lightning-mm migrate finetune_qwen3_5_35B.sh -o config.yaml  # torchrun ... mindspeed_mm/fsdp/train/trainer.py cfg
    lightning-mm migrate model_7b.json -o config.yaml              # one component (model.json, data config, FSDP2)

A file of a kind this project does not train (audio models, DeepSpeed or MindSpore launches, RL post-training,
inference scripts, ...) is refused with a reason of :mod:`lightning_mm.commands.refusals`, decided from its content
(:mod:`lightning_mm.commands.launch_kinds`). Shell scripts are read by :mod:`lightning_mm.commands.launch_script`;
a Wan model.json becomes MMWanModule (:mod:`lightning_mm.commands.mindspeed_diffusion`), and a Megatron-route VLM
model.json its Transformers twin (``--hf-path``, or the data config's ``model_name_or_path``).

MindSpeed MM's single-YAML form (``gpt_args``, ``data``, ``model`` sections) is read with the project's safe YAML
loader: ``gpt_args`` go through the same flag table as the flags of a script, ``data`` becomes
``MMDataModule(data_config=<that YAML>)`` and ``model`` a TransformersModel config
(:mod:`lightning_mm.hf.mindspeed_model`). Every flag and key is either mapped or listed in the report with the
reason; nothing is dropped silently. An existing output file is never overwritten without ``--force``, and the input
never.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_mm.commands.launch_script import (
    UNEVALUATED,
    Launch,
    MigrateError,
    parse_args,
    parse_script,
    read_text_file,
)

if TYPE_CHECKING:
    from lightning_mm.commands.native_route import NativeMigration

__all__ = [
    "main",
    "Launch",
    "MigrateError",
    "parse_script",
    "parse_args",
    "migrate",
    "migrate_yaml",
    "STRATEGY_ARGS",
    "SEED_FUNCTIONS",
]

# MMFSDP2Strategy's __init__ arguments, listed here so that migrating never imports Lightning
# (tests/test_migrate.py checks the list against the class).
STRATEGY_ARGS = frozenset(
    {
        "fsdp2_config",
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision_plugin",
        "process_group_backend",
        "timeout",
        "empty_init",
        "checkpoint_format",
        "strict_loading",
        "fused_optimizer_step",
        "stop_timeout",
        "context_parallel_size",
        "context_parallel_algo",
        "stop_on_nonfinite",
        "storage_options",
        "save_ckpt_dtype",
        "async_save",
    }
)
# The seed's functions and where each goes (MMLightningModule / MMDataModule arguments).
SEED_FUNCTIONS = {
    "model_provider": "model.init_args.model_provider",
    "forward_step": "model.init_args.forward_step",
    "get_batch": "model.init_args.get_batch",
    "loss_func": "model.init_args.loss_func",
    "train_valid_test_datasets_provider": "data.init_args.train_valid_test_datasets_provider",
}


# ------------------------------------------------------------------------------------------ mapping
@dataclass
class Migration:
    config: dict[str, Any]
    mapped: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    import_root: Path | None = None
    """Where the entry script's functions import from (lightning-mm must run there)."""
    run_from: Path | None = None
    """The launch directory, where a MindSpeed MM data config's relative paths start (lightning-mm must run there)."""
    rendezvous: dict[str, str] = field(default_factory=dict)
    """torchrun's literal ``master_addr`` / ``master_port`` of a multi-node launch, for :func:`launch_lines`."""

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


# The range of each numeric flag, as (low, high, integer): a value outside it is an error naming the flag, before
# anything is written (a warmup fraction of 1.5 would be a warmup longer than the run).
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "--micro-batch-size": (1, None, True),
    "--global-batch-size": (1, None, True),
    "--train-iters": (1, None, True),
    "--lr": (0, None, False),
    "--min-lr": (0, None, False),
    "--weight-decay": (0, None, False),
    "--adam-beta1": (0, 1, False),
    "--adam-beta2": (0, 1, False),
    "--lr-warmup-iters": (0, None, True),
    "--lr-warmup-fraction": (0, 1, False),
    "--clip-grad": (0, None, False),
    "--seed": (0, 2**32 - 1, True),
    "--log-interval": (1, None, True),
    "--eval-interval": (1, None, True),
    "--eval-iters": (0, None, True),
    "--save-interval": (1, None, True),
    "--num-workers": (0, None, True),
    "--max-seq-len": (1, None, True),
    "--dynamic-batch-buffer-size": (1, None, True),
}


def _shown_bound(bound: float) -> str:
    """A range bound as a message shows it: ``4294967295``, ``0.5``."""
    return str(int(bound)) if bound == int(bound) else f"{bound:g}"


def _number(value: str | None, flag: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{flag} needs a number, got {value!r}") from None
    low, high, integer = _RANGES.get(flag, (None, None, False))
    if (
        not math.isfinite(number)
        or (integer and number != int(number))
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        bounds = " and ".join(
            f"{sign} {_shown_bound(bound)}" for sign, bound in ((">=", low), ("<=", high)) if bound is not None
        )
        want = ("an integer" if integer else "a number") + (f" {bounds}" if bounds else "")
        raise MigrateError(f"{flag} needs {want}, got {value!r}")  # refused, not merely left out
    return number


def _defined_functions(script: Path) -> dict[str, set[str]] | None:
    """The top-level functions of an entry script (read, never imported), each with the names its body uses;
    None if there is no such file. A binary, non-UTF-8 or too deeply nested file is an error naming it."""
    if not script.is_file():
        return None
    text = read_text_file(script, "an entry script")
    try:
        tree = ast.parse(text, filename=str(script))
    except SyntaxError as err:
        raise MigrateError(f"{script}:{err.lineno}: not valid Python: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise MigrateError(f"{script}: nested too deeply for Python's parser; not an entry script") from None
    except ValueError as err:
        raise MigrateError(f"{script}: cannot be parsed as Python: {err}") from None
    functions: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            try:
                names = {
                    n.id if isinstance(n, ast.Name) else n.attr
                    for n in ast.walk(node)
                    if isinstance(n, (ast.Name, ast.Attribute))
                }
            except RecursionError:
                raise MigrateError(f"{script}: nested too deeply for Python's parser; not an entry script") from None
            functions[node.name] = names
    return functions


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


def _encoder_dp_balance(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.values["encoder_dp_balance"] = shown  # into the FSDP2 config once --fsdp2-config-path is known


def _map_encoder_dp_balance(state: _Flags) -> None:
    """``--encoder-dp-balance`` -> ``encoder_dp_balance: true`` in the strategy's FSDP2 config: a dict with the
    key when no FSDP2 YAML is given, else that YAML's keys inlined with it added (migrate never edits the file)."""
    shown = state.values.get("encoder_dp_balance")
    if shown is None:
        return
    state.cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
    init_args = state.cfg["trainer"]["strategy"]["init_args"]
    given = init_args.get("fsdp2_config")
    target = "trainer.strategy.init_args.fsdp2_config.encoder_dp_balance: true"
    if given is None:
        init_args["fsdp2_config"] = {"encoder_dp_balance": True}
        state.out.mapped.append(f"{shown} -> {target}")
        return
    path = Path(given)
    if not path.is_file():
        state.out.unmapped.append(f"{shown}: add `encoder_dp_balance: true` to {path} when you write it")
        return
    try:
        keys = _load_yaml(path)
    except MigrateError as err:
        state.out.unmapped.append(f"{shown}: {err}")
        return
    if keys.get("encoder_dp_balance") is True:
        state.out.mapped.append(f"{shown} -> encoder_dp_balance: true, already in {path}")
        return
    init_args["fsdp2_config"] = {**keys, "encoder_dp_balance": True}
    state.out.mapped.append(f"{shown} -> {target} (the keys of {path} written inline with it; the file is unchanged)")


def _backend(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    if state.keep_backend:
        state.strategy("process_group_backend", value)
        state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.process_group_backend (--keep-backend)")
    else:
        state.out.notes.append(
            f"{shown}: left out; the backend follows the accelerator (nccl on CUDA, hccl on "
            "Ascend, gloo on CPU). `migrate --keep-backend` keeps it"
        )


def _load(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.values["load"] = value  # pretrained weights or a resume: decided by _map_load from what it names


def _map_load(state: _Flags) -> None:
    """``--load``: pretrained weights and resuming are kept apart. Only ``--load`` equal to ``--save`` resumes this
    job's own checkpoints (``ckpt_path: last``); a Hugging Face directory is the model's starting weights
    (``init_from_hf_path``); a checkpoint written here is resumed by its path (its model is checked at ``fit``).
    Anything else is named, never turned into a resume from ``--save`` (two jobs sharing a save directory would
    resume each other)."""
    value, out = state.values.get("load"), state.out
    if not value:
        return
    load = state.path_of(value)
    save = state.path_of(state.values["save"]) if state.values.get("save") else None
    model = state.cfg["model"]["init_args"].get("transformers_model")
    if save is not None and load == save:
        state.cfg["ckpt_path"] = "last"
        out.mapped.append(f"--load {value} (= --save) -> ckpt_path: last (resumes this job's own checkpoints)")
    elif (load / "config.json").is_file():
        if not isinstance(model, dict):
            out.unmapped.append(
                f"--load {value}: a Hugging Face model directory (pretrained weights); load it in model_provider"
            )
        elif model.get("init_from_hf_path") in (None, str(load)):
            model["init_from_hf_path"] = str(load)
            out.mapped.append(
                f"--load {value} -> model.init_args.transformers_model.init_from_hf_path (pretrained weights, "
                "not a resume)"
            )
        else:
            out.unmapped.append(
                f"--load {value}: pretrained weights other than the model config's init_from_hf_path "
                f"{model['init_from_hf_path']}; set the one to start from"
            )
    elif (load / "meta.pt").is_file() or load.suffix == ".ckpt":
        state.cfg["ckpt_path"] = str(load)
        out.mapped.append(f"--load {value} -> ckpt_path (a checkpoint written by lightning-mm, resumed)")
    elif load.exists():
        out.unmapped.append(
            f"--load {value}: not a Hugging Face directory nor a lightning-mm checkpoint (a MindSpeed MM / Megatron "
            "checkpoint?); start from the Hugging Face weights it was converted from (init_from_hf_path)"
        )
    else:
        out.unmapped.append(
            f"--load {value}: does not exist; give pretrained weights as init_from_hf_path, or resume with ckpt_path"
        )


def _mm_data(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.values["mm_data"] = (shown, state.path_of(value))


def _mm_model(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    state.values["mm_model"] = (shown, state.path_of(value), None)


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


def _only_one(reason: str) -> _Handler:
    """A parallelism size that only its value 1 (none) maps to: nothing to set."""

    def handle(state: _Flags, flag: str, value: str | None, shown: str) -> None:
        if value != "1":
            state.out.unmapped.append(f"{shown}: {reason}")
        else:
            state.out.notes.append(f"{shown}: none, as here; nothing to set")

    return handle


def _optimizer(state: _Flags, flag: str, value: str | None, shown: str) -> None:
    if value in ("adam", "fused_torch_adamw", "fused_adamw"):
        state.out.notes.append(
            f"{shown}: MMLightningModule's AdamW (with torch's fused step under MMFSDP2Strategy's "
            "fused_optimizer_step, the default); nothing to set"
        )
    else:
        state.out.unmapped.append(f"{shown}: only AdamW is built in; override configure_optimizers for another")


MEGATRON_MODEL_FLAGS = (
    "--use-mcore-models",
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--group-query-attention",
    "--num-query-groups",
    "--seq-length",
    "--max-position-embeddings",
    "--vocab-size",
    "--make-vocab-size-divisible-by",
    "--tokenizer-type",
    "--normalization",
    "--swiglu",
    "--use-fused-rmsnorm",
    "--use-fused-swiglu",
    "--use-flash-attn",
    "--no-masked-softmax-fusion",
    "--no-gradient-accumulation-fusion",
    "--use-cpu-initialization",
    "--init-model-with-meta-device",
    "--position-embedding-type",
    "--use-fused-rotary-pos-emb",
    "--use-distributed-optimizer",
    "--variable-seq-lengths",
)
"""Megatron's model-building and kernel flags: on the Transformers route MindSpeed MM itself reads the model from
its Hugging Face config, and here the model is what ``model_provider`` builds."""


# Every Megatron / MindSpeed MM flag migrate knows, in one table. Flags kept in ``values`` are mapped after the
# loop, where they meet the flags they depend on (batch sizes, betas, warmup fraction, checkpoint callback, data).
# A new flag is one line: ``_to(config path, type)`` for a Trainer / module / data key, ``_strategy_arg(name, type)``
# for an MMFSDP2Strategy argument, ``_refuse(reason)`` for one that has no equivalent.
FLAGS: dict[str, _Handler] = {
    "--use-torch-fsdp2": _use_fsdp2,
    "--fsdp2-config-path": _fsdp2_config,
    "--ckpt-format": _strategy_arg(
        "checkpoint_format", choices=("torch_dcp", "torch"), reason="only torch_dcp and torch are supported"
    ),
    "--distributed-backend": _backend,
    "--encoder-dp-balance": _encoder_dp_balance,
    "--micro-batch-size": _to("data.init_args.batch_size", int, keep="mbs"),
    "--global-batch-size": _keep("gbs", int),
    "--lr": _to("model.init_args.lr"),
    "--min-lr": _to("model.init_args.min_lr"),
    "--weight-decay": _to("model.init_args.weight_decay"),
    "--adam-beta1": _keep(),
    "--adam-beta2": _keep(),
    "--lr-decay-style": _choice(
        "model.init_args.lr_decay_style",
        ("cosine", "linear", "constant"),
        "only cosine, linear and constant decay are built in",
    ),
    "--lr-warmup-iters": _to("model.init_args.warmup_steps", int),
    "--lr-warmup-fraction": _keep("warmup_fraction"),
    "--train-iters": _to("trainer.max_steps", int, keep="train_iters"),
    "--clip-grad": _to("trainer.gradient_clip_val"),
    "--bf16": _const("trainer.precision", "bf16-mixed"),
    "--fp16": _refuse(
        "fp16 mixed precision needs a sharded grad scaler; use --bf16 (bf16-mixed) or "
        "param_dtype: fp16 in the FSDP2 YAML"
    ),
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
    "--mm-model": _mm_model,
    "--untie-embeddings-and-output-weights": _refuse(
        "a model property; build untied embedding/output weights in model_provider (tied ones are grouped into one "
        "FSDP unit automatically)"
    ),
    "--num-workers": _to("data.init_args.num_workers", int),
    "--use-txt-dynamic-batching": _keep("dynamic_batching", None),
    "--max-seq-len": _keep("max_seq_len", int),
    "--dynamic-batch-buffer-size": _keep("dynamic_batch_buffer_size", int),
    # kept as written; _map_lora range-checks them as it does the single YAML's lora_args
    "--lora-r": _keep("lora_r", None),
    "--lora-alpha": _keep("lora_alpha", None),
    "--lora-dropout": _keep("lora_dropout", None),
    "--lora-target-modules": _keep("lora_target_modules", None),
    "--lora-register-forward-hook": _keep("lora_register_forward_hook", None),
    "--layerzero": _refuse(
        "MindSpeed's LayerZero (ZeRO-3 over its own units); FSDP2 shards the model here (MMFSDP2Strategy, units from "
        "--fsdp2-config-path or the model's default plan)"
    ),
    "--layerzero-config": _refuse(
        "MindSpeed's LayerZero config (zero3_size, transformer_layers, ...); FSDP2 shards the model here: give an "
        "FSDP2 YAML (--fsdp2-config-path) for the units"
    ),
    "--mm-tool": _refuse("MindSpeed MM's tool definitions for its chat templates; not read by lightning-mm"),
    "--tensor-model-parallel-size": _only_one("tensor parallelism is not supported (FSDP2 and context parallelism)"),
    "--pipeline-model-parallel-size": _only_one(
        "pipeline parallelism is not supported (FSDP2 and context parallelism)"
    ),
    "--optimizer-selection": _optimizer,
    "--no-load-optim": _refuse(
        "a resume here restores the optimizer and RNG state with the weights; to start from "
        "weights alone, give TransformersModel's init_from_hf_path or a weights checkpoint "
        "(lightning-mm convert hf-to-dcp)"
    ),
    "--no-load-rng": _refuse("a resume here restores the RNG state with the weights"),
    "--no-save-optim": _refuse("checkpoints here always hold the optimizer state"),
    "--no-save-rng": _refuse("checkpoints here always hold each rank's RNG state"),
    "--log-tps": _refuse(
        "throughput (tokens per second) is logged by MMLightningModule's ThroughputMonitor (train/items_per_sec)"
    ),
    **dict.fromkeys(
        MEGATRON_MODEL_FLAGS,
        _refuse(
            "a Megatron model or kernel setting; the model is the one model_provider builds (TransformersModel: from "
            "init_from_hf_path's config.json)"
        ),
    ),
}


GLOBAL_BATCH = "lightning_mm.commands.global_batch.GlobalBatchSize"
"""The callback that keeps MindSpeed MM's global batch size on any world size."""
TRANSFORMERS_MODULE = "lightning_mm.modules.transformers_module.MMTransformersModule"
"""The LightningModule a TransformersModel config is written for (MindSpeed MM's pretrain_transformers.py)."""
MINDSPEED_ENTRY_SCRIPTS = ("pretrain_transformers.py", "pretrain_vlm.py", "pretrain_sora.py")
"""MindSpeed MM's own entry scripts of the Transformers route: their functions read Megatron's globals and become
lightning-mm's built-ins (TransformersModel from --mm-model, MMDataModule(data_config) from --mm-data)."""


def migrate(
    launch: Launch,
    base_dir: Path | None = None,
    import_root: Path | None = None,
    keep_backend: bool = False,
    single_yaml: tuple[Path, Mapping[str, Any]] | None = None,
    hf_path: Path | None = None,
) -> Migration:
    """Map a launch onto a LightningCLI config; everything not mapped is listed with the reason.

    Relative paths in the launch are taken from ``base_dir`` (the launch directory: by default the working
    directory) and written as absolute paths, so that the config works wherever it is written. The entry script's
    functions are named by their import path from ``import_root`` (default: the working directory when the script
    lies below it, else the script's folder): LightningCLI resolves class paths from the directory it runs in.
    ``--distributed-backend`` is left to the accelerator (nccl, hccl or gloo) unless ``keep_backend``.
    ``single_yaml`` is MindSpeed MM's single YAML (its path and content): its ``gpt_args`` replace the launch's
    training flags, as MindSpeed MM's ``read_yaml_config.py`` does, and its ``data`` / ``model`` sections are used.
    """
    cfg: dict[str, Any] = {
        "trainer": {},
        "model": {"class_path": "lightning_mm.MMLightningModule", "init_args": {}},
        "data": {"class_path": "lightning_mm.MMDataModule", "init_args": {}},
    }
    state = _Flags(cfg, Migration(cfg), {}, Path.cwd() if base_dir is None else Path(base_dir), keep_backend)
    if hf_path is not None:
        state.values["hf_path"] = Path(hf_path).resolve()
    world = _map_launcher(state, launch)
    functions = _map_entry_script(state, launch, import_root)
    flags = [(flag, value, f"{flag} {value}" if value is not None else flag) for flag, value in launch.flags]
    if single_yaml is not None:
        for _, _, shown in flags:
            state.out.unmapped.append(
                f"{shown}: after the YAML on the launch line, which MindSpeed MM ignores too "
                "(its read_yaml_config.py rebuilds the command line from gpt_args)"
            )
        flags = _map_single_yaml(state, *single_yaml)
    flags = _join_list_values(flags)
    for flag, value, shown in flags:
        handler = FLAGS.get(flag)
        if value is not None and UNEVALUATED in value:
            state.out.unmapped.append(
                f"{shown}: its value comes from shell that migrate does not run (see the notes); set it by hand"
            )
            continue
        if handler is None:
            state.out.unmapped.append(f"{shown}: unknown to lightning-mm migrate")
            continue
        try:
            handler(state, flag, value, shown)
        except MigrateError as err:  # a value out of its range: the job cannot run as written
            raise MigrateError(f"{shown}: {err}") from None
        except ValueError as err:  # not a number (e.g. a shell variable the reader could not evaluate)
            state.out.unmapped.append(f"{shown}: {err}")
    _map_combined(state, world)
    _map_encoder_dp_balance(state)
    _map_dynamic_batching(state)
    _map_checkpointing(state)
    _map_model(state, launch, functions)
    _map_lora(state)
    _map_load(state)
    _map_data(state, launch, functions)
    for name in launch.env:
        if name in ("CUDA_DEVICE_MAX_CONNECTIONS",):
            state.out.unmapped.append(f"{name}: Megatron tuning variable, not needed by FSDP2")
    return state.out


def migrate_yaml(path: Path, base_dir: Path | None = None, keep_backend: bool = False) -> Migration:
    """MindSpeed MM's single YAML (``gpt_args``, ``data``, ``model``) given by itself; relative paths in it are
    taken from ``base_dir`` (the launch directory, by default the working directory), as MindSpeed MM does."""
    return migrate(Launch(), base_dir=base_dir, keep_backend=keep_backend, single_yaml=(path, _load_yaml(path)))


def _load_yaml(path: Path) -> dict[str, Any]:
    from lightning_mm._yaml import load_mapping

    return load_mapping(path, MigrateError)


_YAML_SECTIONS = ("gpt_args", "lora_args", "data", "model", "MM_TOOL_PATH")


def _flatten_gpt_args(node: Mapping[str, Any], section: str) -> list[tuple[str, Any]]:
    """``gpt_args`` as MindSpeed MM flattens them: nested mappings dissolved, leaves kept, later keys winning."""
    items: dict[str, Any] = {}

    def walk(value: Mapping[str, Any]) -> None:
        for key, item in value.items():
            if isinstance(item, Mapping):
                walk(item)
            else:
                items.pop(str(key), None)
                items[str(key)] = item

    walk(node)
    return list(items.items())


def _map_single_yaml(state: _Flags, path: Path, config: Mapping[str, Any]) -> list[tuple[str, str | None, str]]:
    """The sections of MindSpeed MM's single YAML: ``gpt_args`` as flags (returned), ``data`` and ``model`` kept
    for :func:`_map_data` / :func:`_map_model`, every other key reported."""
    out = state.out
    gpt_args = config.get("gpt_args")
    if not isinstance(gpt_args, Mapping):
        raise MigrateError(
            f"{path}: no `gpt_args` mapping; MindSpeed MM's single YAML has gpt_args, data and model sections"
        )
    flags: list[tuple[str, str | None, str]] = []
    for key, value in _flatten_gpt_args(gpt_args, "gpt_args"):
        flag = "--" + key.replace("_", "-")
        shown = f"gpt_args.{key}: {value}"
        if value is True:
            flags.append((flag, None, shown))
        elif value is False or value is None:
            out.notes.append(f"{shown}: off / unset, nothing to map")
        elif isinstance(value, list):
            flags += [(flag, str(item), f"{shown} [{i}]") for i, item in enumerate(value)]
        else:
            flags.append((flag, str(value), shown))
    if "data" in config:
        state.values["mm_data"] = (f"{path.name} data:", path)
    if "model" in config:
        state.values["mm_model"] = (f"{path.name} model:", path, config["model"])
    if "lora_args" in config:
        _read_lora_args(state, f"{path}: ", config["lora_args"])
    if "MM_TOOL_PATH" in config:
        out.unmapped.append(
            f"MM_TOOL_PATH {config['MM_TOOL_PATH']} (--mm-tool): MindSpeed MM's tool definitions for "
            "its chat templates; not read by lightning-mm"
        )
    for key, value in config.items():
        if key in _YAML_SECTIONS:
            continue
        if isinstance(value, (Mapping, list)):
            out.unmapped.append(
                f"{path.name}: top-level section `{key}`: unknown to MindSpeed MM and to lightning-mm migrate"
            )
        else:
            out.notes.append(
                f"{path.name}: top-level `{key}: {value}`: MindSpeed MM reads no such key (values like "
                "this one are used through YAML anchors); nothing to map"
            )
    return flags


# MindSpeed MM's Megatron-route LoRA (mindspeed_mm/arguments.py `_add_lora_args`, tasks/finetune/lora/lora_patch.py:
# PEFT's LoraConfig(r, lora_alpha, target_modules, lora_dropout, bias="none")) -> the lora block of TransformersModel.
_LORA_ARGS = {
    "lora_r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "lora_target_modules": "target_modules",
}
_LORA_DEFAULTS = {"rank": 8, "alpha": 16, "dropout": 0.0}  # MindSpeed MM's argument defaults
_LORA_REFUSED = {
    "lora_target_parameters": "LoRA on raw parameters (routed experts' 3-D weights) is not supported here",
    "lora_apply_modules": "lora_mixed_training's module filter is not supported here",
    "lora_mixed_training": "training LoRA adapters together with unfrozen base weights is not supported here",
    "load_base_model": "a Megatron base checkpoint; the base weights here come from init_from_hf_path",
}


_LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_register_forward_hook")
"""The launch flags' names (``--lora-r`` ...) as :data:`FLAGS` keeps them; the same keys as ``lora_args``."""


def _lora_shown(key: str, where: str) -> str:
    """``lora_args.KEY`` of a single YAML (``where`` names the file), or the launch flag ``--lora-...``."""
    return f"lora_args.{key}" if where else "--" + key.replace("_", "-")


def _read_lora_args(state: _Flags, where: str, lora: Any) -> None:
    """MindSpeed MM's LoRA arguments, from a single YAML's ``lora_args`` (``where`` is ``"FILE: "``) or the
    launch flags (``where`` is ``""``): checked (each value in its range, naming the key or flag) and kept
    for :func:`_map_lora`, which writes them once the model config exists."""
    out = state.out
    if not isinstance(lora, Mapping):
        raise MigrateError(f"{where}`lora_args`: expected a mapping, got {type(lora).__name__}")
    config: dict[str, Any] = dict(_LORA_DEFAULTS)
    for key, value in lora.items():
        shown = _lora_shown(key, where)
        if key in _LORA_ARGS:
            if key == "lora_target_modules":
                items = value if isinstance(value, list) else str(value).split(",")
                targets = [str(t).strip() for t in items if str(t).strip()]
                if not targets:
                    raise MigrateError(f"{where}`{shown}`: expected module names, got {value!r}")
                config["target_modules"] = targets
            else:
                low, integer = (1, True) if key == "lora_r" else (0, False)
                number = _number_key(value, f"{where}`{shown}`", low, 1 if key == "lora_dropout" else None, integer)
                if key == "lora_dropout" and number >= 1:
                    raise MigrateError(f"{where}`{shown}`: expected a probability below 1, got {value!r}")
                if key == "lora_alpha" and number <= 0:
                    raise MigrateError(f"{where}`{shown}`: expected a number > 0, got {value!r}")
                config[_LORA_ARGS[key]] = int(number) if integer else number
        elif key == "lora_register_forward_hook":
            out.notes.append(
                f"{shown} {value}: MindSpeed MM marks these modules' outputs as needing gradients so that "
                "reentrant recomputation reaches the adapters; not needed here (recompute is non-reentrant "
                "unless use_reentrant is set)"
            )
        elif key in _LORA_REFUSED:
            (out.unmapped if value not in (None, False, [], "") else out.notes).append(
                f"{shown} {value}: {_LORA_REFUSED[key]}" if value not in (None, False, [], "") else f"{shown}: off"
            )
        else:
            out.unmapped.append(f"{shown}: not one of MindSpeed MM's LoRA arguments")
    if set(config) == set(_LORA_DEFAULTS) and not where and "lora_target_modules" not in lora:
        if any(k in lora for k in _LORA_ARGS):  # --lora-r without targets: MindSpeed MM's default [] is no LoRA
            raise MigrateError(
                "`--lora-target-modules`: LoRA needs its target modules (MindSpeed MM's default is none)"
            )
        return  # only --lora-register-forward-hook: nothing to adapt
    if "target_modules" not in config:
        raise MigrateError(f"{where}`{_lora_shown('lora_target_modules', where)}`: LoRA needs its target modules")
    state.values["lora"] = config


def _number_key(value: Any, where: str, low: float | None, high: float | None, integer: bool) -> float:
    """A number written in a YAML, in its range; an error naming ``where`` (file and key) otherwise."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if (
        not math.isfinite(number)
        or (integer and number != int(number))
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        bounds = " and ".join(f"{sign} {_shown_bound(b)}" for sign, b in ((">=", low), ("<=", high)) if b is not None)
        raise MigrateError(f"{where}: expected {'an integer' if integer else 'a number'} {bounds}, got {value!r}")
    return number


def _map_lora(state: _Flags) -> None:
    """MindSpeed MM's LoRA (the single YAML's ``lora_args``, kept by :func:`_read_lora_args`, or the launch
    flags ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-target-modules``) ->
    ``model.init_args.transformers_model.lora`` (PEFT)."""
    flags = {key: state.values[key] for key in _LORA_FLAGS if key in state.values}
    if flags and "lora" in state.values:
        raise MigrateError("LoRA is given both as launch flags (--lora-*) and as lora_args; keep one")
    shown = ", ".join(_lora_shown(key, "") for key in flags if key != "lora_register_forward_hook")
    source = shown or "lora_args (lora_r, lora_alpha, lora_dropout, lora_target_modules)"
    model = state.cfg["model"].get("init_args", {}).get("transformers_model")
    from lightning_mm.commands.mindspeed_diffusion import WAN_MODULE

    if state.cfg["model"].get("class_path") == WAN_MODULE and (shown or "lora" in state.values):
        if flags:
            _read_lora_args(state, "", flags)
        if state.values.get("lora") is not None:
            _map_wan_lora(state, state.values["lora"], source)
        return
    if not isinstance(model, dict):
        if shown or "lora" in state.values:
            state.out.unmapped.append(
                f"{source}: LoRA is mapped onto TransformersModel's lora only; set the model's lora (rank, alpha, "
                f"target_modules, dropout) by hand: {state.values.get('lora', flags)}"
            )
        elif flags:  # --lora-register-forward-hook alone: only its note
            _read_lora_args(state, "", flags)
        return
    if flags:
        _read_lora_args(state, "", flags)
    lora = state.values.get("lora")
    if lora is None:
        return
    model["lora"] = lora
    state.out.mapped.append(
        f"{source} -> model.init_args.transformers_model.lora "
        f"{lora} (a bare module name adapts every module whose path ends with it, as in MindSpeed MM)"
    )


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
    for key in ("nproc_per_node", "nnodes"):
        value = launch.launcher.get(key)
        if value is not None and not value.isdigit():
            target = "trainer.devices" if key == "nproc_per_node" else "trainer.num_nodes"
            why = (
                "comes from shell that migrate does not run (see the notes)" if UNEVALUATED in value else "not a number"
            )
            out.unmapped.append(f"torchrun --{key} {value}: {why}; set {target}")
    _map_rendezvous(state, launch, int(nnodes) if nnodes and nnodes.isdigit() else None)
    return world


_RENDEZVOUS = ("node_rank", "master_addr", "master_port")
"""torchrun's per-launch options: the printed launch lines carry them, the YAML does not."""


def _map_rendezvous(state: _Flags, launch: Launch, nnodes: int | None) -> None:
    """``--node_rank`` / ``--master_addr`` / ``--master_port``: on several nodes, a literal address and port go
    into the printed torchrun line (:func:`launch_lines`) and the node rank is each node's own; a value from shell
    migrate does not run, or a placeholder, is NOT mapped with that reason. On one node torchrun's local
    rendezvous needs none of them."""
    out = state.out
    for key in launch.launcher:
        if key in ("nproc_per_node", "nnodes"):
            continue
        value = launch.launcher[key]
        shown = f"torchrun --{key} {value}" if value is not None else f"torchrun --{key}"
        if key not in _RENDEZVOUS:
            out.unmapped.append(f"{shown}: a torchrun option lightning-mm's launch lines do not take; set it by hand")
        elif value is None or UNEVALUATED in value:
            out.unmapped.append(
                f"{shown}: comes from shell that migrate does not run (see the notes); give it on the torchrun "
                "line of each node"
            )
        elif not _literal(value):
            out.unmapped.append(f"{shown}: not a literal value (a placeholder); give it on the torchrun line")
        elif nnodes == 1:
            out.notes.append(f"{shown}: one node: torchrun's local rendezvous, nothing to set")
        elif nnodes is None:
            out.unmapped.append(f"{shown}: the node count is not known (see --nnodes); give it on the torchrun line")
        elif key == "node_rank":
            out.mapped.append(
                f"{shown} -> the printed torchrun line's --node_rank $NODE_RANK (each node its own, 0..{nnodes - 1})"
            )
        else:
            out.rendezvous[key] = value
            out.mapped.append(f"{shown} -> the printed torchrun line (--{key} {value})")


def _literal(value: str) -> bool:
    """A value written out (an address, a port), not a placeholder such as ``<master_ip_address>``."""
    return bool(value) and not any(c in value for c in "<>$`{} ")


def _map_entry_script(state: _Flags, launch: Launch, import_root: Path | None) -> set[str]:
    """The seed functions the entry script defines, named by import path; returns their names.

    MindSpeed MM's own entry script (``pretrain_transformers.py``, or one whose ``model_provider`` builds
    ``TransformersModel`` from ``args.mm.model`` and whose provider calls ``build_mm_dataset``) reads Megatron's
    globals: those functions are replaced by lightning-mm's built-ins instead of being named.
    """
    cfg, out = state.cfg, state.out
    if not launch.script:
        return set()
    script = state.path_of(launch.script)
    defined = _defined_functions(script)
    if import_root is None:
        import_root = Path.cwd() if script.is_relative_to(Path.cwd().resolve()) else script.parent
    out.import_root = Path(import_root).resolve()
    module = _module_path(script, out.import_root) if script.is_relative_to(out.import_root) else script.stem
    if Path(launch.script).name in MINDSPEED_ENTRY_SCRIPTS:
        state.values["builtin_model"] = state.values["builtin_data"] = True
        out.import_root = None
        out.notes.append(
            f"{launch.script}: MindSpeed MM's own entry script; its model_provider, forward_step and "
            "datasets provider become lightning-mm's module for the model config (MMTransformersModule, or "
            "MMWanModule for a Wan model.json) and MMDataModule(data_config)"
        )
        return set()
    if defined is None:
        out.import_root = None
        out.unmapped.append(
            f"{launch.script}: entry script not found ({script}); add "
            "model.init_args.model_provider / forward_step by hand"
        )
        return set()
    functions = set(defined) & set(SEED_FUNCTIONS)
    if "forward_step" in functions:  # forward_step calls get_batch and returns loss_func itself
        functions -= {"get_batch", "loss_func"}
    if "TransformersModel" in defined.get("model_provider", set()) and "mm" in defined["model_provider"]:
        state.values["builtin_model"] = True  # TransformersModel(args.mm.model): the model config is used
        functions.discard("model_provider")
        out.notes.append(
            f"{launch.script}: model_provider builds TransformersModel from --mm-model; the model "
            "config is written instead"
        )
    provider = defined.get("train_valid_test_datasets_provider", set())
    if "build_mm_dataset" in provider:
        state.values["builtin_data"] = True  # MindSpeed MM's dataset from --mm-data: MMDataModule(data_config)
        functions.discard("train_valid_test_datasets_provider")
        out.notes.append(
            f"{launch.script}: train_valid_test_datasets_provider builds MindSpeed MM's dataset from "
            "--mm-data; MMDataModule(data_config) reads that file instead"
        )
    for fn in sorted(functions, key=list(SEED_FUNCTIONS).index):
        _set(cfg, SEED_FUNCTIONS[fn], f"{module}.{fn}")
        out.mapped.append(f"{launch.script}: {fn} -> {SEED_FUNCTIONS[fn]} = {module}.{fn}")
    if functions:
        out.notes.append(
            f"the entry script's functions are imported as `{module}`: run lightning-mm from "
            f"{out.import_root} (remove Megatron globals such as get_args() from them)"
        )
    else:
        out.import_root = None
    if "model_provider" not in functions and not state.values.get("builtin_model"):
        out.unmapped.append(
            f"{launch.script}: defines no `model_provider`; set {SEED_FUNCTIONS['model_provider']} by hand"
        )
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
        gbs = values["gbs"]
        _add_callback(cfg, {"class_path": GLOBAL_BATCH, "init_args": {"global_batch_size": gbs}})
        out.mapped.append(
            f"--global-batch-size {gbs} -> trainer.callbacks: GlobalBatchSize({gbs}) (the accumulation is derived "
            "from it at fit for the world size the run has: gbs / (micro batch x data-parallel ranks))"
        )
        cp = values.get("cp", 1)
        if world:
            from lightning_mm._global_batch import accumulation_for
            from lightning_mm.errors import ConfigError

            try:
                accumulate = accumulation_for(gbs, mbs, world, cp if world % cp == 0 else 1)
            except ConfigError as err:  # MindSpeed MM refuses the launch too
                raise MigrateError(f"--global-batch-size {gbs}: {err}") from None
            _set(cfg, "trainer.accumulate_grad_batches", accumulate)
            out.mapped.append(
                f"--global-batch-size {gbs} -> trainer.accumulate_grad_batches {accumulate} at the launch's "
                f"{world} ranks ({gbs} / ({mbs} x {world // (cp if world % cp == 0 else 1)} data-parallel ranks))"
            )


def _add_callback(cfg: dict[str, Any], callback: dict[str, Any]) -> None:
    cfg.setdefault("trainer", {}).setdefault("callbacks", []).append(callback)


def _drop_global_batch(state: _Flags, why: str) -> None:
    """Token-budget batches have no fixed sample count: the global batch size cannot be kept; say so."""
    callbacks = state.cfg["trainer"].get("callbacks") or []
    kept = [c for c in callbacks if c.get("class_path") != GLOBAL_BATCH]
    if len(kept) == len(callbacks):
        return
    state.cfg["trainer"]["callbacks"] = kept
    state.cfg["trainer"].pop("accumulate_grad_batches", None)
    state.out.mapped = [m for m in state.out.mapped if not m.startswith("--global-batch-size")]
    state.out.unmapped.append(
        f"--global-batch-size {state.values['gbs']}: {why}: a batch holds a token budget, not a number of samples; "
        "set trainer.accumulate_grad_batches"
    )


def _map_dynamic_batching(state: _Flags) -> None:
    """MindSpeed MM's Megatron-route dynamic batching (samples concatenated up to ``--max-seq-len`` tokens, chosen
    from a buffer of ``--dynamic-batch-buffer-size``) -> MMDataModule's packed token-budget batches."""
    out, values = state.out, state.values
    sizes = [f for f in ("max_seq_len", "dynamic_batch_buffer_size") if f in values]
    if "dynamic_batching" not in values:
        out.unmapped += [
            f"--{f.replace('_', '-')} {values[f]}: used only with --use-txt-dynamic-batching" for f in sizes
        ]
        return
    if "max_seq_len" not in values:
        out.unmapped.append(
            "--use-txt-dynamic-batching: needs --max-seq-len (the tokens of one packed row); set "
            "data.init_args.max_tokens_per_rank by hand"
        )
        return
    _set(state.cfg, "data.init_args.packing", True)
    _set(state.cfg, "data.init_args.max_tokens_per_rank", values["max_seq_len"])
    out.mapped += [
        "--use-txt-dynamic-batching -> data.init_args.packing: True",
        f"--max-seq-len {values['max_seq_len']} -> data.init_args.max_tokens_per_rank",
    ]
    if "dynamic_batch_buffer_size" in values:
        _set(state.cfg, "data.init_args.packing_buffer_size", values["dynamic_batch_buffer_size"])
        out.mapped.append(
            f"--dynamic-batch-buffer-size {values['dynamic_batch_buffer_size']} -> data.init_args.packing_buffer_size"
        )
    _drop_global_batch(state, "with dynamic batching")
    batch_size = state.cfg.get("data", {}).get("init_args", {}).pop("batch_size", None)
    if batch_size is not None:
        out.mapped = [m for m in out.mapped if not m.startswith("--micro-batch-size")]
        out.notes.append(
            f"--micro-batch-size {batch_size}: not used with dynamic batching (a batch holds as many "
            "samples as fit in --max-seq-len tokens, as in MindSpeed MM)"
        )


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
    _add_callback(cfg, callback)
    out.mapped.append(
        "--save/--save-interval -> trainer.callbacks: ModelCheckpoint(dirpath, every_n_train_steps, save_last: link)"
    )


def _map_model(state: _Flags, launch: Launch, functions: set[str]) -> None:
    """--mm-model (or the single YAML's ``model:``): a TransformersModel config, unless the entry script's own
    model_provider is used."""
    out = state.out
    if "mm_model" not in state.values:
        if state.values.get("builtin_model"):
            out.unmapped.append("no --mm-model (model.json): set model.init_args.transformers_model by hand")
        return
    shown, path, section = state.values["mm_model"]
    if "model_provider" in functions:
        out.unmapped.append(
            f"{shown}: read by the entry script's model_provider, which is used instead; build "
            "TransformersModel in it, or drop model_provider and give the model config "
            "(docs/migration.md)"
        )
        return
    if section is None:
        if not path.is_file():
            out.unmapped.append(f"{shown}: {path} does not exist; set model.init_args.transformers_model by hand")
            return
        section = _load_config_file(path)
    from lightning_mm.commands.mindspeed_diffusion import is_diffusion_model
    from lightning_mm.hf.mindspeed_model import MindSpeedModelError, transformers_model_config

    source = f"{path} (model)" if path.suffix.lower() in (".yaml", ".yml") else str(path)
    if is_diffusion_model(section):  # LoRA flags: _map_lora
        _map_diffusion_model(state, shown, section, source)
        return
    hf_dir, origin = _hf_dir(state)
    try:
        converted = transformers_model_config(
            section, source, state.base, hf_dir=hf_dir, hf_dir_origin=origin, hf_dir_overrides=origin == "--hf-path"
        )
    except MindSpeedModelError as err:
        if not err.megatron:
            raise
        from lightning_mm.commands.refusals import Refused

        raise Refused(source, "megatron-model", "its towers are MindSpeed MM's own Megatron modules") from None
    if "init_from_hf_path" not in section and state.values.get("load"):
        # a Megatron-route model.json: --load names MindSpeed MM's converted (Megatron-format) weights, which the
        # Transformers twin cannot read; it starts from the Hugging Face directory they were converted from
        state.cfg.pop("ckpt_path", None)
        out.mapped = [m for m in out.mapped if not m.startswith("--load ")]
        out.unmapped = [u for u in out.unmapped if not u.startswith("--load ")]
        out.notes.append(
            f"--load {state.values['load']}: MindSpeed MM's Megatron-format weights of its own towers; not read "
            "here: the Transformers twin starts from init_from_hf_path (the Hugging Face directory they were "
            "converted from); ckpt_path is not set (a resume is a checkpoint written here)"
        )
    model = state.cfg["model"]
    model["class_path"] = TRANSFORMERS_MODULE
    model["init_args"] = {"transformers_model": converted.config, **model["init_args"]}
    out.mapped.append(f"{shown} -> model: {TRANSFORMERS_MODULE} with transformers_model {converted.config}")
    out.mapped += [f"  {shown} {item}" for item in converted.mapped]
    out.notes += [f"{shown} {item} (not applicable)" for item in converted.not_applicable]
    out.unmapped += [f"{shown} {item}" for item in converted.unmapped]


_LIST_FLAGS = ("--lora-target-modules",)
"""Flags that take several values (``--lora-target-modules q_proj k_proj v_proj``)."""


def _join_list_values(flags: list[tuple[str, str | None, str]]) -> list[tuple[str, str | None, str]]:
    """The words after a list flag, up to the next ``--flag``, as one comma-separated value."""
    out: list[tuple[str, str | None, str]] = []
    for flag, value, shown in flags:
        if out and out[-1][0] in _LIST_FLAGS and value is None and not flag.startswith("--"):
            last, values, _ = out[-1]
            joined = f"{values},{flag}" if values else flag
            out[-1] = (last, joined, f"{last} {joined.replace(',', ' ')}")
            continue
        out.append((flag, value, shown))
    return out


def _map_wan_lora(state: _Flags, lora: Mapping[str, Any], source: str) -> None:
    """MindSpeed MM's LoRA (range-checked by :func:`_read_lora_args`) on a Wan job -> MMWanModule's
    ``diffusers_model.lora`` (PEFT on diffusers' WanTransformer3DModel), the targets renamed to diffusers' modules."""
    from lightning_mm.commands.mindspeed_diffusion import wan_lora_targets

    out = state.out
    targets = lora.get("target_modules") or []
    names = [str(m) for m in (targets.split(",") if isinstance(targets, str) else targets) if str(m).strip()]
    patterns, unknown = wan_lora_targets(names)
    if unknown:
        out.unmapped.append(
            f"--lora-target-modules {' '.join(unknown)}: not a linear of MindSpeed MM's wandit with a diffusers "
            "counterpart (known: proj_q, proj_k, proj_v, proj_out, k_img, v_img, ffn.0, ffn.2); add its "
            "diffusers path to model.init_args.diffusers_model.lora.target_modules by hand"
        )
    if not patterns:
        return
    mapped: dict[str, Any] = {k: v for k, v in lora.items() if k != "target_modules"}
    mapped.setdefault("rank", 8)  # MindSpeed MM's defaults (mindspeed_mm/arguments.py)
    mapped.setdefault("alpha", 16)
    mapped["target_modules"] = patterns
    state.cfg["model"]["init_args"]["diffusers_model"]["lora"] = mapped
    out.mapped.append(
        f"{source} -> model.init_args.diffusers_model.lora (PEFT on WanTransformer3DModel; targets "
        f"{', '.join(names)} -> {', '.join(patterns)}); every other weight is frozen, as MindSpeed MM's PEFT model"
    )


def _hf_dir(state: _Flags) -> tuple[str | None, str]:
    """The Hugging Face directory the job names: ``migrate --hf-path``, else its data config's
    ``dataset_param.preprocess_parameters.model_name_or_path`` (the processor's directory, the model's too)."""
    if state.values.get("hf_path"):
        return str(state.values["hf_path"]), "--hf-path"
    data = state.values.get("mm_data")
    if data is None or not data[1].is_file():
        return None, ""
    try:
        content: Mapping[str, Any] = _load_config_file(data[1])
    except MigrateError:
        return None, ""
    if "data" in content and "dataset_param" not in content:
        content = content["data"] if isinstance(content["data"], Mapping) else {}
    params = (content.get("dataset_param") or {}).get("preprocess_parameters") or {}
    value = params.get("model_name_or_path") if isinstance(params, Mapping) else None
    if not isinstance(value, str) or not value.strip():
        return None, ""
    return value, f"{data[0]} dataset_param.preprocess_parameters.model_name_or_path {value}"


def _map_diffusion_model(state: _Flags, shown: str, section: Mapping[str, Any], source: str) -> None:
    """A Wan model.json: MMWanModule (the diffusers path) with the weights of ``--load`` / ``--hf-path``."""
    from lightning_mm.commands.mindspeed_diffusion import wan_module_config

    out, cfg = state.out, state.cfg
    weights, origin = None, ""
    if state.values.get("hf_path"):
        weights, origin = str(Path(state.values["hf_path"]).resolve()), "--hf-path"
    elif state.values.get("load"):
        weights, origin = str(state.path_of(state.values["load"])), f"--load {state.values['load']}"
        cfg.pop("ckpt_path", None)  # on this route --load names the weights to start from, not a resume
        out.mapped = [m for m in out.mapped if not m.startswith("--load ")]
        out.unmapped = [u for u in out.unmapped if not u.startswith("--load ")]
    try:
        converted = wan_module_config(section, source, weights, origin)
    except ValueError as err:
        raise MigrateError(str(err)) from None
    init_args = {**cfg["model"].get("init_args", {}), **converted.model["init_args"]}
    strategy_args = cfg["trainer"].get("strategy", {}).get("init_args", {})
    if "fsdp2_config" in strategy_args:  # MindSpeed MM's Wan YAMLs are read by MMWanModule (their paths mapped)
        init_args["fsdp2_config"] = strategy_args.pop("fsdp2_config")
        out.mapped = [
            m.replace("-> trainer.strategy.init_args.fsdp2_config", "-> model.init_args.fsdp2_config")
            if m.startswith("--fsdp2-config-path")
            else m
            for m in out.mapped
        ]
        out.notes.append(
            "--fsdp2-config-path: given to MMWanModule(fsdp2_config=...), which reads MindSpeed MM's Wan YAMLs "
            "as written (predictor.* paths mapped to diffusers' names)"
        )
    cfg["model"] = {"class_path": converted.model["class_path"], "init_args": init_args}
    out.mapped += [f"{shown} {m}" for m in converted.mapped]
    out.notes += [f"{shown} {n}" for n in converted.notes]
    out.unmapped += [f"{shown} {u}" for u in converted.unmapped]


def _map_data(state: _Flags, launch: Launch, functions: set[str]) -> None:
    """--mm-data (or the single YAML's ``data:``) as MMDataModule's data_config, unless the entry script's own
    dataset provider reads it."""
    out = state.out
    provider = "train_valid_test_datasets_provider" in functions
    if "mm_data" in state.values:
        shown, data_path = state.values["mm_data"]
        if provider:
            out.unmapped.append(
                f"{shown}: read by the entry script's train_valid_test_datasets_provider, which is "
                "used instead; pass the file to it, or drop the provider to use the file as "
                "MMDataModule's data_config (docs/migration.md)"
            )
        elif data_path.is_file():
            _set(state.cfg, "data.init_args.data_config", str(data_path))
            out.mapped.append(f"{shown} -> data.init_args.data_config ({data_path})")
            _map_neat_packing(state, shown, data_path)
            out.run_from = state.base
            out.notes.append(
                f"{shown}: relative paths inside it are taken from the directory lightning-mm runs in, "
                f"as MindSpeed MM takes them from its launch directory: run from {state.base}"
            )
        else:
            out.unmapped.append(
                f"{shown}: {data_path} does not exist and the entry script defines no "
                "train_valid_test_datasets_provider; set data.init_args by hand"
            )
    elif launch.script and not provider:
        out.unmapped.append(
            "no --mm-data and no train_valid_test_datasets_provider in the entry script; set data.init_args by hand"
        )
    if "mbs" in state.values and provider:
        out.notes.append(
            f"--micro-batch-size {state.values['mbs']} -> data.init_args.batch_size: the batch size of "
            "the Datasets the provider returns; a DataLoader it returns must have this batch size "
            "(MMDataModule checks it at setup), or the global batch would differ from "
            "--global-batch-size"
        )


def _map_neat_packing(state: _Flags, shown: str, data_path: Path) -> None:
    """``neat_packing`` in the data config: MMDataModule packs rows of ``cutoff_len`` tokens (a token budget), which
    excludes a batch size, so ``--micro-batch-size`` is not written (MindSpeed MM packs to cutoff_len too)."""
    try:
        data = _load_yaml(data_path)
    except MigrateError:
        return  # MMDataModule reads the file and names what is wrong with it
    if isinstance(data.get("data"), Mapping):  # a single YAML's data: section
        data = data["data"]
    dataset = data.get("dataset_param")
    basic = dataset.get("basic_parameters") if isinstance(dataset, Mapping) else None
    if not (isinstance(basic, Mapping) and basic.get("neat_packing") is True):
        return
    state.out.mapped.append(
        f"{shown} dataset_param.basic_parameters.neat_packing, cutoff_len -> MMDataModule packing with "
        "max_tokens_per_rank = cutoff_len (read from the data config)"
    )
    _drop_global_batch(state, "with neat_packing")
    batch_size = state.cfg["data"]["init_args"].pop("batch_size", None)
    if batch_size is not None:
        state.out.mapped = [m for m in state.out.mapped if not m.endswith("-> data.init_args.batch_size")]
        state.out.notes.append(
            f"--micro-batch-size {batch_size}: not written: a packed batch holds cutoff_len tokens per rank "
            "(MMDataModule's batch_size and max_tokens_per_rank are exclusive)"
        )


_PATH_FLAGS = ("--mm-data", "--mm-model", "--fsdp2-config-path")


def _launch_dir(script: Path, launch: Launch) -> tuple[Path, str]:
    """Where a launch script's relative paths start, and why: the script's folder, unless more of the files the
    launch names (its YAML, entry script, --mm-data, --mm-model, --fsdp2-config-path) are found from the working
    directory, as MindSpeed MM's scripts are run (``bash examples/qwen3vl/finetune_qwen3vl_8B.sh`` from its
    repository root)."""
    folder, cwd = script.resolve().parent, Path.cwd().resolve()
    named = [n for n in (launch.config_yaml, launch.script) if n]
    named += [value for flag, value in launch.flags if flag in _PATH_FLAGS and value]
    from_folder = [n for n in named if (folder / n).exists()]
    from_cwd = [n for n in named if (cwd / n).exists()]
    if folder != cwd and len(from_cwd) > len(from_folder):
        return cwd, f"{', '.join(from_cwd)} found from the working directory, not from the script's folder"
    return folder, "the script's folder"


_DATA_KEYS = ("dataset_param", "dataloader_param")
_MODEL_KEYS = (
    "model_id",
    "init_from_hf_path",
    "predictor",
    "ae",
    "text_encoder",
    "image_encoder",
    "text_decoder",
    "diffusion",
)
_FSDP2_KEYS = ("sub_modules_to_wrap", "sharding_size", "param_dtype", "reduce_dtype", "recompute_modules")
_LAYERZERO_KEYS = ("zero3_size", "transformer_layers")


def _load_config_file(path: Path) -> dict[str, Any]:
    """A YAML or JSON config (JSON read as JSON: YAML refuses the tabs JSON allows)."""
    if path.suffix.lower() != ".json":
        try:
            return _load_yaml(path)
        except MigrateError as err:
            if "not valid YAML" not in str(err):
                raise
            from lightning_mm.commands.refusals import Refused

            raise Refused(str(path), "invalid", str(err)) from None
    import json

    try:
        data = json.loads(read_text_file(path, "a JSON config"))
    except ValueError as err:
        raise MigrateError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        from lightning_mm.commands.launch_kinds import refuse_list

        refuse_list(data, str(path))
        raise MigrateError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
    return data


def migrate_file(
    path: Path,
    base_dir: Path | None = None,
    import_root: Path | None = None,
    keep_backend: bool = False,
    hf_path: Path | None = None,
    world_size: int | None = None,
) -> tuple[Migration | NativeMigration, list[Path]]:
    """``lightning-mm migrate FILE``: the migration of a launch script, a single or native-route YAML, or one of
    MindSpeed MM's component configs given by itself (a model.json, a data config, an FSDP2 YAML), and the files it
    read. A file of a kind this project does not train is a :class:`~lightning_mm.commands.refusals.Refused`
    error naming the file and the reason (:data:`~lightning_mm.commands.refusals.REASONS`).

    ``world_size`` (``--world-size``: the launch's NPUs x nodes) records a native-route config's global batch
    size when the launch line does not give it (a YAML given by itself, or a script whose counts are shell)."""
    from lightning_mm.commands.launch_kinds import refuse_model_ids, refuse_yaml
    from lightning_mm.commands.native_route import is_native_route, migrate_native

    path = Path(path)
    source = str(path)
    inputs = [path]
    result: Migration | NativeMigration
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        base = Path(base_dir) if base_dir else Path.cwd()
        content = _load_config_file(path)
        refuse_yaml(content, source)
        absolute = str(path.resolve())
        if is_native_route(content):  # MindSpeed MM's native FSDP2 route: six sections, parallel first
            refuse_model_ids(content, source, ("model",))
            result = migrate_native(path, content, base_dir=base, world_size=world_size)
        elif "gpt_args" in content:
            refuse_model_ids(content, source, ("model",))
            result = migrate_yaml(path, base_dir=base, keep_backend=keep_backend)
        elif any(k in content for k in _DATA_KEYS):
            result = migrate(Launch(flags=[("--mm-data", absolute)]), base_dir=base)
        elif any(k in content for k in _MODEL_KEYS):
            refuse_model_ids(content, source)
            result = migrate(Launch(flags=[("--mm-model", absolute)]), base_dir=base, hf_path=hf_path)
        elif any(k in content for k in _FSDP2_KEYS) or any(k in content for k in _LAYERZERO_KEYS):
            flag = "--layerzero-config" if any(k in content for k in _LAYERZERO_KEYS) else "--fsdp2-config-path"
            result = migrate(Launch(flags=[("--use-torch-fsdp2", None), (flag, absolute)]), base_dir=base)
        else:
            raise MigrateError(
                f"{path}: not a MindSpeed MM launch script, single YAML, native-route YAML, model config, data "
                "config or FSDP2 config (none of their keys: gpt_args, parallel, model_id, dataset_param, "
                "sub_modules_to_wrap, ...)"
            )
        result.notes.insert(0, f"relative paths are taken from {base.resolve()} (the launch directory; --base-dir)")
        _world_size_used(result, world_size, path)
        return result, inputs
    result, read = _migrate_script(path, base_dir, import_root, keep_backend, hf_path, world_size)
    _world_size_used(result, world_size, path)
    return result, inputs + read


def _world_size_used(result: Migration | NativeMigration, world_size: int | None, path: Path) -> None:
    """``--world-size`` is for the native route; elsewhere it would be ignored, so it is refused."""
    if world_size is not None and isinstance(result, Migration):
        raise MigrateError(
            f"{path}: --world-size is read for a native-route config only; a Megatron-route launch's process "
            "counts come from its torchrun line (trainer.devices, trainer.num_nodes)"
        )


def _launch_world(launch: Launch) -> int | None:
    """torchrun's ``--nproc_per_node`` x ``--nnodes`` when both are literal numbers (one node when no
    ``--nnodes``); None when either comes from shell the reader did not evaluate."""
    nproc, nnodes = launch.launcher.get("nproc_per_node"), launch.launcher.get("nnodes", "1")
    if nproc and nproc.isdigit() and nnodes and nnodes.isdigit():
        return int(nproc) * int(nnodes)
    return None


def _migrate_script(
    path: Path,
    base_dir: Path | None,
    import_root: Path | None,
    keep_backend: bool,
    hf_path: Path | None,
    world_size: int | None = None,
) -> tuple[Migration | NativeMigration, list[Path]]:
    from lightning_mm.commands.launch_kinds import (
        NATIVE_TRAINER,
        refuse_entry_script,
        refuse_model_ids,
        refuse_script_text,
    )
    from lightning_mm.commands.native_route import is_native_route, migrate_native
    from lightning_mm.commands.refusals import Refused

    source = str(path)
    text = read_text_file(path, "a launch script")
    refuse_script_text(text, source)
    launch = parse_script(text, source)
    from lightning_mm.commands.extract_features import ENTRY_SCRIPT, command_for_launch

    if launch.script and Path(launch.script).name == ENTRY_SCRIPT:  # Wan's: lightning-mm extract-features
        raise Refused(source, "feature-extraction", command_for_launch(dict(launch.flags)))
    refuse_entry_script(launch.script, source)
    if base_dir is not None:
        base, why = Path(base_dir), "--base-dir"
    else:
        base, why = _launch_dir(path, launch)
    note = f"relative paths are taken from {base.resolve()} ({why})"
    read: list[Path] = []
    result: Migration | NativeMigration
    for flag, value in launch.flags:
        if flag == "--mm-model" and value and (base / value).is_file():
            refuse_model_ids(_load_config_file(base / value), f"{source} (--mm-model {value})")
    if launch.config_yaml:
        yaml_path = (base / launch.config_yaml).resolve()
        if not yaml_path.is_file():
            raise MigrateError(
                f"{path}: the launch's YAML {launch.config_yaml} is not found at {yaml_path}; "
                "give the launch directory with --base-dir"
            )
        read.append(yaml_path)
        try:
            content = _load_config_file(yaml_path)
        except Refused as err:
            raise Refused(f"{source} ({launch.config_yaml})", err.code, err.detail) from None
        if is_native_route(content) or (launch.script and NATIVE_TRAINER.search(launch.script)):
            refuse_model_ids(content, f"{source} ({launch.config_yaml})", ("model",))
            if not is_native_route(content):
                raise MigrateError(
                    f"{path}: {launch.script} is MindSpeed MM's native trainer, but {launch.config_yaml} has no "
                    "`parallel` section"
                )
            world = _launch_world(launch)
            if world is not None and world_size is not None and world != world_size:
                raise MigrateError(
                    f"{path}: --world-size {world_size}, but the launch line starts {world} processes "
                    "(--nproc_per_node x --nnodes); give one"
                )
            native = migrate_native(yaml_path, content, base_dir=base, world_size=world or world_size)
            _map_native_launch(native, launch)
            result = native
        else:
            refuse_model_ids(content, f"{source} ({launch.config_yaml})", ("model",))
            result = migrate(
                launch,
                base_dir=base,
                import_root=import_root,
                keep_backend=keep_backend,
                single_yaml=(yaml_path, content),
                hf_path=hf_path,
            )
    else:
        try:
            result = migrate(launch, base_dir=base, import_root=import_root, keep_backend=keep_backend, hf_path=hf_path)
        except Refused as err:  # a refusal of a file the script names: the script is refused, naming both
            raise Refused(source, err.code, f"{err.source}: {err.detail}" if err.detail else err.source) from None
    result.notes.insert(0, note)
    _report_shell(result, launch)
    return result, read


def _map_native_launch(result: NativeMigration, launch: Launch) -> None:
    """The torchrun line of a native-route launch: process counts to the Trainer, every other option named."""
    state = _Flags(result.config, Migration(result.config), {}, Path.cwd(), False)
    _map_launcher(state, launch)
    result.mapped += state.out.mapped
    result.unmapped += state.out.unmapped
    result.notes += state.out.notes
    result.rendezvous.update(state.out.rendezvous)
    if "devices" in result.config.get("trainer", {}):  # the note asking for them is answered
        result.notes[:] = [n for n in result.notes if not n.startswith("trainer.devices / trainer.num_nodes")]
    for flag, value in launch.flags:
        shown = f"{flag} {value}" if value is not None else flag
        result.unmapped.append(
            f"{shown}: after the YAML on the launch line; MindSpeed MM's native trainer reads only the YAML"
        )


def _report_shell(result: Migration | NativeMigration, launch: Launch) -> None:
    """Name the shell the reader could not evaluate (``$(...)``, loops, ``source``...) and the flags written in
    variables that never reach the launch line."""
    for item in launch.unevaluated:
        result.notes.append(f"shell not evaluated: {item}")
    for item in launch.unused:
        result.notes.append(f"{item}: written, but not passed on the launch line; nothing to map")


def _write_output(output: Path, text: str, inputs: list[Path], force: bool) -> None:
    """Write ``text`` to ``output`` atomically; never over an input, nor over an existing file without ``force``."""
    target = output.resolve()
    for source in inputs:
        if source.exists() and (target == source.resolve() or (output.exists() and os.path.samefile(output, source))):
            raise MigrateError(f"-o {output} is the input {source}; migrate never overwrites its input")
    if output.is_dir():
        raise MigrateError(f"-o {output} is a directory; give a file name")
    if output.exists() and not force:
        raise MigrateError(f"-o {output} exists; pass --force to overwrite it")
    if not target.parent.is_dir():
        raise MigrateError(f"-o {output}: the directory {target.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str]) -> int:
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
        launch = parse_args(flags)
        base_dir = Path(args.base_dir) if args.base_dir else None
        result = migrate(
            launch,
            base_dir=base_dir,
            import_root=import_root,
            keep_backend=args.keep_backend,
            hf_path=Path(args.hf_path) if args.hf_path else None,
        )
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
    return 0


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
