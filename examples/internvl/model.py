"""Steps 1 and 2 of MindSpeed MM's third-party model recipe, for Transformers' InternVL.

(1) An adapter class: the Transformers model plus ``FSDP2Mixin`` and ``WeightInitMixin``; the model body is not
changed. (2) Its registration in ``ModelHub.MODEL_MAPPINGS``. Step 3 (``TransformersModel(config)`` in
``model_provider``) is in train.py.

lightning-mm already ships an InternVL adapter under the same key; this one replaces it, to show the recipe.
"""

from transformers import InternVLForConditionalGeneration

from lightning_mm.modules import FSDP2Mixin, ModelHub, WeightInitMixin


class InternVLChatModelGeneration(InternVLForConditionalGeneration, FSDP2Mixin, WeightInitMixin):
    """InternVL, FSDP2-ready: sharded by the YAML's paths, initialised by ``init_weights()`` after meta init."""


ModelHub.MODEL_MAPPINGS["internvl"] = InternVLChatModelGeneration  # or @ModelHub.register("internvl", override=True)
