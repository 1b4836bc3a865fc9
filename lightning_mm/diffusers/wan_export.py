"""A trained Wan denoiser back as a diffusers model directory (``WanTransformer3DModel.from_pretrained`` loads it).

:func:`dcp_to_diffusers` reads the predictor's weights from a checkpoint of this project (a DCP directory or a
consolidated file; never the optimiser state), one shard at a time, and writes them as diffusers'
``save_pretrained`` does: ``config.json`` (the pretrained directory's, or one given), and
``diffusion_pytorch_model.safetensors`` or numbered shards with ``diffusion_pytorch_model.safetensors.index.json``.
The output appears complete or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lightning_mm.checkpoint import atomic
from lightning_mm.checkpoint.checkpoint_layout import model_key
from lightning_mm.checkpoint.consolidate import check_output, writing
from lightning_mm.checkpoint.source import open_source
from lightning_mm.diffusers.model import read_diffusers_config
from lightning_mm.diffusers.weights import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from lightning_mm.errors import ConfigError

__all__ = ["DEFAULT_PREFIX", "dcp_to_diffusers"]

DEFAULT_PREFIX = "model.predictor."
"""Where an ``MMWanModule`` keeps the denoiser's weights: ``self.model`` (``WanDiffusion``) ``.predictor``."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dcp_to_diffusers(
    src: str | Path,
    out_dir: str | Path,
    config: str | Path,
    prefix: str = DEFAULT_PREFIX,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
) -> Path:
    """Write the diffusers model under ``prefix`` of checkpoint ``src`` to ``out_dir``.

    ``config`` is the model's diffusers directory (its ``config.json`` is copied) or a ``config.json`` file.
    ``dtype`` (fp32, bf16, fp16) casts floating tensors. ``force`` replaces an earlier output (a directory with a
    ``config.json``) once the new one is complete.
    """
    out = Path(out_dir)
    config_path = Path(config)
    config_dict = (
        read_diffusers_config(config_path if config_path.is_dir() else config_path.parent)
        if config_path.is_dir() or config_path.name == "config.json"
        else None
    )
    if config_dict is None:
        raise ConfigError(f"config: {config} is neither a diffusers model directory nor its config.json")
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    cast = _DTYPES.get(dtype) if dtype else None
    check_output(out, force, kind="hf")
    source = open_source(src)
    start = model_key(prefix)
    stored = {k[len(start) :]: k for k in source.shapes if k.startswith(start)}
    if not stored:
        raise ConfigError(f"{src}: no model weights under {prefix!r}")
    adapters = sorted(n for n in stored if ".lora_A." in n or ".lora_B." in n)
    if adapters:  # PEFT's layout (`<t>.base_layer.weight`, `<t>.lora_A.default.weight`): not a diffusers model's
        raise ConfigError(
            f"{src}: holds LoRA adapters ({len(adapters)}, e.g. {adapters[0]!r}); writing them as a diffusers model "
            "directory (merged or as a PEFT adapter) is not implemented; train without `lora` to export here"
        )
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(stored):
        nbytes = torch.Size(source.shapes[stored[name]]).numel() * (cast or source.dtypes[stored[name]]).itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    from safetensors.torch import save_file

    partial = atomic.partial_path(out)
    with writing(partial, out):
        partial.mkdir()
        (partial / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(shards):
            file = (
                WEIGHTS_NAME
                if len(shards) == 1
                else f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors = source.read_full([stored[n] for n in names])
            shard = {}
            for n in names:
                t = tensors.pop(stored[n])
                shard[n] = (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous()
                weight_map[n] = file
                total += shard[n].numel() * shard[n].element_size()
            save_file(shard, str(partial / file), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (partial / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2))
        atomic.fsync_dir(partial)
    atomic.commit(partial, out)
    return out
