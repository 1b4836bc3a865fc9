"""Qwen3-VL, dense (``Qwen3VLForConditionalGeneration``): MindSpeed MM's main FSDP2 example.

Default plan (derived from the model's metadata, :mod:`lightning_mm.hf.default_plans`): ``model.visual.blocks.{*}``,
the vision tower's input embeddings ``model.visual.patch_embed`` and ``model.visual.pos_embed`` (the learned
position grid that every image's grid is resampled from), the patch merger ``model.visual.merger`` (the projector
into the language model), each DeepStack merger ``model.visual.deepstack_merger_list.{*}``,
``model.language_model.layers.{*}``, the embeddings and ``lm_head``; with the vision tower frozen, ``model.visual``
is ignored instead (its mergers with it).

Each DeepStack merger is a unit of its own, as in MindSpeed MM's Qwen3-VL plans: each runs right after its own
vision block (blocks 8, 16 and 24 of the 8B model), so one unit for all of them would be gathered at the first and
kept unsharded over the blocks in between, in forward and in backward. The patch and position embeddings are two
units: they are siblings (no module holds just the two), and this project groups modules into one unit only where
they share parameters; their two small gathers run back to back, prefetched in execution order.

Checkpoints: Transformers 5 has no key conversion for this class (its ``save_pretrained`` keys are the in-memory
``model.visual.*``, ``model.language_model.*`` and ``lm_head.*``, as on the Hub), so sliced loading reads them by
name.
"""

from transformers import Qwen3VLForConditionalGeneration

from lightning_mm.hf.mixins import FSDP2Mixin, WeightInitMixin

__all__ = ["MMQwen3VLForConditionalGeneration"]


class MMQwen3VLForConditionalGeneration(Qwen3VLForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """``transformers.Qwen3VLForConditionalGeneration``, FSDP2-ready."""

    hub_keys = ("Qwen3VLForConditionalGeneration", "qwen3_vl")
