"""``checkpoint_format="hf"`` and ``"torch_dcp+hf"``: which name each model tensor gets in the Hugging Face
safetensors of a checkpoint, and the side files that make the checkpoint directory a ``from_pretrained`` one.

For a LightningModule holding one Transformers model (``TransformersModel``, an ``MMLightningModule`` whose
``model_provider`` returns a ``PreTrainedModel``), the names are the ones ``save_pretrained`` writes
(:func:`lightning_mm.hf.hf_file_layout.hf_layout`: tied weights once, Transformers' save-time renames applied) and
``config.json`` (with the saved ``dtype``), ``generation_config.json`` and the tokenizer/processor files of the
pretrained directory it was loaded from are written beside them. A module without a Transformers model keeps its
state-dict names (plain safetensors, resumable, not a ``from_pretrained`` directory). Refused with a clear error:
several Transformers models in one module, LoRA adapters (``dcp-to-hf --merge-lora`` exports those), models whose
``save_pretrained`` converts tensors (fused experts), and model tensors outside the Transformers model.

The formats are :class:`HFFormat` (``hf``) and :class:`DCPWithHFFormat` (``torch_dcp+hf``), registered with the
checkpoint I/O's formats (:mod:`lightning_mm.checkpoint.formats`) when :mod:`lightning_mm.hf` is imported. Both are
``torch_dcp`` directories with the weights written beside the DCP files, so the checkpoint I/O's ``torch_dcp``
format reads and recognises them (the safetensors weights through :mod:`lightning_mm.checkpoint.hf_weights`,
which knows no Transformers). The writing itself is :mod:`lightning_mm.checkpoint.hf_weights` (DCP's Hugging Face
storage).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm._utils.suggestions import listing
from lightning_mm.checkpoint import hf_weights
from lightning_mm.checkpoint.checkpoint_layout import KIND_WEIGHTS
from lightning_mm.checkpoint.formats import CheckpointFormat, checkpoint_format
from lightning_mm.checkpoint.writer import save
from lightning_mm.errors import ConfigError
from lightning_mm.hf.checkpoint_records import hf_records
from lightning_mm.hf.hf_file_layout import HFLayout, hf_layout

if TYPE_CHECKING:
    from lightning_mm.checkpoint.source import CheckpointSource

__all__ = ["HF_FORMATS", "DCPWithHFFormat", "HFFormat", "HFWeights", "plan_weights"]

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
    from lightning_mm.hf.dcp_conversion import side_files

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


class _HFWeightsFormat(CheckpointFormat):
    """A ``torch_dcp`` directory with the model weights beside it as Hugging Face safetensors (see the module
    docstring); :attr:`training_state`: with the model and optimiser state in DCP as well."""

    casts_weights: ClassVar[bool] = True
    in_background: ClassVar[bool] = False  # the weights are read from the live model
    training_state: ClassVar[bool]

    def write(
        self,
        checkpoint: dict[str, Any],
        path: Path | str,
        extra: dict[str, Any],
        rng: dict[str, Any] | None,
        *,
        module: Any = None,
        dtype: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        background: Executor | None = None,
        group: Any = None,
        staging: Any = None,
    ) -> Future | None:
        if isinstance(path, str):
            self.refuse_url(path)
        assert isinstance(path, Path)  # refuse_url raised for a URL
        state = checkpoint.get("state_dict") or {}
        weights = plan_weights(module, list(state))
        extra = {**extra, hf_weights.RECORD_KEY: weights.record(dtype)}
        if not self.training_state:
            checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            extra["kind"] = KIND_WEIGHTS
        also_write = weights.writer(state, hf_weights.check_dtype(dtype))
        return save(checkpoint, path, "torch_dcp", extra, rng, also_write, background, group, staging)

    def read(self, path: Path, full_check: bool = False, share: tuple[int, int] | None = None) -> CheckpointSource:
        return checkpoint_format("torch_dcp").read(path, full_check, share)

    def refuse_module(self, module: Any, fqns: Callable[[], Sequence[str]]) -> None:
        plan_weights(module, list(fqns()))


class HFFormat(_HFWeightsFormat):
    """``checkpoint_format="hf"``: the model weights only, as safetensors (a ``from_pretrained`` directory for a
    Transformers model); resumable weights-only."""

    name: ClassVar[str] = "hf"
    training_state: ClassVar[bool] = False


class DCPWithHFFormat(_HFWeightsFormat):
    """``checkpoint_format="torch_dcp+hf"``: the full ``torch_dcp`` training state plus the safetensors weights."""

    name: ClassVar[str] = "torch_dcp+hf"
    training_state: ClassVar[bool] = True
