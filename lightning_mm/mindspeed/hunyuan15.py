"""MindSpeed MM's HunyuanVideo 1.5 ``model.json`` (``examples/hunyuanvideo_1.5/t2v`` and ``i2v``) as an
:class:`~lightning_mm.modules.hunyuan15_module.MMHunyuan15Module` config, the diffusers path of this project.

Read, never imported: no torch, no diffusers. ``predictor`` (``hunyuanvideo15dit``) becomes diffusers'
``HunyuanVideo15Transformer3DModel`` loaded from a ``save_pretrained`` directory (the job's ``--load``, or ``migrate
--hf-path``); its shape keys are reported as not applicable (the shape comes from that directory's ``config.json``),
and the keys that select an architecture diffusers' class does not have (single-stream blocks, guidance or
meanflow embeddings, a text projection other than the token refiner, no byT5 glyph branch) are NOT mapped.
``diffusion`` (``hunyuanvideo_15_diffusion``) becomes the module's ``schedule`` (``num_train_timesteps``,
``train_timestep_shift``, ``snr``); ``shift``, ``reverse`` and ``solver`` are the sampler's. ``ae`` and
``text_encoder`` (and ``ae.i2v_processor``, i2v's SigLIP encoder) are the frozen encoders of online feature
extraction: the data path here reads precomputed features in the layout MindSpeed MM's training reads with
``load_video_features`` / ``load_text_features: true`` (its ``get_hunyuan15_feature.py`` at the pinned commit stops at
its VAE step: ``.latent_dist`` of the tensor ``AutoencoderKLConv3D.encode`` returns). ``task``
(``t2v``, ``i2v``) selects the batch keys (i2v: ``condition_latents``, ``image_embeds``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_mm.mindspeed.diffusion import DiffusionMigration, config_items, name_other_keys
from lightning_mm.mindspeed.keys import MindSpeedConfigError

__all__ = ["HUNYUAN15_MODULE", "HUNYUAN15_PREDICTOR", "hunyuan15_module_config"]

HUNYUAN15_MODULE = "lightning_mm.modules.hunyuan15_module.MMHunyuan15Module"
HUNYUAN15_PREDICTOR = "hunyuanvideo15dit"
_SCHEDULER = "hunyuanvideo_15_diffusion"
_SCHEDULE_KEYS = ("num_train_timesteps", "train_timestep_shift", "snr")
_SAMPLER_KEYS = ("shift", "reverse", "solver")
_SHAPE_KEYS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "hidden_size",
    "num_heads",
    "head_dim",
    "mlp_width_ratio",
    "mm_double_blocks_depth",
    "rope_dim_list",
    "rope_theta",
    "text_states_dim",
    "vision_states_dim",
)
_ARCHITECTURE: dict[str, Any] = {
    "concat_condition": True,
    "mlp_act_type": "gelu_tanh",
    "mm_single_blocks_depth": 0,
    "qkv_bias": True,
    "qk_norm": True,
    "qk_norm_type": "rms",
    "guidance_embed": False,
    "use_meanflow": False,
    "text_projection": "single_refiner",
    "use_attention_mask": True,
    "text_states_dim_2": None,
    "text_pool_type": None,
    "glyph_byT5_v2": True,
    "is_reshape_temporal_channels": False,
    "use_cond_type_embedding": True,
}
"""The architecture keys of MindSpeed MM's ``HunyuanVideo15DiT`` and the value diffusers' class is built with."""
_DENSE_ATTENTION = ("flash", "flash2", "torch")
_TASKS = {"t2v": "linear-none", "i2v": "linear"}
"""A task -> MindSpeed MM's ``vision_projection`` for it (t2v: none; diffusers' model masks out its zero image)."""


def hunyuan15_module_config(
    config: Mapping[str, Any], source: str, weights: str | None, origin: str
) -> DiffusionMigration:
    """The MMHunyuan15Module config of a HunyuanVideo 1.5 model.json; ``weights`` is the diffusers transformer
    directory (from ``origin``: ``--load`` or ``--hf-path``), or None when the job names none."""
    out = DiffusionMigration(model={"class_path": HUNYUAN15_MODULE, "init_args": {"diffusers_model": {}}})
    args = out.model["init_args"]
    predictor = config["predictor"]
    if predictor.get("model_id") != HUNYUAN15_PREDICTOR:
        raise MindSpeedConfigError(
            f"{source}: predictor.model_id {predictor.get('model_id')!r} is not HunyuanVideo 1.5"
        )
    out.mapped.append(
        f"predictor.model_id {HUNYUAN15_PREDICTOR} -> {HUNYUAN15_MODULE} with diffusers' "
        "HunyuanVideo15Transformer3DModel (DiffusersModel)"
    )
    if weights:
        args["diffusers_model"]["init_from_path"] = weights
        out.mapped.append(
            f"{origin} -> model.init_args.diffusers_model.init_from_path ({weights}): it must be the diffusers "
            "`transformer` directory (HunyuanVideo15Transformer3DModel.save_pretrained), not the original release's "
            "weights MindSpeed MM reads"
        )
    else:
        out.unmapped.append(
            "predictor: no weights directory (no --load, no `migrate --hf-path`); set "
            "model.init_args.diffusers_model.init_from_path"
        )
    task = config.get("task", "t2v")
    if task not in _TASKS:
        raise MindSpeedConfigError(f"{source}: task {task!r}: HunyuanVideo 1.5 trains t2v or i2v")
    for key, value in predictor.items():
        name = f"predictor.{key}"
        if key == "model_id":
            continue
        if key in ("vision_projection", "task_type"):
            expected = _TASKS[task] if key == "vision_projection" else task
            if value == expected:
                out.notes.append(f"{name} {value}: as diffusers' HunyuanVideo15Transformer3DModel runs task {task}")
            else:
                out.unmapped.append(f"{name} {value}: task {task} needs {expected!r} here")
            continue
        if key == "from_pretrained":
            out.notes.append(f"{name} {value}: MindSpeed MM's own weights file; the diffusers directory is used")
        elif key in _SHAPE_KEYS:
            out.notes.append(f"{name}: a shape key; the shape comes from the diffusers directory's config.json")
        elif key in _ARCHITECTURE:
            if value == _ARCHITECTURE[key]:
                out.notes.append(f"{name} {value}: as diffusers' HunyuanVideo15Transformer3DModel is built")
            else:
                out.unmapped.append(
                    f"{name} {value}: diffusers' HunyuanVideo15Transformer3DModel has {_ARCHITECTURE[key]!r} only"
                )
        elif key == "attn_mode":
            if value in _DENSE_ATTENTION:
                out.notes.append(f"{name} {value}: a dense attention kernel; diffusers' attention (same result)")
            else:
                out.unmapped.append(f"{name} {value}: sparse attention is not implemented here (dense is used)")
        elif key == "attn_param":
            out.notes.append(f"{name}: sparse-attention settings, used only with a sparse attn_mode")
        elif key == "dtype":
            out.notes.append(f"{name}: mixed precision comes from the FSDP2 YAML's param_dtype / trainer.precision")
        else:
            out.unmapped.append(f"{name}: unknown to lightning-mm migrate")
    _map_diffusion(config.get("diffusion"), args, out)
    _map_features(config, out)
    return out


def _map_diffusion(diffusion: Any, args: dict[str, Any], out: DiffusionMigration) -> None:
    if not isinstance(diffusion, Mapping):
        out.notes.append("diffusion: absent; MindSpeed MM's HunyuanVideo 1.5 schedule defaults are used")
        return
    schedule: dict[str, Any] = {}
    scheduler = diffusion.get("model_id", _SCHEDULER)
    if scheduler != _SCHEDULER:
        out.unmapped.append(f"diffusion.model_id {scheduler}: only {_SCHEDULER} is built in for HunyuanVideo 1.5")
    else:
        out.mapped.append(f"diffusion.model_id {_SCHEDULER} -> MMHunyuan15Module's flow-matching schedule")
    for key, value in diffusion.items():
        name = f"diffusion.{key}"
        if key in _SCHEDULE_KEYS:
            schedule[key] = value
            out.mapped.append(f"{name} -> model.init_args.schedule.{key}")
        elif key in _SAMPLER_KEYS:
            out.notes.append(f"{name}: the sampler's (inference); training draws with train_timestep_shift")
        elif key == "precondition_outputs" and not value:
            out.notes.append(f"{name} false: the target is the velocity noise - x0, as here")
        elif key in ("sp_size", "dp_replicate") and value == 1:
            out.notes.append(f"{name} 1: no sequence parallelism / replication inside the scheduler")
        elif key != "model_id":
            out.unmapped.append(f"{name} {value}: not implemented for HunyuanVideo 1.5 here")
    if schedule:
        args["schedule"] = schedule


def _map_features(config: Mapping[str, Any], out: DiffusionMigration) -> None:
    for key in ("load_video_features", "load_text_features"):
        if key not in config:
            continue
        if config[key]:
            out.notes.append(f"{key}: true: the data config names precomputed features (dataset_type feature)")
        else:
            out.unmapped.append(
                f"{key}: false: online encoding (the VAE, the MLLM and byT5 text encoders) is not done here; "
                "give precomputed features in MindSpeed MM's feature layout (what its training reads with "
                "load_video_features/load_text_features true) in a `dataset_type: feature` data config (its "
                "get_hunyuan15_feature.py at 57069cd5 stops at its VAE step, and lightning-mm extract-features "
                "does not write HunyuanVideo 1.5's)"
            )
    for section in ("ae", "text_encoder"):
        value = config.get(section)
        towers = [(section, value)] if isinstance(value, Mapping) else []
        if isinstance(value, list):
            towers = [(f"{section}[{i}]", tower) for i, tower in enumerate(value) if isinstance(tower, Mapping)]
        for prefix, tower in towers:
            out.notes += [
                f"{name}: the frozen encoder of feature extraction; not part of the trained model here"
                for name, _ in config_items(tower, f"{prefix}.")
            ]
    if config.get("task", "t2v") == "t2v":
        out.notes.append("task t2v: text-to-video (the first-frame condition channels and image tokens are zeros)")
    else:
        out.notes.append(
            "task i2v: image-to-video; the features add cond_latents and vision_states (MindSpeed MM's "
            "hunyuanvideo_15_i2v_processor), read as the batch keys condition_latents and image_embeds"
        )
    name_other_keys(config, out, {})
