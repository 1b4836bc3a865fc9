"""The Hugging Face integration: everything that knows Transformers, PEFT or the Hub's file layout.

The model registry (:mod:`~lightning_mm.hf.model_hub`) and its adapters, the FSDP2 mixins, ``TransformersModel``,
default
plans, checkpoint key mapping and sliced loading of safetensors shards, LoRA through PEFT, context-parallel
attention, and conversion between lightning-mm checkpoints and Hugging Face directories. It sits on the core and
the checkpoint I/O, and below the Lightning layer; it does not import Lightning. Users reach it through
:mod:`lightning_mm.modules`.

Importing it (which any import of its modules does first) registers the Hugging Face checkpoint record (``hf``: the
architecture and config of each Transformers model, what ``dcp-to-hf`` reads) and the LoRA record (``lora``: the
adapters' settings, checked when a checkpoint is loaded) with the checkpoint I/O's record providers, and the
checkpoint formats that write Hugging Face weights (``hf``, ``torch_dcp+hf``) with its formats.
"""

from lightning_mm.checkpoint.formats import register_format
from lightning_mm.checkpoint.record_providers import register_record_provider
from lightning_mm.hf.checkpoint_format import DCPWithHFFormat, HFFormat
from lightning_mm.hf.checkpoint_records import hf_records
from lightning_mm.hf.lora import check_resumed_lora, lora_records

register_record_provider("hf", hf_records)
register_record_provider("lora", lora_records, check=check_resumed_lora)  # adapters' settings, checked on resume
register_format(HFFormat())
register_format(DCPWithHFFormat())
