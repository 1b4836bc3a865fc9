"""Checkpoints of :class:`~lightning_mm.MMFSDP2Strategy` (MindSpeed MM's ``--ckpt-format torch_dcp``).

* :mod:`.layout` (deciding): how Lightning's checkpoint dict splits into DCP tensors and a meta tree, key checks.
* :mod:`.store` (doing): the entry point, strict/non-strict load of ``torch_dcp`` directories and ``torch`` files,
  re-exporting the pieces it is made of: :mod:`.writer` (atomic save), :mod:`.source` (opening and reading a
  checkpoint), :mod:`.state` (taking model and optimiser state), :mod:`.regroup` (optimiser groups and LR schedulers
  regrouped on load), :mod:`.rank_agreement` (the collectives by which the ranks agree).
* :mod:`.safe`: loading without running pickled code; :mod:`.atomic`: temporary sibling, rename into place.
* :mod:`.manifest`: ``manifest.json`` binds every file to its checkpoint (:mod:`.zip_manifest`: the same for a
  ``torch`` file, inside it; :mod:`.digest`: the hashes, every byte checked on load); :mod:`.errors`: the exceptions.
* :mod:`.remote`: ``torch_dcp`` checkpoints at fsspec URLs (staging prefix, committed by the manifest last);
  :mod:`.hf_weights`: model weights as Hugging Face safetensors inside a checkpoint (DCP's HF storage).
* :mod:`.formats`: the formats behind one interface (write, read, recognise) and their registry; the storage
  layouts registered here are :mod:`.dcp_format` (``torch_dcp``) and :mod:`.torch_format` (``torch``).
* :mod:`.rng`: per-rank RNG states; :mod:`.records`: what other layers add to a checkpoint (a registry of record
  providers; the Hugging Face one, :func:`lightning_mm.hf.checkpoint_records.hf_records`, is registered by
  ``lightning_mm.hf`` on import); :mod:`.consolidate`: ``dcp-to-torch``. Conversion to and from Hugging Face
  directories is in :mod:`lightning_mm.hf.dcp_conversion`.
"""

from lightning_mm.checkpoint import remote
from lightning_mm.checkpoint.atomic import remove
from lightning_mm.checkpoint.checkpoint_errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from lightning_mm.checkpoint.checkpoint_layout import (
    EXTRA_KEY,
    FORMAT_VERSION,
    KIND_TRAINING,
    KIND_WEIGHTS,
    META_FILE,
    CheckpointKeyError,
)
from lightning_mm.checkpoint.dcp_format import DCPFormat
from lightning_mm.checkpoint.formats import CheckpointFormat, checkpoint_format, format_names, register_format
from lightning_mm.checkpoint.manifest import MANIFEST_FILE
from lightning_mm.checkpoint.record_providers import collect_records, register_record_provider
from lightning_mm.checkpoint.rng import capture_rng, restore_rng
from lightning_mm.checkpoint.safe import UnsafeCheckpointError
from lightning_mm.checkpoint.source import CheckpointSource, open_source
from lightning_mm.checkpoint.state import OPTIMIZER_NAMES_KEY, model_state, optimizer_param_names, optimizer_state
from lightning_mm.checkpoint.store import Loaded, load
from lightning_mm.checkpoint.torch_format import TorchFormat
from lightning_mm.checkpoint.writer import FORMATS, save
from lightning_mm.core.grad_mode import outside_inference_mode

register_format(DCPFormat())  # the storage layouts, in this order: a directory is read as torch_dcp
register_format(TorchFormat())

__all__ = [
    "EXTRA_KEY",
    "FORMAT_VERSION",
    "FORMATS",
    "KIND_TRAINING",
    "KIND_WEIGHTS",
    "MANIFEST_FILE",
    "META_FILE",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointIntegrityError",
    "CheckpointKeyError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CheckpointSource",
    "Loaded",
    "UnsafeCheckpointError",
    "capture_rng",
    "checkpoint_format",
    "collect_records",
    "format_names",
    "load",
    "model_state",
    "open_source",
    "OPTIMIZER_NAMES_KEY",
    "optimizer_param_names",
    "optimizer_state",
    "outside_inference_mode",
    "register_format",
    "register_record_provider",
    "remote",
    "remove",
    "restore_rng",
    "save",
]
