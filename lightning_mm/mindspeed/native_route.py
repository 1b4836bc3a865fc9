"""``lightning-mm migrate CONFIG.yaml`` for MindSpeed MM's native FSDP2 route (its six-section YAML).

MindSpeed MM's recommended FSDP2 trainer (``mindspeed_mm/fsdp/train/trainer.py``) reads one YAML with the sections
``parallel``, ``model``, ``data``, ``features``, ``training`` and ``tools`` (``mindspeed_mm/fsdp/params/*.py``).
This module writes the LightningCLI config that trains it here:

* ``parallel`` (and ``features.recompute*``) -> ``MMFSDP2Strategy(fsdp2_config={...})`` through
  :func:`lightning_mm.mindspeed.native_parallel.map_parallel`; ``ulysses_parallel_size`` -> ``context_parallel_size``
* ``model`` -> ``MMTransformersModule(transformers_model={...})``; ``features`` chunked loss -> its
  ``enable_chunk_loss`` / ``chunk_loss_size``; ``training.lora`` -> its ``lora``
* ``data`` -> ``MMDataModule(data_config=<this file>)`` (which reads the ``data:`` section, ``neat_packing`` included),
  batch size and seed from ``training``
* ``training`` -> the optimizer and schedule of ``MMLightningModule``, the Trainer's steps, accumulation, clipping
  and logging, a ``ModelCheckpoint`` (``save``, ``save_interval``), the checkpoint format and async save
* ``tools`` -> the profilers, reported (Lightning's ``profiler`` is the counterpart)

Every key is mapped, or listed with the reason; nothing is dropped silently. Read, never imported: no Lightning,
no Transformers, no torch at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mm.mindspeed.keys import KeyReader
from lightning_mm.mindspeed.report import MigrationReport

__all__ = [
    "is_native_route",
    "migrate_native",
    "NATIVE_MODEL_IDS",
    "DERIVED_MODEL_IDS",
    "PENDING_OPTIONS",
]

STRATEGY = "lightning_mm.MMFSDP2Strategy"
MODULE = "lightning_mm.modules.transformers_module.MMTransformersModule"
DATA = "lightning_mm.MMDataModule"

NATIVE_MODEL_IDS: dict[str, str] = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen2": "qwen2",
    "llama": "llama",
    "internvl": "internvl",
    "llava": "llava",
    "qwen2_5_vl": "qwen2_5_vl",
}
"""Native ``model.model_id`` -> the ModelHub key of this project's adapter for that architecture."""
DERIVED_MODEL_IDS: dict[str, str] = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
"""Native ``model.model_id`` -> the Transformers class of its checkpoints (Qwen3.5 and Qwen3.6, whose configs use
the Qwen3.5 ids) that trains here with no ModelHub adapter: TransformersModel takes the class from config.json's
``architectures`` and derives its default plan (:mod:`lightning_mm.hf.derived_adapters`)."""
_UNSUPPORTED_MODELS = {
    "qwen3_6": "Qwen3.6",
    "kimi_k25": "Kimi-K2.5 (remote code)",
    "kimi_k3": "Kimi-K3 (remote code)",
    "step3_vl": "Step3-VL (remote code)",
    "qwen3_omni_moe": "Qwen3-Omni (its module paths, `visual`, `model.layers`, are MindSpeed MM's own thinker "
    "layout, not those of Transformers' Qwen3OmniMoe classes, and its template qwen3_omni is not built in here)",
    "qwen3_asr": "Qwen3-ASR (audio)",
    "qwen3tts": "Qwen3-TTS (audio)",
    "qwen3_tts": "Qwen3-TTS (audio)",
    "funasr": "FunASR (audio, MindSpeed MM's own model)",
    "cosyvoice3_lm": "CosyVoice3 (audio, MindSpeed MM's own model)",
    "ltx2": "LTX-2 (video diffusion, MindSpeed MM's own model)",
    "mimo_v2_5": "MiMo-V2.5",
    "moss_tts_delay": "MOSS-TTS (audio)",
}

PENDING_OPTIONS: dict[str, str] = {}
"""Written options this version of lightning-mm does not have yet (config target -> feature), named in the report
when a config is written with one: none in this version."""


def is_native_route(data: Any) -> bool:
    """A native-route config: a ``parallel:`` mapping and only the six sections (plus model-specific extras)."""
    return isinstance(data, Mapping) and isinstance(data.get("parallel"), Mapping) and "gpt_args" not in data


class _Out:
    def __init__(self, path: Path, data: Mapping[str, Any], base: Path) -> None:
        self.path, self.data, self.base = path, data, base
        self.config: dict[str, Any] = {
            "trainer": {"strategy": {"class_path": STRATEGY, "init_args": {}}},
            "model": {"class_path": MODULE, "init_args": {"transformers_model": {}}},
            "data": {"class_path": DATA, "init_args": {"data_config": str(path.resolve())}},
        }
        self.mapped: list[str] = []
        self.notes: list[str] = []
        self.unmapped: list[str] = []
        self.handled: set[str] = set()
        self.pending: set[str] = set()

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def has(self, dotted: str) -> bool:
        marker = object()
        return self.get(dotted, marker) is not marker

    def set(self, target: str, value: Any) -> None:
        node = self.config
        parts = target.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        if target in PENDING_OPTIONS:
            self.pending.add(target)

    def map(self, key: str, target: str, value: Any, shown: str = "") -> None:
        self.set(target, value)
        self.handled.add(key)
        self.mapped.append(f"{key} -> {target}" + (f" ({shown})" if shown else ""))

    def note(self, key: str, why: str) -> None:
        self.handled.add(key)
        self.notes.append(f"{key}: {why}")

    def refuse(self, key: str, why: str) -> None:
        self.handled.add(key)
        self.unmapped.append(f"{key}: {why}")

    def resolve(self, value: str) -> str:
        return str((self.base / value).resolve())

    def number(
        self,
        key: str,
        kind: type = float,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        high_open: bool = False,
        default: Any = None,
    ) -> Any:
        """The number at dotted ``key`` (``default`` when absent), checked against its range; an error naming the
        key and file otherwise (MindSpeed MM's dataclasses parse numbers written as strings, such as ``1e-5``)."""
        number = KeyReader(str(self.path)).number(
            self.get(key, default), key, kind is int, low, high, low_open, high_open
        )
        return None if number is None else kind(number)


def _leaves(node: Mapping[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += _leaves(value, f"{name}.")
        else:
            out.append(name)
    return out


def migrate_native(
    path: Path, data: Mapping[str, Any], base_dir: Path | None = None, world_size: int | None = None
) -> MigrationReport:
    """The :class:`MigrationReport` of a native-route config read from ``path``.

    Relative paths (``model_name_or_path``, ``save``, ``load``) are taken from ``base_dir`` (the launch directory,
    by default the working directory), as MindSpeed MM takes them from where it runs. ``world_size`` (the launch
    script's NPUs x nodes, when known) fixes the job's global batch size: MindSpeed MM's micro batch x
    data-parallel ranks x accumulation there, kept on any other world size (``GlobalBatchSize``).
    """
    out = _Out(Path(path), data, Path.cwd() if base_dir is None else Path(base_dir))
    _parallel(out)
    _model(out)
    _features(out)
    _training(out)
    _refuse_impossible_checkpoints(out)
    if world_size is not None:
        _global_batch(out, world_size)
    _data(out)
    _tools(out)
    for section in data:
        if section in ("parallel", "model", "data", "features", "training", "tools"):
            continue
        out.refuse(
            str(section),
            "not a section of MindSpeed MM's native arguments; read only by a model plugin of "
            "MindSpeed MM (as an extra field), if at all; nothing here reads it",
        )
    for name in _leaves({k: v for k, v in data.items() if k in ("model", "features", "training", "tools")}, ""):
        if not any(name == h or name.startswith(f"{h}.") for h in out.handled):
            out.unmapped.append(
                f"{name}: unknown to lightning-mm migrate (not a field of MindSpeed MM's native "
                "arguments; a model plugin's extra)"
            )
    from lightning_mm.mindspeed.newer_keys import name_newer_keys

    name_newer_keys(data, out.mapped, out.notes, out.unmapped)  # keys of newer MindSpeed MM versions, by name
    if out.pending:
        out.notes.append(
            "written with options being added to lightning-mm (not in this version yet): "
            + ", ".join(sorted(out.pending))
        )
    out.notes.append(
        "trainer.devices / trainer.num_nodes: the launch script's NPUS_PER_NODE and NNODES (torchrun); "
        "set them, or give them on the command line"
    )
    return MigrationReport(
        out.config, mapped=out.mapped, unmapped=out.unmapped, notes=out.notes, run_from=out.base, route="native"
    )


# --------------------------------------------------------------------------------------------- parallel
def _parallel(out: _Out) -> None:
    from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
    from lightning_mm.mindspeed.keys import MindSpeedConfigError
    from lightning_mm.mindspeed.native_parallel import map_parallel

    try:
        result = map_parallel(
            out.data["parallel"], out.data.get("features"), str(out.path), strict=False, error=MindSpeedConfigError
        )
        _drop_absent_mtp(out, result.fsdp2)
        config = FSDP2Config.from_dict(result.fsdp2, source=f"{out.path} (parallel)").to_dict()
    except FSDP2ConfigError as err:
        raise MindSpeedConfigError(str(err)) from None
    out.handled.update({"parallel", "features.recompute", "features.recompute_plan"})
    out.set("trainer.strategy.init_args.fsdp2_config", config)
    out.mapped += [f"{m}" for m in result.mapped]
    out.unmapped += result.refused + result.without_effect


def _drop_absent_mtp(out: _Out, fsdp2: dict[str, Any]) -> None:
    """``mtp`` in ``fsdp_plan.apply_modules`` names MindSpeed MM's own multi-token-prediction block, which its model
    builds only with ``model.mtp_num_layers`` > 0 (a pattern matching no module is skipped there). Transformers'
    models have no such module (and a pattern matching none is an error here), so without MTP it is left out, said
    in the report."""
    wrap = fsdp2.get("sub_modules_to_wrap")
    if not isinstance(wrap, list) or "mtp" not in wrap or out.get("model.mtp_num_layers", 0):
        return
    fsdp2["sub_modules_to_wrap"] = [m for m in wrap if m != "mtp"]
    out.notes.append(
        "parallel.fsdp_plan.apply_modules mtp: MindSpeed MM's multi-token-prediction block, built only "
        "with model.mtp_num_layers > 0 (Transformers' model has no mtp module); not wrapped here"
    )


# --------------------------------------------------------------------------------------------- model
def _model(out: _Out) -> None:
    model = out.data.get("model") or {}
    if not isinstance(model, Mapping):
        out.refuse("model", f"expected a mapping, got {type(model).__name__}")
        return
    target = "model.init_args.transformers_model"
    out.handled.add("model.model_id")
    model_id = model.get("model_id")
    if model_id in NATIVE_MODEL_IDS:
        out.map(
            "model.model_id",
            f"{target}.model_id",
            NATIVE_MODEL_IDS[model_id],
            f"ModelHub key {NATIVE_MODEL_IDS[model_id]}",
        )
    elif model_id in DERIVED_MODEL_IDS:
        out.mapped.append(
            f"model.model_id {model_id} -> none: no ModelHub adapter needed; TransformersModel takes "
            "the class from config.json's architectures (Transformers' "
            f"{DERIVED_MODEL_IDS[model_id]}) and derives its default FSDP2 plan from the model"
        )
    elif model_id is not None:
        what = _UNSUPPORTED_MODELS.get(model_id, f"model_id {model_id}")
        out.refuse(
            "model.model_id",
            f"{model_id}: {what}: this config does not train here yet (no ModelHub "
            "adapter, and no Transformers class with a derived plan checked for it); "
            "model_id is left out: TransformersModel takes the class from config.json's "
            "architectures (a Transformers class gets a derived default plan; a "
            "remote-code model also needs trust_remote_code)",
        )
    if "model_name_or_path" in model:
        value = model["model_name_or_path"]
        out.map("model.model_name_or_path", f"{target}.init_from_hf_path", out.resolve(str(value)))
    if "trust_remote_code" in model:
        out.map("model.trust_remote_code", f"{target}.trust_remote_code", bool(model["trust_remote_code"]))
    if "freeze" in model:
        freeze = model["freeze"] or []
        if freeze:
            out.map("model.freeze", f"{target}.freeze", list(freeze), "the same module paths and patterns")
        else:
            out.note("model.freeze", "empty: nothing frozen")
    if "attn_implementation" in model:
        kind = model["attn_implementation"]
        if kind in ("eager", "sdpa"):
            out.map("model.attn_implementation", f"{target}.hf_config.attn_implementation", kind)
        else:
            out.note(
                "model.attn_implementation",
                f"{kind}: a fused attention kernel (same result); Transformers' "
                "default attention is used (set hf_config.attn_implementation: "
                f"{kind} where that kernel is installed)",
            )
    if "model_id" in model and "model_name_or_path" not in model:
        out.unmapped.append(
            "model.model_name_or_path: missing; set model.init_args.transformers_model.init_from_hf_path"
        )
    mtp = model.get("mtp_num_layers", 0)
    if "mtp_num_layers" in model:
        if mtp:
            out.refuse(
                "model.mtp_num_layers",
                f"{mtp}: multi-token prediction layers are MindSpeed MM's own; not supported here",
            )
        else:
            out.note("model.mtp_num_layers", "0: no multi-token prediction, as here")
    if "mtp_loss_scaling_factor" in model:
        out.note("model.mtp_loss_scaling_factor", "used only with mtp_num_layers > 0")
    for key, why in _MODEL_EXTRAS.items():
        if key in model:
            out.refuse(f"model.{key}", why)


_MODEL_EXTRAS = {
    "gdn_implementation": "MindSpeed MM's gated-delta-net kernel choice (NPU ascendc / triton); Transformers' code "
    "runs here",
    "causal_conv1d_implementation": "MindSpeed MM's causal-conv1d kernel choice; Transformers' code runs here",
    "kda_implementation": "MindSpeed MM's KDA kernel choice; the model's own code runs here",
    "skip_gdn_recompute": "MindSpeed MM recomputes a layer except its gated-delta-net part; here a recomputed "
    "module is recomputed whole (same result, more compute)",
    "skip_flash_attn_recompute": "MindSpeed MM recomputes a layer except its attention; here a recomputed module "
    "is recomputed whole (same result, more compute)",
    "skip_kda_recompute": "MindSpeed MM recomputes a layer except its KDA part; here a recomputed module is "
    "recomputed whole (same result, more compute)",
    "use_grouped_expert_matmul": "MindSpeed MM's grouped expert matmul kernel; the experts here run the model's code",
    "loss_cfg": "read from features.loss_cfg by MindSpeed MM's trainer; this copy in model is read by no one but "
    "the model plugin",
    "chunkloss_plan": "read from features.chunkloss_plan by MindSpeed MM's trainer; not read here",
    "enable_chunk_loss": "read from features.enable_chunk_loss by MindSpeed MM's trainer; not read here",
    "recompute": "read from parallel/features by MindSpeed MM; not read here",
    "recompute_plan": "read from parallel/features by MindSpeed MM; not read here",
    "activation_offload_plan": "read from features by MindSpeed MM; not read here",
}


# --------------------------------------------------------------------------------------------- features
def _features(out: _Out) -> None:
    features = out.data.get("features") or {}
    if not isinstance(features, Mapping):
        out.refuse("features", f"expected a mapping, got {type(features).__name__}")
        return
    target = "model.init_args.transformers_model"
    loss = features.get("loss_cfg") or {}
    out.handled.add("features.loss_cfg")
    kind = loss.get("loss_type", "raw") if isinstance(loss, Mapping) else None
    if kind in ("default", "raw"):
        out.mapped.append(
            f"features.loss_cfg.loss_type {kind} -> the default loss: the token mean of each "
            "micro-batch, averaged over data-parallel ranks and accumulation steps (MindSpeed MM's "
            f"{kind} loss)"
        )
    else:
        out.unmapped.append(
            f"features.loss_cfg.loss_type {kind}: not implemented here (only default / raw, the "
            "token mean of each micro-batch)"
        )
    coef = loss.get("router_aux_loss_coef", 0.0) if isinstance(loss, Mapping) else 0.0
    if coef:
        out.unmapped.append(
            f"features.loss_cfg.router_aux_loss_coef {coef}: the MoE router's auxiliary loss is not added here"
        )
    if isinstance(loss, Mapping) and loss.get("router_aux_loss_offload"):
        out.unmapped.append("features.loss_cfg.router_aux_loss_offload: no router auxiliary loss here")
    if isinstance(loss, Mapping):
        for key in set(loss) - {"loss_type", "router_aux_loss_coef", "router_aux_loss_offload"}:
            out.unmapped.append(f"features.loss_cfg.{key}: not a field of MindSpeed MM's LossArguments")
    out.handled.update({"features.enable_chunk_loss", "features.chunkloss_plan", "features.enable_dynamic_chunk_loss"})
    plan = features.get("chunkloss_plan") or {}
    if features.get("enable_chunk_loss"):
        out.set(f"{target}.enable_chunk_loss", True)
        out.mapped.append(f"features.enable_chunk_loss -> {target}.enable_chunk_loss")
        if "chunk_size" in plan:
            out.set(f"{target}.chunk_loss_size", out.number("features.chunkloss_plan.chunk_size", int, low=1))
            out.mapped.append(f"features.chunkloss_plan.chunk_size -> {target}.chunk_loss_size")
        module = plan.get("apply_module", "lm_head")
        out.notes.append(
            f"features.chunkloss_plan.apply_module {module}: the model's output layer, found by "
            "TransformersModel itself"
        )
        if "total_chunk_size" in plan:
            out.notes.append("features.chunkloss_plan.total_chunk_size: used only by enable_dynamic_chunk_loss")
    elif plan or "enable_chunk_loss" in features:
        out.notes.append("features.enable_chunk_loss: off" + ("; features.chunkloss_plan is not used" if plan else ""))
    if features.get("enable_dynamic_chunk_loss"):
        out.unmapped.append(
            "features.enable_dynamic_chunk_loss: the chunk size derived from total_chunk_size and "
            "the batch is not supported here; set chunk_loss_size"
        )
    _switch(
        out,
        features,
        "enable_activation_offload",
        "activation_offload_plan",
        "activation offload (saved activations moved to host memory) is not supported here; recompute_modules "
        "(parallel.recompute_plan) trade compute for the same memory",
    )
    _switch(
        out,
        features,
        "enable_chunk_mbs",
        "chunkmbs_plan",
        "chunked micro-batches (a micro-batch split inside the listed modules) are not supported here; lower "
        "training.micro_batch_size and raise gradient_accumulation_steps for the same memory",
    )
    _switch(
        out,
        features,
        "enable_ep_balance",
        "ep_balance_plan",
        "MindSpeed MM's duplication of hot experts (speed only) is not supported here",
    )
    if "skip_moe_pad_tokens" in features:
        if features["skip_moe_pad_tokens"]:
            out.refuse(
                "features.skip_moe_pad_tokens",
                "padding tokens are routed through the experts here (their loss is masked)",
            )
        else:
            out.note("features.skip_moe_pad_tokens", "off, as here")


def _switch(out: _Out, features: Mapping[str, Any], switch: str, plan: str, why: str) -> None:
    out.handled.update({f"features.{switch}", f"features.{plan}"})
    if features.get(switch):
        out.unmapped.append(f"features.{switch}" + (f", features.{plan}" if plan in features else "") + f": {why}")
    elif switch in features or plan in features:
        out.notes.append(f"features.{switch}: off" + (f"; features.{plan} is not used" if plan in features else ""))


# --------------------------------------------------------------------------------------------- training
_DECAY = {"constant": "constant", "cosine": "cosine", "linear": "linear"}
_NO_EFFECT_TRAINING = {
    "adam_fused": "the fused AdamW step is MMFSDP2Strategy's fused_optimizer_step (on by default)",
    "clip_grad_foreach": "torch's foreach clipping implementation (same result)",
    "init_model_with_meta_device": "MMFSDP2Strategy always builds the model on the meta device (empty_init) and "
    "each rank loads its own shards",
    "use_deter_comp": "NPU deterministic computation; use Trainer(deterministic=True) for torch's",
    "allow_hf32": "an NPU matmul precision switch; torch.backends.*.allow_tf32 is the counterpart",
    "enable_full_determinism": "use Trainer(deterministic=True)",
    "plugin": "MindSpeed MM's plugin modules (its model and dataset classes); this project's own are used",
    "manual_gc_interval": "Python's garbage collection is left alone here",
    "load_rank0_and_broadcast": "each rank reads its own shards here",
    "ckpt_manager": "checkpoints are written by MMFSDP2Strategy (torch.distributed.checkpoint)",
    "log_interval": None,
}


def _training(out: _Out) -> None:
    training = out.data.get("training") or {}
    if not isinstance(training, Mapping):
        out.refuse("training", f"expected a mapping, got {type(training).__name__}")
        return

    def has(key: str) -> bool:
        return key in training

    _optimizer(out, training)
    _schedule(out, training)
    _step(out, training)
    for key, why in _NO_EFFECT_TRAINING.items():
        if has(key) and why:
            out.note(f"training.{key}", why)
    _validation(out, training)
    _checkpointing(out, training)
    _lora(out, training.get("lora"))
    if has("profile"):
        _profile(out, "training.profile", training["profile"])
    quant = training.get("quantization_plan")
    if has("quantization_plan"):
        if isinstance(quant, Mapping) and quant.get("recipe_name"):
            out.refuse(
                "training.quantization_plan", f"low-precision training ({quant['recipe_name']}) is not supported here"
            )
        else:
            out.note("training.quantization_plan", "no recipe: off")


def _optimizer(out: _Out, training: Mapping[str, Any]) -> None:
    """``training``'s optimizer keys: learning rate, weight decay, AdamW's betas and eps."""
    module = "model.init_args"

    def has(key: str) -> bool:
        return key in training

    for key in ("lr", "weight_decay"):
        if has(key):
            out.map(f"training.{key}", f"{module}.{key}", out.number(f"training.{key}", low=0))
    if has("lr_min"):
        out.map("training.lr_min", f"{module}.min_lr", out.number("training.lr_min", low=0))
    if has("lr_start"):
        start = out.number("training.lr_start", low=0)
        if start:
            out.refuse("training.lr_start", f"{start}: warmup here starts from 0")
        else:
            out.note("training.lr_start", "0: warmup starts from 0, as here")
    if has("adam_beta1") or has("adam_beta2"):
        betas = [
            out.number(f"training.adam_beta{i}", low=0, high=1, high_open=True, default=d)
            for i, d in ((1, 0.9), (2, 0.999))
        ]
        out.map("training.adam_beta1, training.adam_beta2", f"{module}.betas", betas)
        out.handled.update({"training.adam_beta1", "training.adam_beta2"})
    if has("adam_eps"):
        out.map("training.adam_eps", f"{module}.eps", out.number("training.adam_eps", low=0, low_open=True))
    optimizer = training.get("optimizer", "adamw")
    if optimizer == "adamw":
        out.note("training.optimizer", "adamw: MMLightningModule's AdamW")
    elif has("optimizer"):
        out.refuse("training.optimizer", f"{optimizer}: only AdamW is built in; override configure_optimizers")
    for key in ("mem_fraction_static", "matched_adamw_rms", "muon_momentum", "ns_steps"):
        if has(key):
            (out.note if optimizer == "adamw" else out.refuse)(
                f"training.{key}", "a setting of the adamw_swap / muon optimizer"
            )
    for key in ("no_decay_modules", "no_decay_params"):
        if has(key):
            if training[key]:
                out.refuse(f"training.{key}", "weight decay applies to every trainable parameter here")
            else:
                out.note(f"training.{key}", "empty, as here")
    if has("lr_scaling_plan"):
        (out.refuse if training["lr_scaling_plan"] else out.note)(
            "training.lr_scaling_plan", "per-layer learning rates are not supported here"
        )


def _schedule(out: _Out, training: Mapping[str, Any]) -> None:
    """``training``'s run length and learning-rate schedule."""
    module = "model.init_args"

    def has(key: str) -> bool:
        return key in training

    if has("train_iters"):
        out.map("training.train_iters", "trainer.max_steps", out.number("training.train_iters", int, low=1))
    if has("max_steps") and training["max_steps"] is not None:
        steps_per_epoch = out.number("training.max_steps", int, low=1)
        out.map("training.max_steps", "trainer.limit_train_batches", steps_per_epoch, "steps per epoch")
    elif has("max_steps"):
        out.note("training.max_steps", "null: no limit per epoch")
    for key in ("train_epochs", "max_epochs"):
        if has(key) and training[key] is not None:
            out.map(f"training.{key}", "trainer.max_epochs", out.number(f"training.{key}", int, low=1))
        elif has(key):
            out.note(f"training.{key}", "null")
    decay = training.get("lr_decay_style", "constant")
    if decay in _DECAY:
        out.map("training.lr_decay_style", f"{module}.lr_decay_style", _DECAY[decay])
    else:
        out.refuse("training.lr_decay_style", f"{decay}: only constant, cosine and linear are built in")
    ratio = out.number("training.lr_warmup_ratio", low=0, high=1, default=0.0)
    if has("lr_warmup_ratio"):
        if "train_iters" in training:
            out.map(
                "training.lr_warmup_ratio",
                f"{module}.warmup_steps",
                round(ratio * out.number("training.train_iters", int, low=1)),
                "ratio x train_iters",
            )
        else:
            out.refuse("training.lr_warmup_ratio", "needs training.train_iters to become a step count")
    if has("lr_decay_ratio"):
        if out.number("training.lr_decay_ratio", low=0, high=1, low_open=True) == 1.0:
            out.note("training.lr_decay_ratio", "1.0: the decay runs to the last step, as here")
        else:
            out.refuse("training.lr_decay_ratio", "the decay here always runs to the last step")
    for key in ("scheduler", "scheduler_conf"):
        if has(key):
            out.refuse(
                f"training.{key}",
                "a model plugin's own scheduler setting; lr_decay_style / lr_warmup_ratio are read here",
            )


def _step(out: _Out, training: Mapping[str, Any]) -> None:
    """``training``'s clipping, batch sizes, accumulation, seed and logging."""

    def has(key: str) -> bool:
        return key in training

    if has("clip_grad"):
        clip = out.number("training.clip_grad", low=0)
        if clip > 0:
            out.map("training.clip_grad", "trainer.gradient_clip_val", clip)
        else:
            out.note("training.clip_grad", "0: no clipping (trainer.gradient_clip_val unset)")
    if has("clip_norm_type"):
        norm = out.number("training.clip_norm_type", low=0, low_open=True)
        if norm == 2.0:
            out.note("training.clip_norm_type", "2.0: the L2 norm, as here")
        else:
            out.refuse("training.clip_norm_type", f"{norm}: gradients are clipped by their L2 norm here")
    if has("micro_batch_size"):
        out.map(
            "training.micro_batch_size",
            "data.init_args.batch_size",
            out.number("training.micro_batch_size", int, low=1),
        )
    if has("val_micro_batch_size"):
        out.refuse("training.val_micro_batch_size", "validation uses data.init_args.batch_size here")
    steps = out.number("training.gradient_accumulation_steps", int, low=1)
    if steps is not None:
        out.map("training.gradient_accumulation_steps", "trainer.accumulate_grad_batches", steps)
    elif has("gradient_accumulation_steps"):
        out.note("training.gradient_accumulation_steps", "null: no accumulation, as here")
    if has("global_batch_size"):
        out.refuse(
            "training.global_batch_size",
            "derived by MindSpeed MM (micro_batch_size x data-parallel ranks "
            "x gradient_accumulation_steps), not read from here",
        )
    if has("seed"):
        seed = out.number("training.seed", int, low=0, high=2**32 - 1)  # Lightning's seed range
        out.map("training.seed", "seed_everything", seed)
        out.set("data.init_args.seed", seed)
    if has("log_interval"):
        out.map("training.log_interval", "trainer.log_every_n_steps", out.number("training.log_interval", int, low=1))


def _validation(out: _Out, training: Mapping[str, Any]) -> None:
    for key in ("val_interval", "validate_interval"):
        if key not in training:
            continue
        every = out.number(f"training.{key}", int, low=0) or 0
        if every > 0:
            out.map(f"training.{key}", "trainer.val_check_interval", every)
            out.set("trainer.check_val_every_n_epoch", None)
        else:
            out.map(f"training.{key}", "trainer.limit_val_batches", 0, "0: no validation")


def _checkpointing(out: _Out, training: Mapping[str, Any]) -> None:
    strategy = "trainer.strategy.init_args"
    save = training.get("save")
    every = out.number("training.save_interval" if "save_interval" in training else "training.save_steps", int, low=0)
    out.handled.update({"training.save", "training.save_interval", "training.save_steps"})
    if save or "save_interval" in training or "save_steps" in training:
        remote = bool(save) and "://" in str(save)
        # a link cannot point into an object store: a URL keeps a copied last checkpoint instead
        checkpoint: dict[str, Any] = {"save_last": True if remote else "link"}
        if save:
            checkpoint["dirpath"] = str(save) if remote else out.resolve(str(save))  # a URL stays one
        if every:
            checkpoint["every_n_train_steps"] = every
        out.set(
            "trainer.callbacks",
            [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": checkpoint}],
        )
        out.mapped.append(
            "training.save, training.save_interval -> trainer.callbacks: ModelCheckpoint(dirpath, "
            f"every_n_train_steps, save_last: {'true (a URL cannot hold a link)' if remote else 'link'})"
        )
    fmt = training.get("save_format", "auto")
    if "save_format" in training:
        if fmt in ("dcp", "auto"):
            out.map("training.save_format", f"{strategy}.checkpoint_format", "torch_dcp")
        else:  # hf: weights only, as MindSpeed MM's hf format (no resume state)
            out.map(
                "training.save_format",
                f"{strategy}.checkpoint_format",
                "hf",
                "Hugging Face safetensors weights, weights-only as in MindSpeed MM",
            )
    if training.get("save_ckpt_dtype") is not None:
        out.map("training.save_ckpt_dtype", f"{strategy}.save_ckpt_dtype", training["save_ckpt_dtype"])
    elif "save_ckpt_dtype" in training:
        out.note("training.save_ckpt_dtype", "null: weights are saved in their training dtype, as here")
    if "save_async" in training:
        if training["save_async"]:
            out.map("training.save_async", f"{strategy}.async_save", True)
        else:
            out.note("training.save_async", "off, as here")
    load, load_format = training.get("load"), training.get("load_format", "auto")
    out.handled.update({"training.load", "training.load_format", "training.load_checkpoint_path", "training.resume"})
    if load:
        hf_dir = out.get("model.model_name_or_path")
        same_as_model = bool(hf_dir) and out.resolve(str(load)) == out.resolve(str(hf_dir))
        if load_format == "hf" or (load_format == "auto" and same_as_model):
            out.mapped.append(
                f"training.load {load}, training.load_format {load_format} -> the weights of model."
                "init_args.transformers_model.init_from_hf_path (a Hugging Face directory)"
            )
            if not hf_dir or out.resolve(str(load)) != out.resolve(str(hf_dir)):
                out.set("model.init_args.transformers_model.init_from_hf_path", out.resolve(str(load)))
        elif load_format == "dcp":
            out.unmapped.append(
                f"training.load {load}, training.load_format dcp: a checkpoint in MindSpeed MM's own "
                "DCP layout, which Lightning cannot resume; start from the Hugging Face weights "
                "(transformers_model.init_from_hf_path), or resume a checkpoint written here with "
                "ckpt_path"
            )
        else:
            out.unmapped.append(
                f"training.load {load}, training.load_format auto: a DCP checkpoint resumes with "
                "ckpt_path (a Lightning checkpoint directory); a Hugging Face directory is "
                "transformers_model.init_from_hf_path. Set the one it is"
            )
    elif "load" in training:
        out.notes.append("training.load: null, nothing loaded")
    if "load_format" in training and not load:
        out.notes.append(f"training.load_format {load_format}: nothing to load")
    if training.get("load_checkpoint_path"):
        out.map("training.load_checkpoint_path", "ckpt_path", out.resolve(str(training["load_checkpoint_path"])))
    if training.get("resume"):
        out.unmapped.append("training.resume: set ckpt_path to the checkpoint to resume from")
    elif "resume" in training:
        out.notes.append("training.resume: off")
    if "load_strict" in training:
        out.map("training.load_strict", f"{strategy}.strict_loading", bool(training["load_strict"]))
    for key, why in (
        (
            "no_load_optim",
            "a resume here restores the optimizer state with the weights; to start from "
            "weights alone use init_from_hf_path",
        ),
        ("no_load_rng", "a resume here restores the RNG state with the weights"),
        ("no_save_optim", "checkpoints here always hold the optimizer state"),
        ("no_save_rng", "checkpoints here always hold each rank's RNG state"),
    ):
        if training.get(key):
            out.refuse(f"training.{key}", why)
        elif key in training:
            out.note(f"training.{key}", "off, as here")


def _global_batch(out: _Out, world_size: int) -> None:
    """MindSpeed MM's global batch at the launch's world size (``micro_batch_size x world / ulysses x
    gradient_accumulation_steps``) -> the GlobalBatchSize callback, which keeps it on another world size."""
    micro = out.number("training.micro_batch_size", int, low=1, default=1)
    accumulate = out.number("training.gradient_accumulation_steps", int, low=1, default=1)
    fsdp2 = out.config["trainer"]["strategy"]["init_args"].get("fsdp2_config")
    ulysses = fsdp2.get("context_parallel_size", 1) if isinstance(fsdp2, dict) else 1  # Ulysses or ring
    if world_size < 1 or world_size % ulysses:
        return
    total = micro * (world_size // ulysses) * accumulate
    callbacks = out.config["trainer"].setdefault("callbacks", [])
    callbacks.append(
        {"class_path": "lightning_mm.commands.global_batch.GlobalBatchSize", "init_args": {"global_batch_size": total}}
    )
    out.mapped.append(
        f"training.micro_batch_size {micro} x {world_size // ulysses} data-parallel ranks x "
        f"gradient_accumulation_steps {accumulate} (the launch's {world_size} ranks) -> trainer.callbacks: "
        f"GlobalBatchSize({total}) (the accumulation is derived from it at fit for the world size the run has)"
    )


def _refuse_impossible_checkpoints(out: _Out) -> None:
    """Combinations that would fail only at the first save are refused before any compute: the Hugging Face
    format with LoRA (it holds the model's weights, a LoRA run checkpoints its adapters) and at a URL (it is
    written with local file I/O)."""
    from lightning_mm.mindspeed.keys import MindSpeedConfigError

    strategy = out.config["trainer"]["strategy"]["init_args"]
    if strategy.get("checkpoint_format") != "hf":
        return
    if out.config["model"]["init_args"]["transformers_model"].get("lora") is not None:
        raise MindSpeedConfigError(
            f"{out.path}: `training.save_format: hf` with `training.lora`: the Hugging Face format holds the "
            "model's weights only, and a LoRA run checkpoints its adapters; use save_format dcp"
        )
    save = out.get("training.save")
    if isinstance(save, str) and "://" in save:
        raise MindSpeedConfigError(
            f"{out.path}: `training.save_format: hf` with `training.save: {save}`: the Hugging Face format is "
            "written to a local directory, not to a URL; use save_format dcp for a remote checkpoint directory"
        )


def _lora(out: _Out, lora: Any) -> None:
    out.handled.add("training.lora")
    if not isinstance(lora, Mapping):
        return
    if not lora.get("enable"):
        out.notes.append("training.lora: enable is off")
        return
    config: dict[str, Any] = {}
    for key in ("rank", "alpha", "target_modules", "dropout", "init_lora_weights", "pretrained_lora_path"):
        if key in lora:
            config[key] = lora[key]
    config.setdefault("target_modules", ["q_proj", "k_proj", "v_proj"])  # MindSpeed MM's default
    out.set("model.init_args.transformers_model.lora", config)
    out.mapped.append("training.lora -> model.init_args.transformers_model.lora (" + ", ".join(config) + ")")
    for key in set(lora) - set(config) - {"enable"}:
        if key == "lora_target_modules_support":
            out.notes.append(
                "training.lora.lora_target_modules_support: a validation list; every target is "
                "checked against the model here"
            )
        elif key == "disable_peft_moe_conversion":
            (out.notes if lora[key] else out.unmapped).append(
                f"training.lora.disable_peft_moe_conversion {lora[key]}: LoRA here wraps the matched nn.Linear "
                "modules only" + ("" if lora[key] else "; LoRA on routed experts' parameters is not supported")
            )
        else:
            out.unmapped.append(f"training.lora.{key}: unknown LoRA setting")


def _profile(out: _Out, key: str, profile: Any) -> None:
    out.handled.add(key)
    if isinstance(profile, Mapping) and profile.get("enable"):
        out.unmapped.append(f"{key}: set trainer.profiler (Lightning's PyTorchProfiler) instead")
    else:
        out.notes.append(f"{key}: off")


# --------------------------------------------------------------------------------------------- data, tools
def _data(out: _Out) -> None:
    data = out.data.get("data")
    out.mapped.append(
        "data -> data.init_args.data_config (this file; MMDataModule reads its data: section and "
        "checks every key when it is built)"
    )
    if not isinstance(data, Mapping):
        out.unmapped.append("data: missing; set data.init_args by hand")
        return
    keys = [k for k in _leaves(data, "") if not k.startswith("val_dataset_param")]
    out.notes.append(
        "data keys MMDataModule reads from this file when it is built (each honoured, logged as "
        "without effect, or refused by name): " + ", ".join(keys)
    )
    basic = out.get("data.dataset_param.basic_parameters") or {}
    if isinstance(basic, Mapping) and basic.get("neat_packing"):
        # MMDataModule reads it from the data config itself (packing=True, max_tokens_per_rank=cutoff_len); a
        # token budget and a batch size are exclusive, so the micro-batch size is not written.
        out.mapped.append(
            "data.dataset_param.basic_parameters.neat_packing, cutoff_len -> MMDataModule packing with "
            "max_tokens_per_rank = cutoff_len (read from the data config)"
        )
        callbacks = out.config["trainer"].get("callbacks") or []
        kept = [c for c in callbacks if not str(c.get("class_path")).endswith("GlobalBatchSize")]
        if len(kept) != len(callbacks):
            out.config["trainer"]["callbacks"] = kept
            out.mapped = [m for m in out.mapped if "GlobalBatchSize(" not in m]
            out.notes.append("the global batch size is not kept with neat_packing: a batch holds a token budget")
        if out.config["data"]["init_args"].pop("batch_size", None) is not None:
            out.notes.append(
                "training.micro_batch_size: not written: a packed batch holds cutoff_len tokens per rank "
                "(MMDataModule's batch_size and max_tokens_per_rank are exclusive)"
            )
    elif isinstance(basic, Mapping) and basic.get("packing"):
        out.unmapped.append(
            "data.dataset_param.basic_parameters.packing: packing without neat_packing (samples "
            "attending to each other) is not supported; MMDataModule refuses it; use neat_packing"
        )
    kind = out.get("data.dataset_param.dataset_type")
    if kind not in ("huggingface", "multimodal"):
        out.unmapped.append(
            f"data.dataset_param.dataset_type {kind}: not supported by MMDataModule (huggingface, "
            "multimodal); give a train_valid_test_datasets_provider"
        )
    mode = out.get("data.dataloader_param.dataloader_mode", "sampler")
    if mode != "sampler":
        out.unmapped.append(f"data.dataloader_param.dataloader_mode {mode}: only the sampler mode is supported")
    for key in data:
        if key not in ("dataset_param", "dataloader_param", "val_dataset_param"):
            out.unmapped.append(f"data.{key}: not read by MMDataModule (a model plugin's data setting)")
    if "val_dataset_param" in data:
        out.unmapped.append(
            "data.val_dataset_param: give the validation records as dataset_param.basic_parameters.val_dataset"
        )
    loader = out.get("data.dataloader_param") or {}
    for key in ("prefetch_factor",):
        if isinstance(loader, Mapping) and key in loader:
            out.unmapped.append(f"data.dataloader_param.{key}: not supported by MMDataModule; remove it")


def _tools(out: _Out) -> None:
    tools = out.data.get("tools") or {}
    out.handled.add("tools")
    if not isinstance(tools, Mapping):
        return
    for key, value in tools.items():
        if key in ("profile", "memory_profile"):
            _profile(out, f"tools.{key}", value)
        else:
            out.unmapped.append(f"tools.{key}: unknown tool")
