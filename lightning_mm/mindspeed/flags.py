"""The flag table: each Megatron / MindSpeed MM flag of a launch, mapped onto the LightningCLI config or named
with the reason (:data:`FLAGS`), and the post-passes that combine flags (``--load``, ``--encoder-dp-balance``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mm.errors import ConfigError
from lightning_mm.mindspeed.files import load_yaml
from lightning_mm.mindspeed.keys import MindSpeedConfigError, expected_number, read_number
from lightning_mm.mindspeed.launch_script import read_text_file
from lightning_mm.mindspeed.report import MigrationReport

__all__ = [
    "FLAGS",
    "UnreadFlagValue",
    "FlagState",
    "MEGATRON_MODEL_FLAGS",
    "SEED_FUNCTIONS",
    "STRATEGY_ARGS",
    "TRANSFORMERS_MODULE",
]


# MMFSDP2Strategy's __init__ arguments, listed here so that migrating never imports Lightning
# (tests/test_migrate.py checks the list against the class).
class UnreadFlagValue(ConfigError):
    """A flag's value that is not a number (e.g. a shell variable the reader could not evaluate): the report names
    the flag NOT mapped, where a number out of its range is a :class:`MindSpeedConfigError`."""


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


def set_path(config: dict[str, Any], path: str, value: Any) -> None:
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
    "--adam-eps": (0, None, False),
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


def _number(value: str | None, flag: str) -> float:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UnreadFlagValue(f"{flag} needs a number, got {value!r}") from None
    low, high, integer = _RANGES.get(flag, (None, None, False))
    number = read_number(value, integer, low, high)
    if number is None:  # refused, not merely left out
        raise MindSpeedConfigError(f"{flag} needs {expected_number(integer, low, high)}, got {value!r}")
    return float(number)


def defined_functions(script: Path) -> dict[str, set[str]] | None:
    """The top-level functions of an entry script (read, never imported), each with the names its body uses;
    None if there is no such file. A binary, non-UTF-8 or too deeply nested file is an error naming it."""
    if not script.is_file():
        return None
    text = read_text_file(script, "an entry script")
    try:
        tree = ast.parse(text, filename=str(script))
    except SyntaxError as err:
        raise MindSpeedConfigError(f"{script}:{err.lineno}: not valid Python: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise MindSpeedConfigError(f"{script}: nested too deeply for Python's parser; not an entry script") from None
    except ValueError as err:
        raise MindSpeedConfigError(f"{script}: cannot be parsed as Python: {err}") from None
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
                raise MindSpeedConfigError(
                    f"{script}: nested too deeply for Python's parser; not an entry script"
                ) from None
            functions[node.name] = names
    return functions


def module_path(script: Path, import_root: Path) -> str:
    """The dotted import path of ``script`` seen from ``import_root`` (``examples.migration.pretrain_custom``)."""
    relative = script.resolve().with_suffix("").relative_to(import_root.resolve())
    return ".".join(relative.parts)


# ------------------------------------------------------------------------------------------ flag table
@dataclass
class FlagState:
    """What the flag handlers read and write while one launch is migrated."""

    cfg: dict[str, Any]
    out: MigrationReport
    values: dict[str, Any]
    base: Path
    keep_backend: bool

    def path_of(self, value: str | None) -> Path:
        return (self.base / (value or "")).resolve()

    def strategy(self, key: str, value: Any) -> None:
        self.cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
        self.cfg["trainer"]["strategy"]["init_args"][key] = value


# A handler maps one flag: handler(state, flag, value, shown), ``shown`` being the flag as written in the report.
_Handler = Callable[[FlagState, str, "str | None", str], None]


def _to(path: str, kind: type = float, keep: str | None = None, also: dict[str, Any] | None = None) -> _Handler:
    """``--flag N`` -> ``path`` as ``kind`` (kept in ``values[keep]`` too; ``also`` sets further keys)."""

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        number = kind(_number(value, flag))
        if keep:
            state.values[keep] = number
        set_path(state.cfg, path, number)
        for other, fixed in (also or {}).items():
            set_path(state.cfg, other, fixed)
        state.out.mapped.append(f"{shown} -> {path}")

    return handle


def _keep(name: str | None = None, kind: type | None = float) -> _Handler:
    """Remember the value (under ``name``, default the flag) for a mapping that needs other flags too."""

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        state.values[name or flag] = value if kind is None else kind(_number(value, flag))

    return handle


def _const(path: str, fixed: Any) -> _Handler:
    """A switch that sets ``path`` to ``fixed``."""

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        set_path(state.cfg, path, fixed)
        state.out.mapped.append(f"{shown} -> {path}: {fixed}")

    return handle


def _refuse(reason: str) -> _Handler:
    """Not mapped, with the reason."""

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        state.out.unmapped.append(f"{shown}: {reason}")

    return handle


def _choice(path: str, choices: tuple[str, ...], reason: str) -> _Handler:
    """``--flag VALUE`` -> ``path`` when the value is one of ``choices``; otherwise not mapped, with ``reason``."""

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        if value not in choices:
            state.out.unmapped.append(f"{shown}: {reason}")
            return
        set_path(state.cfg, path, value)
        state.out.mapped.append(f"{shown} -> {path}")

    return handle


def _strategy_arg(key: str, kind: type = str, choices: tuple[str, ...] = (), reason: str = "") -> _Handler:
    """``--flag VALUE`` -> ``MMFSDP2Strategy(key=VALUE)`` (as ``kind``; only one of ``choices`` when given)."""
    if key not in STRATEGY_ARGS:
        raise ValueError(f"MMFSDP2Strategy has no `{key}` argument")

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        if choices and value not in choices:
            state.out.unmapped.append(f"{shown}: {reason}")
            return
        state.strategy(key, kind(_number(value, flag)) if kind in (int, float) else value)
        state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.{key}")

    return handle


def _use_fsdp2(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    state.cfg["trainer"].setdefault("strategy", {"class_path": "lightning_mm.MMFSDP2Strategy", "init_args": {}})
    state.out.mapped.append(f"{shown} -> trainer.strategy: lightning_mm.MMFSDP2Strategy")


def _fsdp2_config(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    path = state.path_of(value)
    state.strategy("fsdp2_config", str(path))
    state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.fsdp2_config ({path})")
    if not path.is_file():
        state.out.unmapped.append(f"{shown}: {path} does not exist; write it before training")


def _encoder_dp_balance(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    state.values["encoder_dp_balance"] = shown  # into the FSDP2 config once --fsdp2-config-path is known


def map_encoder_dp_balance(state: FlagState) -> None:
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
        keys = load_yaml(path)
    except MindSpeedConfigError as err:
        state.out.unmapped.append(f"{shown}: {err}")
        return
    if keys.get("encoder_dp_balance") is True:
        state.out.mapped.append(f"{shown} -> encoder_dp_balance: true, already in {path}")
        return
    init_args["fsdp2_config"] = {**keys, "encoder_dp_balance": True}
    state.out.mapped.append(f"{shown} -> {target} (the keys of {path} written inline with it; the file is unchanged)")


def _backend(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    if state.keep_backend:
        state.strategy("process_group_backend", value)
        state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.process_group_backend (--keep-backend)")
    else:
        state.out.notes.append(
            f"{shown}: left out; the backend follows the accelerator (nccl on CUDA, hccl on "
            "Ascend, gloo on CPU). `migrate --keep-backend` keeps it"
        )


def _load(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    state.values["load"] = value  # pretrained weights or a resume: decided by map_load from what it names


def map_load(state: FlagState) -> None:
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


def _mm_data(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    state.values["mm_data"] = (shown, state.path_of(value))


def _mm_model(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    state.values["mm_model"] = (shown, state.path_of(value), None)


def _context_parallel_size(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    _CP_SIZE(state, flag, value, shown)
    state.values["cp"] = int(_number(value, flag))  # the global batch size counts data-parallel ranks only


_CP_SIZE = _strategy_arg("context_parallel_size", int)


def _context_parallel_algo(state: FlagState, flag: str, value: str | None, shown: str) -> None:
    from lightning_mm.core.context_parallel import ContextParallelError, canonical_algorithm

    try:
        algo = canonical_algorithm(value)
    except ContextParallelError as err:
        state.out.unmapped.append(f"{shown}: {err}")
        return
    state.strategy("context_parallel_algo", algo)
    state.out.mapped.append(f"{shown} -> trainer.strategy.init_args.context_parallel_algo: {algo}")


def _only_one(reason: str) -> _Handler:
    """A parallelism size that only its value 1 (none) maps to: nothing to set."""

    def handle(state: FlagState, flag: str, value: str | None, shown: str) -> None:
        if value != "1":
            state.out.unmapped.append(f"{shown}: {reason}")
        else:
            state.out.notes.append(f"{shown}: none, as here; nothing to set")

    return handle


def _optimizer(state: FlagState, flag: str, value: str | None, shown: str) -> None:
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
    "--adam-eps": _to("model.init_args.eps"),
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
    "--tensor-model-parallel-size": _only_one(
        "Megatron's tensor parallelism of MindSpeed MM's own Megatron layers (its converted checkpoints split per "
        "TP rank) has no counterpart in the migrated job, which trains the Transformers class; tensor parallelism "
        "here splits that class (the FSDP2 YAML's tensor_parallel_size with tp_plan or the model's "
        "base_model_tp_plan, docs/parallelism.md): set it there by hand"
    ),
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
