"""MindSpeed MM's diffusion ``model.json`` (Wan 2.1 / 2.2: ``predictor``, ``diffusion``, ``ae``, ``text_encoder``) as
an :class:`~lightning_mm.modules.wan_module.MMWanModule` config, the diffusers path of this project.

Read, never imported: no torch, no diffusers. ``predictor`` (MindSpeed MM's ``wandit``) becomes diffusers'
``WanTransformer3DModel`` loaded from a ``save_pretrained`` directory (the job's ``--load``, or ``migrate
--hf-path``); its Megatron-style shape keys are reported as not applicable (the shape comes from that directory's
``config.json``). ``diffusion`` (``wan_flow_match_scheduler``) becomes ``MMWanModule``'s ``schedule``. ``ae`` and
``text_encoder`` are the frozen encoders of online feature extraction: with ``load_video_features`` /
``load_text_features`` true the features are precomputed and they are not used; otherwise the report says what
the data path here needs.

MindSpeed MM's LoRA flags on a Wan job (``finetune_lora*.sh``: ``--lora-target-modules proj_q proj_k proj_v proj_out
ffn.0 ffn.2``, PEFT suffix names of its ``wandit`` modules) become ``diffusers_model.lora`` with the same linears
under diffusers' names (:func:`wan_lora_targets`).

Wan VACE (``predictor.model_id: vace``, MindSpeed MM's ``VACEModel``: the Wan DiT ``wan_dit`` and the control branch
``vace_dit``) becomes diffusers' ``WanVACETransformer3DModel`` the same way (its directory's ``config.json`` names the
class and gives ``vace_layers`` / ``vace_in_channels``), trained as ``VACEModel.freeze`` does: the Wan part frozen,
the VACE part (diffusers' ``vace_patch_embedding`` and ``vace_blocks``) trained: ``diffusers_model.trainable``. The
``vace_dit`` section's shape keys are reported as not applicable like the predictor's; its ``vace_pretrained`` (a
MindSpeed MM weights file of the VACE part) is not read: the diffusers directory holds both parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_mm.mindspeed.keys import MindSpeedConfigError

__all__ = [
    "WAN_MODULE",
    "WAN_LORA_TARGETS",
    "VACE_TRAINABLE",
    "DiffusionMigration",
    "is_diffusion_model",
    "wan_lora_targets",
    "wan_module_config",
]

WAN_MODULE = "lightning_mm.modules.wan_module.MMWanModule"
_SCHEDULE_KEYS = (
    "num_train_timesteps",
    "shift",
    "sigma_min",
    "sigma_max",
    "extra_one_step",
    "min_timestep_boundary",
    "max_timestep_boundary",
)
_PREDICTOR_IDS = ("wandit", "vace")
VACE_TRAINABLE = ["vace_patch_embedding", "vace_blocks"]
"""The modules of diffusers' ``WanVACETransformer3DModel`` that MindSpeed MM's ``VACEModel`` trains (its
``vace_dit``: ``vace_patch_embedding`` and ``vace_blocks``, each block's ``before_proj`` / ``after_proj`` being
diffusers' ``proj_in`` / ``proj_out``); everything else (``wan_dit``) is frozen."""
_SHAPE_KEYS = (
    "patch_size",
    "text_len",
    "in_dim",
    "hidden_size",
    "ffn_dim",
    "freq_dim",
    "text_dim",
    "img_dim",
    "out_dim",
    "num_heads",
    "num_layers",
    "qk_norm",
    "qk_norm_type",
    "cross_attn_norm",
    "eps",
    "max_seq_len",
)
_VACE_SHAPE_KEYS = (*_SHAPE_KEYS, "vace_layers")
_RUNTIME = {
    "pipeline_num_layers": "Megatron pipeline stages; not used with FSDP2",
    "attention_async_offload": "an NPU attention offload of MindSpeed MM's DiT",
    "use_fused_rmsnorm": "an NPU fused RMSNorm kernel (same result)",
    "dtype": "the weights' dtype; mixed precision comes from the FSDP2 YAML's param_dtype / trainer.precision",
    "FPDT": "MindSpeed MM's fully pipelined distributed transformer (sequence chunks); not implemented here",
    "FPDT_chunk_number": "used only with FPDT",
    "FPDT_with_offload": "used only with FPDT",
}


WAN_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "proj_q": ("attn1.to_q", "attn2.to_q"),
    "proj_k": ("attn1.to_k", "attn2.to_k"),
    "proj_v": ("attn1.to_v", "attn2.to_v"),
    "proj_out": ("attn1.to_out.0", "attn2.to_out.0"),
    "k_img": ("attn2.add_k_proj",),
    "v_img": ("attn2.add_v_proj",),
    "ffn.0": ("ffn.net.0.proj",),
    "ffn.2": ("ffn.net.2",),
}
"""A MindSpeed MM ``wandit`` LoRA target (PEFT matches it as a module-name suffix: in each block, ``self_attn`` and
``cross_attn`` both have ``proj_q``...; ``k_img`` / ``v_img`` are i2v's image keys and values) -> the same linears in
each of diffusers' ``WanTransformer3DModel.blocks`` (``attn1`` self-attention, ``attn2`` cross-attention)."""


def wan_lora_targets(names: list[str]) -> tuple[list[str], list[str]]:
    """The diffusers module-path patterns of MindSpeed MM's Wan LoRA targets, and the names with no counterpart."""
    patterns: dict[str, None] = {}
    unknown = []
    for name in names:
        found = WAN_LORA_TARGETS.get(name.strip().removeprefix("self_attn.").removeprefix("cross_attn."))
        if found is None:
            unknown.append(name)
            continue
        if name.startswith("self_attn."):
            found = tuple(f for f in found if f.startswith("attn1."))
        elif name.startswith("cross_attn."):
            found = tuple(f for f in found if f.startswith("attn2."))
        patterns.update({f"blocks.{{*}}.{f}": None for f in found})
    return list(patterns), unknown


@dataclass
class DiffusionMigration:
    """The ``model:`` section for MMWanModule and what became of each key."""

    model: dict[str, Any]
    mapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)


def is_diffusion_model(config: Mapping[str, Any]) -> bool:
    """A MindSpeed MM diffusion model.json: a ``predictor`` section (the DiT)."""
    return isinstance(config.get("predictor"), Mapping)


def config_items(node: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += config_items(value, f"{name}.")
        else:
            out.append((name, value))
    return out


def wan_module_config(config: Mapping[str, Any], source: str, weights: str | None, origin: str) -> DiffusionMigration:
    """The MMWanModule config of a Wan model.json; ``weights`` is the diffusers transformer directory (from
    ``origin``: ``--load`` or ``--hf-path``), or None when the job names none."""
    out = DiffusionMigration(model={"class_path": WAN_MODULE, "init_args": {"diffusers_model": {}}})
    args = out.model["init_args"]
    predictor = config["predictor"]
    model_id = predictor.get("model_id")
    if model_id not in _PREDICTOR_IDS:
        raise MindSpeedConfigError(
            f"{source}: predictor.model_id {model_id!r}: only Wan's `wandit` and Wan VACE's `vace` are built in here"
        )
    vace = model_id == "vace"
    diffusers_class = "WanVACETransformer3DModel" if vace else "WanTransformer3DModel"
    out.mapped.append(
        f"predictor.model_id {model_id} -> {WAN_MODULE} with diffusers' {diffusers_class} (DiffusersModel)"
    )
    if vace:
        args["diffusers_model"]["trainable"] = list(VACE_TRAINABLE)
        out.mapped.append(
            "predictor.model_id vace: MindSpeed MM's VACEModel.freeze (wan_dit frozen, vace_dit trained) -> "
            f"model.init_args.diffusers_model.trainable {VACE_TRAINABLE}"
        )
    if weights:
        args["diffusers_model"]["init_from_path"] = weights
        out.mapped.append(
            f"{origin} -> model.init_args.diffusers_model.init_from_path ({weights}): it must be the diffusers "
            f"`transformer` directory ({diffusers_class}.save_pretrained), not MindSpeed MM's converted weights"
        )
    else:
        out.unmapped.append(
            "predictor: no weights directory (no --load, no `migrate --hf-path`); set "
            "model.init_args.diffusers_model.init_from_path"
        )
    for key, value in predictor.items():
        name = f"predictor.{key}"
        if key == "model_id":
            continue
        if key == "model_type":
            out.notes.append(f"{name} {value}: t2v / i2v differ here only in the checkpoint's config and batch keys")
        elif key == "from_pretrained":
            out.notes.append(f"{name} {value}: MindSpeed MM's own weights file; the diffusers directory is used")
        elif key in _I2V_KEYS:
            _i2v_key(out, name, key, value, predictor.get("model_type"))
        elif key in _SHAPE_KEYS:
            out.notes.append(f"{name}: a shape key; the shape comes from the diffusers directory's config.json")
        elif key in _RUNTIME:
            (out.unmapped if key == "FPDT" and value else out.notes).append(f"{name}: {_RUNTIME[key]}")
        elif key == "vace_dit" and vace and isinstance(value, Mapping):
            _vace_section(value, out)
        else:
            out.unmapped.append(f"{name}: unknown to lightning-mm migrate")
    diffusion = config.get("diffusion") or {}
    schedule: dict[str, Any] = {}
    if isinstance(diffusion, Mapping):
        scheduler = diffusion.get("model_id", "wan_flow_match_scheduler")
        if scheduler != "wan_flow_match_scheduler":
            out.unmapped.append(f"diffusion.model_id {scheduler}: only wan_flow_match_scheduler is built in")
        else:
            out.mapped.append("diffusion.model_id wan_flow_match_scheduler -> MMWanModule's flow-matching schedule")
        for key, value in diffusion.items():
            if key in _SCHEDULE_KEYS:
                schedule[key] = value
                out.mapped.append(f"diffusion.{key} -> model.init_args.schedule.{key}")
            elif key != "model_id":
                out.unmapped.append(f"diffusion.{key}: not a key of the Wan flow-matching schedule")
    if schedule:
        args["schedule"] = schedule
    for key in ("load_video_features", "load_text_features"):
        if key not in config:
            continue
        if config[key]:
            out.notes.append(f"{key}: true: the data config names precomputed features (dataset_type feature)")
        elif key == "load_video_features":
            out.notes.append(
                f"{key}: false: raw videos are encoded by the frozen VAE at the data config's "
                "basic_parameters.vae_path (a key of this project; set it to the `ae` directory)"
            )
        else:
            out.unmapped.append(
                f"{key}: false: text prompts are not encoded here; precompute prompt_ids (MindSpeed MM's "
                "feature extraction) and name them in the data records"
            )
    for section in ("ae", "text_encoder"):
        if isinstance(config.get(section), Mapping):
            out.notes += [
                f"{name}: the frozen encoder of online feature extraction; not part of the trained model here"
                for name, _ in config_items(config[section], f"{section}.")
            ]
    task = config.get("task")
    if task is not None:
        out.notes.append(
            f"task {task}: the task follows the checkpoint and the batch keys (i2v: image_embeds; vace: "
            "control_latents, the feature files' vace_context)"
        )
    name_other_keys(
        config, out, {"encoder_offload_interval": "offloads the online encoders; they are not part of the model here"}
    )
    return out


_SECTIONS = {"predictor", "diffusion", "load_video_features", "load_text_features", "ae", "text_encoder", "task"}


def name_other_keys(config: Mapping[str, Any], out: DiffusionMigration, notes: Mapping[str, str]) -> None:
    """Name the top-level keys of a diffusion model.json beyond its sections: ``patch`` entries (Megatron patches),
    the keys of ``notes`` (key -> why it has no effect here) as notes, any other key as NOT mapped."""
    for key, value in config.items():
        if key in _SECTIONS:
            continue
        if key == "patch" and isinstance(value, Mapping):
            out.notes += [f"patch.{name}: a MindSpeed MM patch of Megatron internals; not applicable" for name in value]
        elif key in notes:
            out.notes.append(f"{key}: {notes[key]}")
        else:
            out.unmapped.append(f"{key}: unknown to lightning-mm migrate")


_I2V_KEYS = ("clip_token_len", "text_len")
_IMAGE_TYPES = ("i2v", "flf2v")
_TEXT_CONTEXT = 512  # diffusers' Wan attention: the last 512 context positions are the text, those before the image


def _i2v_key(out: DiffusionMigration, name: str, key: str, value: Any, model_type: Any) -> None:
    """``predictor.clip_token_len`` / ``text_len``: where ``wandit`` splits its cross-attention context into image and
    text tokens. diffusers' ``WanTransformer3DModel`` splits it at the last 512 positions, so an image-to-video job
    whose ``text_len`` is not 512 cannot train here as MindSpeed MM trains it (NOT mapped, with the reason)."""
    if key == "clip_token_len":
        out.notes.append(
            f"{name} {value}: the image tokens are the rows of each feature file's i2v_clip_feature; diffusers "
            f"splits them from the text by the text's {_TEXT_CONTEXT} positions"
        )
    elif model_type in _IMAGE_TYPES and value != _TEXT_CONTEXT:
        out.unmapped.append(
            f"{name} {value}: model_type {model_type} needs text_len {_TEXT_CONTEXT} here: diffusers' Wan "
            f"attention takes the last {_TEXT_CONTEXT} context positions as the text and those before as the image"
        )
    else:
        out.notes.append(f"{name}: a shape key; the shape comes from the diffusers directory's config.json")


def _vace_section(section: Mapping[str, Any], out: DiffusionMigration) -> None:
    """What becomes of ``predictor.vace_dit``'s keys (the VACE branch's shape comes from the diffusers config)."""
    for key, value in section.items():
        name = f"predictor.vace_dit.{key}"
        if key in _VACE_SHAPE_KEYS:
            out.notes.append(
                f"{name}: a shape key; the shape comes from the diffusers directory's config.json "
                "(vace_layers, vace_in_channels)"
            )
        elif key in _RUNTIME:
            out.notes.append(f"{name}: {_RUNTIME[key]}")
        elif key == "vace_pretrained":
            if value is None:
                out.notes.append(f"{name}: null: the VACE weights come from the diffusers directory")
            else:
                out.unmapped.append(
                    f"{name} {value}: MindSpeed MM's own weights of the VACE part are not read; the diffusers "
                    "directory (WanVACETransformer3DModel) holds both parts"
                )
        else:
            out.unmapped.append(f"{name}: unknown to lightning-mm migrate")
