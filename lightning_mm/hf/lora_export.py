"""Exporting a LoRA-trained model: adapters in PEFT's format, or a Transformers model with the adapters merged.

* :func:`save_lora_adapters` writes ``adapter_config.json`` and ``adapter_model.safetensors`` as
  ``PeftModel.save_pretrained`` does, so ``PeftModel.from_pretrained(base_model, directory)`` loads them.
* :func:`save_merged_model` writes the base model with ``W + scaling * B @ A`` folded into each target (PEFT's
  ``merge_and_unload``), as ``save_pretrained`` does: Transformers alone loads it.
* :func:`merge_lora_state_dict` does the merge for a full state dict and a Hugging Face config; ``lightning-mm
  convert dcp-to-hf --merge-lora`` uses it on a checkpoint's weights (:func:`dcp_to_hf_merged`).

The first two take the (possibly sharded) model and must be called on every rank (DTensors are gathered);
rank 0 writes.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_mm._utils.distributed import is_rank_zero
from lightning_mm._utils.modules import transformers_class
from lightning_mm.checkpoint.checkpoint_errors import CheckpointMismatchError
from lightning_mm.errors import ConfigError
from lightning_mm.hf.checkpoint_records import lora_record  # what checkpoints record of the adapters
from lightning_mm.hf.lora import ADAPTER_NAME

__all__ = [
    "lora_record",
    "save_lora_adapters",
    "save_merged_model",
    "merge_lora_state_dict",
    "dcp_to_hf_merged",
    "checkpoint_lora",
]

_PEFT_PREFIX = "base_model.model."


def _peft_config(model: nn.Module) -> Any:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or ADAPTER_NAME not in configs:
        raise ConfigError(f"{type(model).__name__} has no LoRA adapters (built without a `lora` setting)")
    return configs[ADAPTER_NAME]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _full_state(model: nn.Module, keep: Any = None) -> dict[str, torch.Tensor]:
    """``model``'s state dict as full CPU tensors (a collective over DTensors: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if keep is not None and not keep(name):
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            out[name] = full.detach().to("cpu").clone()
    return out


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _peft_key(name: str) -> str:
    """``x.lora_A.default.weight`` -> ``base_model.model.x.lora_A.weight`` (PeftModel.save_pretrained's keys)."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def save_lora_adapters(model: nn.Module, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write ``model``'s adapters in PEFT's format into ``directory`` (call on every rank; rank 0 writes)."""
    from safetensors.torch import save_file

    config = _peft_config(model)
    adapters = _full_state(model, _is_adapter)
    out = Path(directory)
    if is_rank_zero():
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {_peft_key(k): v.contiguous() for k, v in adapters.items()},
            str(out / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        if base_model_name_or_path is not None:
            config.base_model_name_or_path = base_model_name_or_path
        config.save_pretrained(str(out))
    _barrier()
    return out


def _hf_class(model: nn.Module) -> type:
    """The Transformers class a (possibly adapted) model is an instance of."""
    cls = transformers_class(type(model))
    if cls is None:
        raise ConfigError(f"{type(model).__name__} is not a transformers model")
    return cls


def merge_lora_state_dict(
    state: Mapping[str, torch.Tensor],
    hf_config: Any,
    lora_config: Mapping[str, Any],
    model_class: type,
    directory: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Build ``model_class`` from ``hf_config`` with ``state`` (a LoRA model's keys), merge with PEFT's
    ``merge_and_unload`` and ``save_pretrained`` the result into ``directory`` (cast to ``dtype`` after the
    merge, if given)."""
    from peft import LoraConfig, LoraModel

    peft_config = LoraConfig(**{k: v for k, v in lora_config.items() if k in LoraConfig.__dataclass_fields__})
    peft_config.inference_mode = False
    hf_config = copy.deepcopy(hf_config)  # PEFT may edit it (untying merged embeddings); not the caller's model's
    with torch.device("meta"):
        base = model_class(hf_config)
    wrapped = LoraModel(base, peft_config, ADAPTER_NAME)
    result = wrapped.model.load_state_dict(dict(state), strict=False, assign=True)
    if result.unexpected_keys:
        raise CheckpointMismatchError(
            f"the checkpoint has weights {result.unexpected_keys[:5]} that "
            f"{model_class.__name__} with these adapters lacks"
        )
    left = [n for n, p in wrapped.model.named_parameters() if p.is_meta]
    if left:  # a tied weight stored once
        wrapped.model.tie_weights()
        left = [n for n, p in wrapped.model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointMismatchError(f"the checkpoint has no values for {left[:5]}")
    # The base model, a model_class (PEFT annotates it nn.Module): Transformers' tie_weights / save_pretrained.
    merged: Any = wrapped.merge_and_unload()
    if getattr(hf_config, "tie_word_embeddings", False) or getattr(
        getattr(hf_config, "get_text_config", lambda: None)(), "tie_word_embeddings", False
    ):
        merged.tie_weights()
    if dtype is not None:
        merged = merged.to(dtype)
        merged.config.dtype = dtype
    merged.save_pretrained(str(directory), max_shard_size=max_shard_size)
    return Path(directory)


def save_merged_model(model: nn.Module, directory: str | Path) -> Path:
    """Write ``model`` with its adapters merged as a Transformers directory (every rank calls; rank 0 writes)."""
    record = lora_record(model)
    if record is None:
        raise ConfigError(f"{type(model).__name__} has no LoRA adapters (built without a `lora` setting)")
    state = _full_state(model)
    if is_rank_zero():
        merge_lora_state_dict(state, model.config, record, _hf_class(model), directory)
    _barrier()
    return Path(directory)


def checkpoint_lora(src: str | Path, prefix: str | None = None) -> dict[str, Any] | None:
    """The ``LoraConfig`` a checkpoint recorded for its Hugging Face model, or ``None`` (no adapters, no record)."""
    from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY
    from lightning_mm.checkpoint.source import open_source
    from lightning_mm.hf.checkpoint_records import choose_record

    try:
        record = choose_record((open_source(src).meta.get(EXTRA_KEY) or {}).get("hf") or [], prefix, str(src))
    except ValueError:  # no record: dcp_to_hf reports that itself
        return None
    return record.get("lora") or None


def dcp_to_hf_merged(
    src: str | Path,
    out_dir: str | Path,
    prefix: str | None = None,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
) -> Path:
    """``dcp-to-hf --merge-lora``: a LoRA checkpoint as a Transformers directory with the adapters merged.

    The model's tensors are read straight from the checkpoint under their module keys (``...base_layer.weight``,
    ``...lora_A.default.weight``), merged by PEFT, and written by ``save_pretrained`` (its key layout, shards of
    at most ``max_shard_size`` bytes). The checkpoint's record of the model holds its config and the adapters'
    ``LoraConfig``. The whole model is held in memory once (a merge needs each target's full weight).
    """
    import transformers

    from lightning_mm.checkpoint import atomic
    from lightning_mm.checkpoint.checkpoint_layout import EXTRA_KEY, model_key
    from lightning_mm.checkpoint.consolidate import check_output
    from lightning_mm.checkpoint.source import open_source
    from lightning_mm.hf.checkpoint_records import choose_record

    out = Path(out_dir)
    check_output(out, force, kind="hf")
    casts = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype is not None and dtype not in casts:
        raise ConfigError(f"--dtype must be one of {sorted(casts)}, got {dtype!r}")
    source = open_source(src)
    record = choose_record((source.meta.get(EXTRA_KEY) or {}).get("hf") or [], prefix, str(src))
    if not record.get("lora"):
        raise ConfigError(f"{src}: the checkpoint's model has no LoRA adapters; convert it without --merge-lora")
    start = model_key(record["prefix"])
    keys = [k for k in source.shapes if k.startswith(start)]
    state = {k[len(start) :]: t for k, t in source.read_full(keys).items()}
    config_dict = json.loads(record["config"])
    architecture = record.get("architecture") or (config_dict.get("architectures") or [None])[0]
    model_class = getattr(transformers, str(architecture), None)
    if model_class is None:
        raise ConfigError(f"{src}: unknown Transformers architecture {architecture!r}")
    fields = {k: v for k, v in config_dict.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config_dict["model_type"], **fields)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.partial-") as tmp:
        staged = Path(tmp) / "merged"
        merge_lora_state_dict(
            state,
            hf_config,
            record["lora"],
            model_class,
            staged,
            dtype=casts[dtype] if dtype else None,
            max_shard_size=max_shard_size,
        )
        atomic.commit(staged, out)
    return out
