"""Where a model's default FSDP2 plan comes from, as ``lightning-mm plan`` says it (a registered adapter or a
class derived for an architecture without one, and what the derivation read)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_mm.hf.default_plans import PlanDerivationError, derive_fsdp2_plan
from lightning_mm.hf.derived_adapters import is_derived
from lightning_mm.hf.mixins import FSDP2Mixin
from lightning_mm.hf.mixins import is_hf_model as _is_hf_model

__all__ = ["default_plan_summary"]


def default_plan_summary(
    model: nn.Module, explicit: Sequence[str] = (), ignored: Sequence[str] | None = None
) -> str | None:
    """Where the model's default FSDP2 keys come from, for ``lightning-mm plan`` (``None``: not a Hugging Face
    model with FSDP2Mixin's derived defaults). ``explicit``: the keys the user's YAML sets; ``ignored``: its
    ``ignored_modules`` when it sets them."""
    if not (_is_hf_model(model) and isinstance(model, FSDP2Mixin)):
        return None
    if type(model).default_fsdp2_config is not FSDP2Mixin.default_fsdp2_config:
        return f"  default plan: {type(model).__name__}.default_fsdp2_config() (the class's own)"
    cls = type(model)
    origin = "no ModelHub adapter registered" if is_derived(cls) else f"adapter {cls.__module__}.{cls.__qualname__}"
    keys = ", ".join(k for k in ("sub_modules_to_wrap", "ignored_modules", "moe_modules") if k in explicit)
    try:
        plan = derive_fsdp2_plan(model, ignored=ignored)
    except PlanDerivationError as err:
        return f"  default plan: none ({origin}; the YAML sets {keys or 'nothing'}): {err}"
    text = plan.describe().replace("Transformers metadata", f"Transformers metadata ({origin})", 1)
    if keys:
        text += f"\n    the YAML sets {keys}: those keys are the YAML's, not the derived ones"
    return text
