"""MindSpeed MM's model mixins: ``MultiModalModule``, ``FSDP2Mixin`` and ``WeightInitMixin``.

A MindSpeed MM model is declared ``class CustomModel(MultiModalModule, FSDP2Mixin, WeightInitMixin)`` and needs
no other change to be sharded by :class:`~lightning_mm.MMFSDP2Strategy` and initialised after meta-device
construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lightning_mm._compat import clear_hf_init_flags, share_experts_kernels_with_base
from lightning_mm._utils.distributed import local_tensor
from lightning_mm.core.norms import is_norm
from lightning_mm.core.torch_init import init_module_like_constructor, zero_row
from lightning_mm.errors import StateError
from lightning_mm.hf.pending_weights import pending_lora, pending_pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MultiModalModule", "FSDP2Mixin", "WeightInitMixin", "is_hf_model"]


class MultiModalModule(nn.Module):
    """Base class of MindSpeed MM models: an ``nn.Module`` that keeps the ``config`` it was built from."""

    def __init__(self, config: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = config


class FSDP2Mixin:
    """Gives a model a default sharding plan and MindSpeed MM's ``_fully_shard`` escape hatch.

    * ``default_fsdp2_config()`` returns YAML keys (``sub_modules_to_wrap``, ``recompute_modules``, ...) that the
      strategy uses where the user's YAML leaves them empty.
    * Overriding ``_fully_shard(fsdp2_kwargs, fsdp2_config)`` takes the wrapping of sub-modules over; the strategy
      still builds the mesh and the ``fully_shard`` kwargs, applies recomputation, and shards the root afterwards.
      ``self.fsdp2_config`` is set before the call, as in MindSpeed MM.
    """

    fsdp2_config: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        share_experts_kernels_with_base(cls)  # an adapter runs the experts kernels its Transformers base runs

    def default_fsdp2_config(self, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """YAML defaults for this model; the user's YAML wins for every key it sets.

        Empty for a custom model (the user's YAML decides). A Hugging Face model gets a plan built from its own
        metadata (:func:`lightning_mm.hf.default_plans.derive_fsdp2_plan`): each decoder layer and vision
        block is a unit, input and output embeddings are units (grouped when tied), and a frozen vision tower is
        ignored. ``explicit`` holds the keys the user's YAML sets (see ``FSDP2Config.with_model_defaults``): the
        default units leave out the modules it ignores, and a frozen tower its ``sub_modules_to_wrap`` shards is not
        ignored by default. A model whose metadata does not decide a plan raises
        :class:`~lightning_mm.hf.default_plans.PlanDerivationError` (naming the keys to set) unless the YAML sets
        ``sub_modules_to_wrap``.
        """
        if is_hf_model(self):
            from lightning_mm.hf.default_plans import PlanDerivationError, derive_fsdp2_plan, moe_module_paths

            explicit = explicit or {}
            try:
                plan = derive_fsdp2_plan(
                    self,  # type: ignore[arg-type]
                    ignored=explicit.get("ignored_modules"),
                    wrapped=explicit.get("sub_modules_to_wrap") or (),
                )
            except PlanDerivationError:
                if "sub_modules_to_wrap" in explicit:  # the YAML names the units; the experts are still found
                    experts = moe_module_paths(self)  # type: ignore[arg-type]
                    return {"moe_modules": experts} if experts else {}
                raise
            return plan.fsdp2_defaults()
        return {}

    def expert_parallel_forward(self, path: str, module: nn.Module, ep: Any) -> Any:
        """Hook: the forward of MoE module ``path`` under expert parallelism, or ``None`` for the default.

        The default (:func:`lightning_mm.core.expert_parallel.routed_forward`) serves expert modules with
        Transformers 5's call shape ``experts(hidden_states, top_k_index, top_k_weights)`` and fused weights whose
        first dimension is the experts (already cut to this rank's ``ep.experts_per_rank`` when this is called).
        ``ep`` (:class:`~lightning_mm.core.expert_parallel.ExpertGroup`) holds the EP process group, this
        rank's place in it and the experts count; a model with another call shape returns its own forward here
        (typically wrapping ``routed_forward(module, local_forward, ep)``).
        """
        return None

    def load_after_sharding(self) -> None:
        """Hook: called by :class:`~lightning_mm.MMFSDP2Strategy` right after the model is sharded and its
        parameters are materialised and initialised (``init_weights``), before prefetching is set up and before
        the first step.

        Each parameter is then a DTensor holding only this rank's shard (or a plain tensor for ignored modules),
        so this is where a model reads just its own slices of pretrained weights. The default loads what
        :func:`~lightning_mm.modules.TransformersModel` deferred when it was built on the meta device, then the
        values of LoRA adapters added on the meta device (:func:`~lightning_mm.hf.lora.apply_lora`), and does
        nothing otherwise. Overrides should call ``super().load_after_sharding()``.
        """
        pending = pending_pretrained(self)  # lightning_mm.hf.pending_weights: what was deferred, kept beside the model
        if pending is not None:
            pending.load_after_sharding(self)
        adapters = pending_lora(self)  # lightning_mm.hf.lora: the adapters' values
        if adapters is not None:
            adapters.load_after_sharding(self)

    def _fully_shard(self, fsdp2_kwargs: dict[str, Any] | None = None, fsdp2_config: Any = None) -> None:
        """Shard the sub-modules named by ``fsdp2_config.sub_modules_to_wrap`` (what the strategy does itself).

        Custom implementations may call this through ``super()`` and add to it.
        """
        from torch.distributed.fsdp import fully_shard

        from lightning_mm.core.sharding_plan import build_plan

        assert isinstance(self, nn.Module) and fsdp2_kwargs is not None and fsdp2_config is not None
        plan = build_plan(fsdp2_config, self, fsdp2_kwargs["mesh"].size())
        for unit in plan.units:
            modules = [self.get_submodule(path) for path in unit.modules]
            fully_shard(modules if len(modules) > 1 else modules[0], **fsdp2_kwargs)

    # A duck-typed mark of this default, which does what the strategy does itself: the strategy calls only an
    # override (``lightning_mm.core.apply.model_unit_sharding`` reads it; an override's function has none).
    _fully_shard.shards_plan_units = True  # type: ignore[attr-defined]


class WeightInitMixin:
    """``init_weights()``: what fills a model's parameters after meta-device materialisation.

    A Hugging Face model is initialised by its own ``_init_weights`` rules, dispatched per sub-model as
    ``from_pretrained`` does (Transformers' public ``initialize_weights()``; composite models such as InternVL have
    one per tower); its tied weights are tied if they are not already. A model whose pretrained weights will be
    loaded after sharding (see ``FSDP2Mixin.load_after_sharding``; recorded in :mod:`lightning_mm.hf.pending_weights`,
    not on the model) skips the random init and is zero-filled instead, which is cheaper. Another model that
    defines its own ``_init_weights(module)`` (MindSpeed MM's convention) has it called on every module.
    Otherwise: Linear, Conv and Embedding weights ~ N(0, std) (``config.initializer_range`` or 0.02), biases zero,
    norm weights one, and any other module is initialised as its constructor does (``reset_parameters()``, or
    torch's ``_reset_parameters()`` for ``nn.MultiheadAttention``).

    The mixin's ``init_weights`` takes precedence over a base class's (``class X(LlamaForCausalLM, FSDP2Mixin,
    WeightInitMixin)`` as MindSpeed MM writes it): Hugging Face's own version skips every module it initialised at
    construction, which after meta-device materialisation would leave them empty.
    """

    init_std: float = 0.02

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        owner = next((k for k in cls.__mro__ if "init_weights" in vars(k)), None)
        if owner is not None and not issubclass(owner, WeightInitMixin):
            cls.init_weights = WeightInitMixin.init_weights  # type: ignore[method-assign]

    def _init_std(self) -> float:
        config = getattr(self, "config", None)
        return float(getattr(config, "initializer_range", None) or self.init_std)

    @torch.no_grad()
    def init_weights(self) -> None:
        assert isinstance(self, nn.Module)
        if pending_pretrained(self) is not None:
            for tensor in self.parameters():
                local_tensor(tensor).zero_()  # overwritten by load_after_sharding(); no point drawing random numbers
            _tie_hf_weights(self)
            return
        if is_hf_model(self):
            clear_hf_init_flags(self)
            cast("PreTrainedModel", self).initialize_weights()  # is_hf_model: a Transformers PreTrainedModel
            for module in self.modules():  # Hugging Face zeroes them through an index, a copy for a DTensor
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    zero_row(module.weight, module.padding_idx)
            _tie_hf_weights(self)
            return
        hf_init = getattr(self, "_init_weights", None)
        std = self._init_std()
        for module in self.modules():
            if callable(hf_init):
                hf_init(module)
            else:
                init_module(module, std)


def is_hf_model(module: Any) -> bool:
    """Whether ``module`` is a Transformers ``PreTrainedModel`` (checked without importing Transformers for a module
    that has no ``initialize_weights``)."""
    if not isinstance(module, nn.Module) or not hasattr(module, "initialize_weights"):
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _tie_hf_weights(model: nn.Module) -> None:
    """Tie what the Hugging Face model declares tied (``all_tied_weights_keys``), unless it already is."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    untied = [
        (target, source)
        for target, source in tied.items()
        if model.get_parameter(target) is not model.get_parameter(source)
    ]
    if not untied:
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise StateError(
            f"{type(model).__name__}: tied weights {untied} are not tied after sharding; tie them before "
            "sharding (they must share one parameter object)"
        )
    model.tie_weights(recompute_mapping=False)  # type: ignore[operator]


@torch.no_grad()
def init_module(module: nn.Module, std: float = 0.02) -> None:
    """Initialise the parameters ``module`` owns directly (not those of its children)."""
    if isinstance(
        module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
    ):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            zero_row(module.weight, module.padding_idx)
    elif is_norm(module, by_name=False):  # torch's; a model's own norms: as their constructor does
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if weight is not None:
            nn.init.ones_(weight)
        if bias is not None:
            nn.init.zeros_(bias)
    else:  # e.g. nn.MultiheadAttention's in_proj_weight (torch's `_reset_parameters()`), PReLU, RNNs
        init_module_like_constructor(module)
