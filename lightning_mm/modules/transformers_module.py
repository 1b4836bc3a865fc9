"""MMTransformersModule: an MMLightningModule whose model is ``TransformersModel(config)``, configured in YAML.

MindSpeed MM's ``pretrain_transformers.py`` builds ``TransformersModel(args.mm.model)`` in its ``model_provider``;
here the same config is a key of the LightningCLI YAML (``lightning-mm migrate`` writes it from a model.json)::

    model:
      class_path: lightning_mm.modules.transformers_module.MMTransformersModule
      init_args:
        transformers_model: {model_id: qwen2_5_vl, init_from_hf_path: /ckpt/Qwen2.5-VL-7B, freeze: [model.visual]}
        lr: 1.0e-5
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from torch import nn
from typing_extensions import override

from lightning_mm.errors import ConfigError
from lightning_mm.hf.transformers_model import TransformersModel, TransformersModelConfig
from lightning_mm.modules.lightning_module import MMLightningModule

__all__ = ["MMTransformersModule"]


class MMTransformersModule(MMLightningModule):
    """``MMLightningModule`` with ``model_provider() = TransformersModel(transformers_model)``.

    Args:
        transformers_model: the TransformersModel config (``model_id``, ``init_from_hf_path``, ``hf_config``,
            ``freeze``, ``lora``, ``trust_remote_code``, ``enable_chunk_loss``, ``chunk_loss_size``); checked when
            the module is constructed.
        **kwargs: the arguments of :class:`MMLightningModule` (``lr``, ``warmup_steps``, ``forward_step``...), except
            ``model_provider``.
    """

    def __init__(self, transformers_model: dict[str, Any], **kwargs: Any) -> None:
        if kwargs.get("model_provider") is not None:
            raise ConfigError(
                "MMTransformersModule builds its model from `transformers_model`; do not also give `model_provider`"
            )
        super().__init__(**kwargs)
        TransformersModelConfig.from_any(deepcopy(transformers_model))  # a bad key fails now, naming it
        self.transformers_model = deepcopy(transformers_model)

    @override
    def model_provider(self) -> nn.Module:
        return TransformersModel(deepcopy(self.transformers_model))
