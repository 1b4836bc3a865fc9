"""MindSpeed MM's Transformers-route ``model.json`` (or the ``model:`` section of its single YAML) as a
:func:`~lightning_mm.hf.transformers_model.TransformersModel` config.

Read, never imported: this module imports neither torch nor Transformers, so ``lightning-mm migrate`` stays light.

* ``model_id`` (MindSpeed MM's registry name: ``qwen3_vl``, ``qwen3_vl_moe``, ``internvl``, ...) becomes the
  ModelHub key of this project's built-in adapter (:data:`MODEL_IDS`); an id without one is an error listing them.
* ``init_from_hf_path`` is kept (relative paths are taken from the launch directory, as MindSpeed MM does).
* The per-tower ``freeze`` flags become the module paths that MindSpeed MM's own model class freezes for that
  architecture, in Transformers' module names (:data:`FREEZE_PATHS`): for Qwen3-VL the vision encoder is
  ``model.visual.{patch_embed,pos_embed,blocks}`` and the projector ``model.visual.merger`` (its ``freeze`` matches
  parameter names containing ``visual.merger``, so the deepstack mergers stay trainable).
* ``loss_cfg`` is mapped when it is MindSpeed MM's default loss, which is this project's: the token mean of each
  micro-batch (``sum of token losses / valid tokens``), averaged over data-parallel ranks and accumulation steps.
  Chunked loss and the other loss types are listed as not mapped, by name and with the reason.
* Every other key is reported: Megatron validation keys (``num_layers``, ``hidden_size``... which MindSpeed MM's
  own comments say do not take effect on this route), NPU kernel settings, ``patch`` entries. None is dropped.

A Megatron-route model.json (towers with ``model_id: qwen2vit`` / ``qwen2lm``..., no ``init_from_hf_path``) of a
family with a Transformers twin (:data:`MEGATRON_ROUTE_IDS`: Qwen2.5-VL, Qwen3-VL) becomes that Transformers class,
with the weights of the Hugging Face directory the job names (``migrate`` passes the data config's
``model_name_or_path``, or ``--hf-path``); the towers' Megatron settings are reported as not applicable. Any other
Megatron-route family is an error naming it. ``mistral3`` and ``glm4v_moe`` (:data:`DERIVED_MODEL_IDS`) train through
derived adapters: no ModelHub key is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mm.mindspeed.keys import MindSpeedConfigError

__all__ = [
    "MindSpeedModelError",
    "ModelMigration",
    "MODEL_IDS",
    "DERIVED_MODEL_IDS",
    "MEGATRON_ROUTE_IDS",
    "FREEZE_PATHS",
    "transformers_model_config",
]


class MindSpeedModelError(MindSpeedConfigError):
    """A MindSpeed MM model config that cannot become a TransformersModel config; ``megatron`` is True when it is
    a Megatron-route model.json of a family with no Transformers twin here."""

    megatron: bool = False


MODEL_IDS: dict[str, str] = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "internvl": "internvl",
    "qwen2_5vl": "qwen2_5_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "llava": "llava",
}
"""MindSpeed MM ``model_id`` -> this project's ModelHub key (each key is also accepted as written)."""

DERIVED_MODEL_IDS: dict[str, tuple[str, str]] = {
    "mistral3": ("Mistral3ForConditionalGeneration", "mistral3"),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", "glm4v_moe"),
}
"""MindSpeed MM ``model_id`` -> (the Transformers class, its ``model_type``) of a family that trains here through a
derived adapter (:mod:`lightning_mm.hf.derived_adapters`): no ModelHub key is written, TransformersModel takes the
class from ``config.json``'s ``architectures``."""

MEGATRON_ROUTE_IDS: dict[str, str] = {"qwen2_5vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl"}
"""A Megatron-route model.json's top ``model_id`` (MindSpeed MM's own towers) -> the built-in family whose
Transformers class is its twin (Qwen3-VL and its MoE share the freeze paths; the class comes from config.json)."""

_MODEL_TYPES = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "internvl": "internvl",
    "qwen2_5_vl": "qwen2_5_vl",
    "llava": "llava",
}
"""ModelHub key -> the ``model_type`` its ``config.json`` must have."""

_VISION, _PROJECTOR, _TEXT = "image_encoder.vision_encoder", "image_encoder.vision_projector", "text_decoder"
_TOWERS = ("image_encoder", "text_decoder", "vision_encoder", "vision_projector", "text_encoder", "video_encoder")
_TOP_LEVEL_TOWER = {_VISION: "vision_encoder", _PROJECTOR: "vision_projector"}
"""Magistral's model.json writes its vision towers at the top level."""

FREEZE_PATHS: dict[str, dict[str, tuple[str, ...]]] = {
    # Qwen3VLFSDP2Mixin.freeze (mindspeed_mm/models/transformers/qwen3vl/qwen3vl.py), for both Qwen3-VL models
    "qwen3_vl": {
        _VISION: ("model.visual.patch_embed", "model.visual.blocks", "model.visual.pos_embed"),
        _PROJECTOR: ("model.visual.merger",),
        _TEXT: ("model.language_model", "lm_head"),
    },
    "qwen3_vl_moe": {
        _VISION: ("model.visual.patch_embed", "model.visual.blocks", "model.visual.pos_embed"),
        _PROJECTOR: ("model.visual.merger",),
        _TEXT: ("model.language_model", "lm_head"),
    },
    # The towers of MindSpeed MM's Megatron route (qwen2vit, the lnmlp merger, the decoder), in Transformers' names
    "qwen2_5_vl": {
        _VISION: ("model.visual.patch_embed", "model.visual.blocks"),
        _PROJECTOR: ("model.visual.merger",),
        _TEXT: ("model.language_model", "lm_head"),
    },
    "internvl": {
        _VISION: ("model.vision_tower",),
        _PROJECTOR: ("model.multi_modal_projector",),
        _TEXT: ("model.language_model", "lm_head"),
    },
    "llava": {
        _VISION: ("model.vision_tower",),
        _PROJECTOR: ("model.multi_modal_projector",),
        _TEXT: ("model.language_model", "lm_head"),
    },
    "mistral3": {
        _VISION: ("model.vision_tower",),
        _PROJECTOR: ("model.multi_modal_projector",),
        _TEXT: ("model.language_model", "lm_head"),
    },
    "glm4v_moe": {
        _VISION: (
            "model.visual.embeddings",
            "model.visual.patch_embed",
            "model.visual.blocks",
            "model.visual.post_conv_layernorm",
            "model.visual.downsample",
            "model.visual.post_layernorm",
        ),
        _PROJECTOR: ("model.visual.merger",),
        _TEXT: ("model.language_model", "lm_head"),
    },
}
"""ModelHub key -> tower (``image_encoder.vision_encoder`` ...) -> the module paths its ``freeze: true`` freezes."""

_FREEZE_SOURCE = {
    "qwen3_vl": "MindSpeed MM's Qwen3VLFSDP2Mixin.freeze",
    "qwen3_vl_moe": "MindSpeed MM's Qwen3VLFSDP2Mixin.freeze",
}
_MEGATRON_TOWER_IDS = {
    "qwen2vit",
    "qwen2lm",
    "qwen2_5_lm",
    "qwen3vit",
    "qwen3lm",
    "lnmlp",
    "internvit",
    "internlm",
    "clip",
    "llava_lm",
    "qwen2_5_omni_thinker",
}

# Keys MindSpeed MM reads only on its Megatron route (its example YAMLs mark them "megatron validation parameter,
# not in effect at run time"): the model's shape comes from init_from_hf_path's config.json.
_MEGATRON_KEYS = {
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
    "ffn_hidden_size",
    "llm_hidden_size",
    "gated_linear_unit",
    "bias_activation_fusion",
    "hidden_dropout",
    "attention_dropout",
    "in_channels",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "layernorm_epsilon",
    "normalization",
    "fp16",
    "bf16",
    "params_dtype",
    "activation_func",
    "use_fused_rotary_pos_emb",
    "post_layer_norm",
    "pipeline_num_layers",
    "intermediate_size",
    "tokens_per_second",
    "window_attn_size",
    "fullatt_block_indexes",
    "attention_mask_type",
    "add_bias_linear",
    "input_size",
    "seq_length",
    "vocab_size",
    "rope_theta",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
    "init_method_std",
    "position_embedding_type",
    "attention_softmax_in_fp32",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "rotary_base",
}
# Settings of MindSpeed MM's own NPU kernels and runtime (overwrite_transformer_config); Transformers' models here
# use Transformers' attention (hf_config.attn_implementation) and this project's FSDP2 plan.
_RUNTIME_KEYS = {
    "attn_implementation": "MindSpeed MM's per-tower NPU attention kernel; set hf_config.attn_implementation "
    "(Transformers' name) for the whole model if you need another kernel",
    "attn_layout": "the layout of MindSpeed MM's NPU attention kernel",
    "synchronize_per_layer": "an NPU stream synchronisation of MindSpeed MM's modeling code",
    "activation_offload": "MindSpeed MM's activation offload; use recompute_modules in the FSDP2 YAML",
    "is_causal": "read by MindSpeed MM's own attention kernels only (Transformers' models here are causal)",
    "use_npu_fused_moe": "MindSpeed MM's fused NPU MoE kernel",
    "img_context_token_id": "a placeholder token id; Transformers' model reads its own from init_from_hf_path's "
    "config.json (image_token_id)",
    "vision_start_token_id": "a token id Transformers' model reads from init_from_hf_path's config.json",
    "video_token_id": "a token id Transformers' model reads from init_from_hf_path's config.json",
    "image_token_id": "a token id Transformers' model reads from init_from_hf_path's config.json",
}
_PATCHES_WITHOUT_EFFECT = {
    "clip_grad_async": "an asynchronous form of Megatron's gradient-norm clipping (same result); "
    "trainer.gradient_clip_val clips here",
    "bridge_patch": "Megatron's get_model patch that builds MindSpeed MM's model; TransformersModel loads "
    "init_from_hf_path itself",
    "scale_grad": "rescales gradients for MindSpeed MM's per-token loss only",
    "infer_fa": "an inference-only attention patch",
}
_LOSS_TYPES_OTHER = {
    "per_sample_loss": "each sample's token mean, averaged over samples",
    "per_token_loss": "the token mean over all micro-batches of a step (PrefetchGradAccDataLoader)",
    "token_loss": "token sums divided by the ranks' mean token count",
    "square_loss": "tokens weighted by 1/sqrt(sample length)",
}
_DEFAULT_LOSS = (
    "the token mean of each micro-batch, averaged over data-parallel ranks and accumulation steps "
    "(MindSpeed MM's loss_type default)"
)


@dataclass
class ModelMigration:
    """A TransformersModel config and what became of each key of the MindSpeed MM model config."""

    config: dict[str, Any]
    """The ``TransformersModel`` config (``model_id``, ``init_from_hf_path``, ``freeze``)."""
    mapped: list[str] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)
    """Keys with no effect here, each with the reason."""
    unmapped: list[str] = field(default_factory=list)
    """Keys that change training and have no counterpart here, each with the reason: review them."""
    family: str | None = None
    """The family key (``internvl``, ``mistral3``, ``qwen2_5_vl``...), when known."""
    megatron: bool = False
    """Whether the config is a Megatron-route model.json (MindSpeed MM's own towers)."""


def _megatron_error(source: str) -> MindSpeedModelError:
    error = _megatron_message(source)
    error.megatron = True
    return error


def _megatron_message(source: str) -> MindSpeedModelError:
    return MindSpeedModelError(
        f"{source}: a Megatron-route model.json (MindSpeed MM's own towers, e.g. image_encoder.vision_encoder.model_id "
        "qwen2vit, and no init_from_hf_path) of a family with no Transformers twin here (those with one: "
        f"{', '.join(MEGATRON_ROUTE_IDS)}): lightning-mm trains Hugging Face models. Use the HF-checkpoint route: "
        "a Transformers-route model.json with `model_id` (e.g. qwen2_5_vl) and `init_from_hf_path` (the Hugging Face "
        "directory the Megatron weights were converted from), as MindSpeed MM's pretrain_transformers.py takes"
    )


def _model_key(model_id: Any, source: str) -> str:
    if not isinstance(model_id, str) or not model_id.strip():
        raise MindSpeedModelError(f"{source}: `model_id` must be a non-empty string, got {model_id!r}")
    key = MODEL_IDS.get(model_id, model_id if model_id in MODEL_IDS.values() else None)
    if key is None and model_id in DERIVED_MODEL_IDS:
        return model_id
    if key is None:
        known = ", ".join([f"{m} -> {k}" for m, k in MODEL_IDS.items()] + [f"{m} (derived)" for m in DERIVED_MODEL_IDS])
        raise MindSpeedModelError(
            f"{source}: `model_id: {model_id}` has no built-in adapter in lightning-mm "
            f"(known: {known}); register an adapter in ModelHub and build it with "
            "TransformersModel in model_provider"
        )
    return key


def _family_types(key: str) -> set[str]:
    """The config.json ``model_type`` values a family accepts (a Megatron-route Qwen3-VL may be the MoE one)."""
    if key in DERIVED_MODEL_IDS:
        return {DERIVED_MODEL_IDS[key][1]}
    return {"qwen3_vl", "qwen3_vl_moe"} if key == "qwen3_vl" else {_MODEL_TYPES[key]}


def _pretrained_type(path: Path) -> str | None:
    """The ``model_type`` of a pretrained directory's config.json, or None when it cannot be read now."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def _walk(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += _walk(value, f"{path}.")
        else:
            out.append((path, value))
    return out


def transformers_model_config(
    model: Mapping[str, Any],
    source: str,
    base_dir: Path,
    hf_dir: str | None = None,
    hf_dir_origin: str = "",
    hf_dir_overrides: bool = False,
) -> ModelMigration:
    """The TransformersModel config of a MindSpeed MM Transformers-route model config (``model.json`` content).

    ``source`` names the file (and section) in messages; relative ``init_from_hf_path`` values are taken from
    ``base_dir`` (the launch directory). Raises :class:`MindSpeedModelError` for a Megatron-route config, an unknown
    ``model_id`` or a malformed value.
    """
    if not isinstance(model, Mapping):
        raise MindSpeedModelError(f"{source}: the model config must be a mapping, got {type(model).__name__}")
    towers = [model.get(t) for t in ("image_encoder", "text_decoder", "audio_encoder")]
    out = ModelMigration(config={})
    handled: set[str] = set()
    megatron = "init_from_hf_path" not in model
    if megatron:
        tower_ids = {v for path, v in _walk(model) if path.endswith(".model_id")}
        if not (any(isinstance(t, Mapping) for t in towers) or tower_ids & _MEGATRON_TOWER_IDS):
            raise MindSpeedModelError(
                f"{source}: no `init_from_hf_path`: a Transformers-route model config names the "
                "Hugging Face directory to start from"
            )
        family = MEGATRON_ROUTE_IDS.get(model.get("model_id"))  # type: ignore[arg-type]
        if family is None:
            raise _megatron_error(source)
        key: str | None = family
        out.mapped.append(
            f"model_id {model['model_id']} (MindSpeed MM's Megatron towers) -> its Transformers twin through "
            "TransformersModel: the class comes from the Hugging Face directory's config.json (architectures)"
        )
        if hf_dir is None:
            out.unmapped.append(
                "init_from_hf_path: a Megatron-route model.json names no Hugging Face directory, and none was "
                "found (the data config's preprocess_parameters.model_name_or_path, or `migrate --hf-path`); "
                "set model.init_args.transformers_model.init_from_hf_path"
            )
    elif "model_id" in model:
        key = _model_key(model["model_id"], source)
        if key in DERIVED_MODEL_IDS:
            out.mapped.append(
                f"model_id {key} -> none: no ModelHub adapter needed; TransformersModel takes the class from "
                f"config.json's architectures (Transformers' {DERIVED_MODEL_IDS[key][0]}) and derives its default "
                "FSDP2 plan from the model"
            )
        else:
            out.config["model_id"] = key
            out.mapped.append(f"model_id {model['model_id']} -> ModelHub key {key}")
    else:
        key = None
    handled.add("model_id")

    if megatron and hf_dir is None:
        hf_path: Any = None
    elif megatron or (hf_dir is not None and hf_dir_overrides):
        hf_path = hf_dir
        out.mapped.append(f"init_from_hf_path <- {hf_dir_origin}")
    else:
        hf_path = model["init_from_hf_path"]
    if hf_path is not None:
        _map_hf_path(out, model, key, hf_path, source, base_dir, handled)
    if key is None and hf_path is not None:
        found = _pretrained_type((base_dir / str(hf_path)).resolve())
        key = next((k for k, t in _MODEL_TYPES.items() if t == found), None)

    out.family, out.megatron = key, megatron
    _map_freeze(model, key, source, out, handled)
    _map_loss(model.get("loss_cfg"), out, handled, source)
    _map_patch(model.get("patch"), out, handled)
    _map_rest(model, out, handled, megatron)
    return out


def _map_hf_path(
    out: ModelMigration,
    model: Mapping[str, Any],
    key: str | None,
    hf_path: Any,
    source: str,
    base_dir: Path,
    handled: set[str],
) -> None:
    """``init_from_hf_path`` (or the directory given for it), checked against the family when it is readable."""
    if not isinstance(hf_path, str) or not hf_path.strip():
        raise MindSpeedModelError(f"{source}: `init_from_hf_path` must be a directory path, got {hf_path!r}")
    path = (base_dir / hf_path).resolve()
    out.config["init_from_hf_path"] = str(path)
    out.mapped.append(f"init_from_hf_path -> {path}")
    handled.add("init_from_hf_path")
    found_type = _pretrained_type(path)
    if found_type is None:
        out.unmapped.append(
            f"init_from_hf_path: {path} has no readable config.json yet; it must be a Hugging Face "
            "model directory before training"
        )
    elif key is not None and found_type not in _family_types(key):
        raise MindSpeedModelError(
            f"{source}: init_from_hf_path {path} holds a `{found_type}` model, not the `{_MODEL_TYPES.get(key, key)}` "
            f"that model_id {model['model_id']} builds (a remote-code checkpoint such as InternVLChatModel needs its "
            "Transformers-format conversion, e.g. the '-HF' release)"
        )


def _map_rest(model: Mapping[str, Any], out: ModelMigration, handled: set[str], megatron: bool = False) -> None:
    if "trust_remote_code" in model:
        out.config["trust_remote_code"] = bool(model["trust_remote_code"])
        out.mapped.append(f"trust_remote_code -> {bool(model['trust_remote_code'])}")
        handled.add("trust_remote_code")
    for name, value in _walk(model):
        if name in handled or any(name.startswith(f"{h}.") for h in handled):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if megatron and name.split(".", 1)[0] in _TOWERS and leaf != "model_id":
            out.not_applicable.append(
                f"{name}: a setting of MindSpeed MM's own Megatron tower; the Transformers twin's shape comes "
                "from the Hugging Face directory's config.json"
            )
        elif leaf in _MEGATRON_KEYS:
            out.not_applicable.append(
                f"{name}: a Megatron validation key, not in effect on MindSpeed MM's "
                "Transformers route; the model's shape comes from init_from_hf_path's "
                "config.json"
            )
        elif leaf == "model_id":
            out.not_applicable.append(
                f"{name} {value}: the name of MindSpeed MM's Megatron component for this "
                "tower, unused on the Transformers route"
            )
        elif leaf in _RUNTIME_KEYS:
            out.not_applicable.append(f"{name}: {_RUNTIME_KEYS[leaf]}")
        else:
            out.unmapped.append(f"{name}: unknown to lightning-mm migrate")


def _flag(model: Mapping[str, Any], tower: str, source: str) -> bool:
    node: Any = model
    for part in tower.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping) and tower in _TOP_LEVEL_TOWER:
        node = model.get(_TOP_LEVEL_TOWER[tower])
    value = node.get("freeze", False) if isinstance(node, Mapping) else False
    if not isinstance(value, bool):
        raise MindSpeedModelError(f"{source}: `{tower}.freeze` must be true or false, got {value!r}")
    return value


def _map_freeze(model: Mapping[str, Any], key: str | None, source: str, out: ModelMigration, handled: set[str]) -> None:
    towers = [t for t in (_VISION, _PROJECTOR, _TEXT) if _flag(model, t, source)]
    handled.update(f"{t}.freeze" for t in (_VISION, _PROJECTOR, _TEXT, *_TOP_LEVEL_TOWER.values()))
    if not towers:
        return
    if key is None:
        raise MindSpeedModelError(
            f"{source}: the freeze flags of {', '.join(towers)} need the model's family: give "
            f"`model_id` (one of {', '.join(MODEL_IDS)})"
        )
    paths = [p for t in towers for p in FREEZE_PATHS[key][t]]
    out.config["freeze"] = paths
    why = _FREEZE_SOURCE.get(
        key, "the towers of MindSpeed MM's Megatron route (its Transformers route has no freeze for this class)"
    )
    for tower in towers:
        out.mapped.append(f"{tower}.freeze -> freeze {list(FREEZE_PATHS[key][tower])} (as {why})")


def _map_loss(loss: Any, out: ModelMigration, handled: set[str], source: str = "model") -> None:
    handled.add("loss_cfg")
    if loss is None:
        return
    if not isinstance(loss, Mapping):
        out.unmapped.append(f"loss_cfg: expected a mapping, got {loss!r}")
        return
    known = {"compute_mode", "chunk_size", "loss_type", "router_aux_loss_coef"}
    mode, kind = loss.get("compute_mode", "default"), loss.get("loss_type", "default")
    if mode in ("chunk", "dynamic_chunk"):
        # MindSpeed MM (models/transformers_model.py, _set_loss_cfg): chunk_size defaults to 1024 (chunk) or 4096
        # (dynamic_chunk, where it bounds the tokens of a chunk); the loss is the same, only memory differs.
        size = loss.get("chunk_size", 1024 if mode == "chunk" else 4096)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MindSpeedModelError(f"{source}: `loss_cfg.chunk_size`: expected an integer >= 1, got {size!r}")
        out.config["enable_chunk_loss"] = True
        out.config["chunk_loss_size"] = size
        out.mapped.append(
            f"loss_cfg.compute_mode {mode}, chunk_size {size} -> enable_chunk_loss: true, chunk_loss_size: {size} "
            "(the loss and its gradients computed chunk by chunk, without the [tokens, vocab] logits)"
        )
    elif mode != "default":
        raise MindSpeedModelError(
            f"{source}: `loss_cfg.compute_mode`: {mode!r} is not a MindSpeed MM compute mode "
            "(default, chunk, dynamic_chunk)"
        )
    elif "chunk_size" in loss:
        out.not_applicable.append("loss_cfg.chunk_size: used only by compute_mode chunk / dynamic_chunk")
    if kind in _LOSS_TYPES_OTHER:
        out.unmapped.append(
            f"loss_cfg.loss_type {kind} ({_LOSS_TYPES_OTHER[kind]}): not implemented in "
            f"lightning-mm, whose loss is {_DEFAULT_LOSS}"
        )
    elif kind != "default":
        out.unmapped.append(f"loss_cfg.loss_type {kind}: not a MindSpeed MM loss type")
    elif mode == "default":
        out.mapped.append(f"loss_cfg (compute_mode default, loss_type default) -> the default loss: {_DEFAULT_LOSS}")
    coef = loss.get("router_aux_loss_coef", 0.0)
    if coef not in (0, 0.0, None):
        out.unmapped.append(
            f"loss_cfg.router_aux_loss_coef {coef}: the MoE router's auxiliary loss is not added "
            "here; set hf_config output_router_logits/router_aux_loss_coef by hand and check it"
        )
    for name in sorted(set(loss) - known):
        out.unmapped.append(f"loss_cfg.{name}: unknown to lightning-mm migrate")


def _map_patch(patch: Any, out: ModelMigration, handled: set[str]) -> None:
    handled.add("patch")
    if patch is None:
        return
    if not isinstance(patch, Mapping):
        out.unmapped.append(f"patch: expected a mapping of patch names to true/false, got {patch!r}")
        return
    for name, on in patch.items():
        if not on:
            out.not_applicable.append(f"patch.{name}: off")
        elif name in _PATCHES_WITHOUT_EFFECT:
            out.not_applicable.append(
                f"patch.{name}: a MindSpeed MM patch of Megatron, not applicable: {_PATCHES_WITHOUT_EFFECT[name]}"
            )
        else:
            out.unmapped.append(
                f"patch.{name}: a MindSpeed MM patch of Megatron internals "
                "(mindspeed_mm/patchs/patch_manager.py) with no counterpart here"
            )
