"""What ``save_pretrained`` would write for a model: its file keys, tied weights and side files (no tensor data).

The model is built on the meta device from its config, and Transformers' own save-time steps run on its
state dict of meta tensors: tied weights are stored once (``remove_tied_weights_from_state_dict``) and the
in-memory names are renamed back to the saved layout (``revert_weight_conversion``: e.g. LLaVA's
``model.language_model.*`` is saved as ``language_model.model.*``). Each key of the result is traced back to the
in-memory names it holds, so that the converter streams each tensor from the checkpoint under its file key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_mm._utils.modules import names_by_tensor
from lightning_mm.errors import ConfigError

__all__ = ["HFLayout", "hf_layout"]


@dataclass
class HFLayout:
    """The saved layout of one Hugging Face model."""

    keys: dict[str, list[str]]
    """File key -> the in-memory names (module state-dict keys) of that tensor; several for tied weights."""
    config: Any
    """The ``PretrainedConfig`` (``architectures`` set), written as ``config.json``."""
    generation_config: Any
    """The ``GenerationConfig`` that ``save_pretrained`` writes for a generative model, else ``None``."""
    model: Any = None
    """The model on the meta device, kept when saving converts tensors (``converted``)."""
    converted: bool = False
    """``save_pretrained`` converts tensors of this model (e.g. splits fused experts); ``keys`` is then empty and
    the tensors go through :meth:`revert`."""

    def in_memory_names(self) -> list[str]:
        """Every in-memory name the checkpoint must hold (a converted model's full state-dict keys)."""
        if self.converted:
            return list(self.model.state_dict().keys())
        return [n for names in self.keys.values() for n in names]

    def revert(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors ``save_pretrained`` writes for the in-memory ``state`` (full tensors): tied weights once,
        conversions undone (Transformers' own save-time steps)."""
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return revert_weight_conversion(self.model, remove_tied_weights_from_state_dict(dict(state), self.model))

    def save_side_files(self, directory: Path, dtype: torch.dtype | None) -> None:
        """``config.json`` (with the weights' ``dtype``, as ``save_pretrained`` records it) and
        ``generation_config.json`` (when the model has one)."""
        if dtype is not None:
            self.config.dtype = str(dtype).removeprefix("torch.")
        self.config.save_pretrained(directory)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(directory)


def _model_class(config: dict[str, Any], where: str) -> type:
    import transformers

    architecture = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return cls
    from lightning_mm.hf.model_hub import ModelHub, ModelHubError

    try:
        return ModelHub.resolve(None, config)[1]
    except ModelHubError as err:
        raise ConfigError(f"{where}: cannot build the Hugging Face model of this config ({err})") from None


def hf_layout(config: dict[str, Any], where: str) -> HFLayout:
    """The layout ``save_pretrained`` writes for the model ``config`` (a ``config.json`` dict) describes."""
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if not isinstance(config, dict):
        raise ConfigError(f"{where}: the model config must be a JSON object, got {type(config).__name__}")
    if not config.get("model_type") or not isinstance(config["model_type"], str):
        raise ConfigError(f"{where}: the model config has no 'model_type' string")
    cls = _model_class(config, where)
    fields = {k: v for k, v in json.loads(json.dumps(config)).items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        with torch.device("meta"):
            model = cls(hf_config)
    except Exception as err:  # Transformers validates fields in its own ways (e.g. huggingface_hub's strict fields)
        message = " ".join(str(err).split())
        raise ConfigError(
            f"{where}: cannot build {cls.__name__} from this config ({type(err).__name__}: "
            f"{message[:300]}); check its fields' types"
        ) from err
    hf_config.architectures = list(config.get("architectures") or [cls.__name__])
    state = model.state_dict(keep_vars=True)  # tied names share one Parameter object
    names = names_by_tensor(state.items())
    saved = revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(state), model))
    keys: dict[str, list[str]] = {}
    generation = model.generation_config if model.can_generate() else None
    for key, tensor in saved.items():
        if id(tensor) not in names:  # a conversion (fusing or splitting weights): tensors must be converted
            return HFLayout({}, hf_config, generation, model=model, converted=True)
        keys[key] = names[id(tensor)]
    return HFLayout(keys, hf_config, generation)
