"""``checkpoint_format="hf"`` and ``"torch_dcp+hf"``: which name each model tensor gets in the Hugging Face
safetensors of a checkpoint, and the side files that make the checkpoint directory a ``from_pretrained`` one.

For a LightningModule holding one Transformers model (``TransformersModel``, an ``MMLightningModule`` whose
``model_provider`` returns a ``PreTrainedModel``), the names are the ones ``save_pretrained`` writes
(:func:`lightning_mm.hf.export.hf_layout`: tied weights once, Transformers' save-time renames applied) and
``config.json`` (with the saved ``dtype``), ``generation_config.json`` and the tokenizer/processor files of the
pretrained directory it was loaded from are written beside them. A module without a Transformers model keeps its
state-dict names (plain safetensors, resumable, not a ``from_pretrained`` directory). Refused with a clear error:
several Transformers models in one module, LoRA adapters (``dcp-to-hf --merge-lora`` exports those), models whose
``save_pretrained`` converts tensors (fused experts), and model tensors outside the Transformers model.

The writing itself is :mod:`lightning_mm.checkpoint.hf_weights` (DCP's Hugging Face storage).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm._names import listing
from lightning_mm.checkpoint import hf_weights
from lightning_mm.errors import ConfigError
from lightning_mm.hf.export import HFLayout, hf_layout
from lightning_mm.hf.records import hf_records

__all__ = ["HF_FORMATS", "HFWeights", "plan_weights"]

HF_FORMATS = ("hf", "torch_dcp+hf")


@dataclass
class HFWeights:
    """The safetensors name of each model tensor of a checkpoint, and what goes beside them."""

    keys: dict[str, str]
    """Model state-dict key (FQN in the LightningModule) -> safetensors name."""
    layout: HFLayout | None = None
    pretrained: str | None = None

    def record(self, dtype: str | None) -> dict[str, Any]:
        """What the checkpoint's meta records (:data:`lightning_mm.checkpoint.hf_weights.RECORD_KEY`)."""
        return {"keys": dict(self.keys), "dtype": dtype}

    def writer(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> Callable[[Path], list[Path]]:
        """The ``also_write`` step of :func:`lightning_mm.checkpoint.writer.save` (every rank calls it)."""

        def write(directory: Path) -> list[Path]:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            files = hf_weights.write(state, directory, self.keys, dtype, distributed)
            if (not distributed or dist.get_rank() == 0) and self.layout is not None:
                saved = dtype or next((t.dtype for t in state.values() if t.is_floating_point()), None)
                self.layout.save_side_files(directory, saved)
                files += [
                    directory / "config.json",
                    *([directory / "generation_config.json"] if self.layout.generation_config is not None else []),
                ]
                files += _copy_side_files(self.pretrained, directory)
            return files

        return write


def _copy_side_files(pretrained: str | None, directory: Path) -> list[Path]:
    """The tokenizer and processor files of the pretrained directory (top-level ones), copied beside the weights."""
    from lightning_mm.hf.convert import side_files

    if pretrained is None or not Path(pretrained).is_dir():
        return []
    copied = []
    for relative in side_files(Path(pretrained)):
        if len(relative.parts) == 1 and relative.name != "generation_config.json":
            shutil.copyfile(Path(pretrained) / relative, directory / relative)
            copied.append(directory / relative)
    return copied


def plan_weights(root: nn.Module, fqns: Sequence[str]) -> HFWeights:
    """The safetensors names of the model tensors ``fqns`` of ``root`` (see the module docstring)."""
    records = hf_records(root)
    if not records:
        return HFWeights({fqn: fqn for fqn in fqns})
    if len(records) > 1:
        raise ConfigError(
            "checkpoint_format='hf' saves one Transformers model; this module holds "
            f"{len(records)} ({', '.join(r['architecture'] for r in records)})"
        )
    record = records[0]
    if "lora" in record:
        raise ConfigError(
            "checkpoint_format='hf' does not save LoRA adapters; use 'torch_dcp' and export with "
            "`lightning-mm convert dcp-to-hf --merge-lora`"
        )
    layout = hf_layout(json.loads(record["config"]), f"the {record['architecture']} model")
    if layout.converted:
        raise ConfigError(
            f"checkpoint_format='hf': save_pretrained converts the tensors of {record['architecture']} "
            "(e.g. fused experts); use 'torch_dcp' and export with `lightning-mm convert dcp-to-hf`"
        )
    prefix = record["prefix"]
    name_of = {f"{prefix}{name}": key for key, names in layout.keys.items() for name in names}
    outside = [fqn for fqn in fqns if fqn not in name_of]
    if outside:
        raise ConfigError(
            f"checkpoint_format='hf': {len(outside)} model tensor(s) are outside the "
            f"{record['architecture']} model (prefix {prefix!r}) and have no Hugging Face name: "
            f"{listing(outside, 10)}; use 'torch_dcp'"
        )
    keys: dict[str, str] = {}
    taken: set[str] = set()
    for fqn in fqns:
        if name_of[fqn] not in taken:  # tied weights: stored once, under save_pretrained's name
            keys[fqn] = name_of[fqn]
            taken.add(name_of[fqn])
    absent = sorted(set(layout.keys) - taken)
    if absent:
        raise ConfigError(
            f"checkpoint_format='hf': the model state lacks {len(absent)} tensor(s) that save_pretrained "
            f"writes: {listing(absent, 10)}"
        )
    return HFWeights(keys, layout, record.get("pretrained"))
