"""The mixed-precision policy of a run: the Trainer's ``precision`` reconciled with the YAML dtypes.

Pure config logic (no Lightning): :func:`resolve_precision_policy` is what both the strategy and
``lightning-mm plan`` call; the result is the :class:`PrecisionPolicy` the plan carries and
:mod:`lightning_mm.core.apply` turns into FSDP2's ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.errors import ConfigError

__all__ = [
    "PrecisionPolicy",
    "SUPPORTED_PRECISION",
    "TRUE_DTYPES",
    "check_supported_precision",
    "resolve_precision_policy",
]

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-true")
"""The Trainer ``precision`` values MMFSDP2Strategy supports."""

TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
"""The ``*-true`` precisions: the module itself is converted to this dtype."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes FSDP2 uses, already reconciled with the Trainer's ``precision`` (the YAML keys' names)."""

    param_dtype: torch.dtype | None = None
    """``param_dtype``: the dtype FSDP2 gathers parameters in for compute (``None``: the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """``reduce_dtype``: the dtype gradients are reduced in (``None``: ``param_dtype``)."""
    output_dtype: torch.dtype | None = None
    """``output_dtype``: the dtype each unit's floating outputs are cast to (``None``: no cast)."""
    cast_forward_inputs: bool = True
    """``cast_forward_inputs``: cast each unit's floating inputs to ``param_dtype``."""

    @classmethod
    def from_config(cls, config: FSDP2Config) -> PrecisionPolicy:
        """The YAML dtypes as they are (no Trainer precision to reconcile with)."""
        return cls(config.param_dtype, config.reduce_dtype, config.output_dtype, config.cast_forward_inputs)


# Lightning's short precision names and their full ones.
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed", "None": "32-true"}


def check_supported_precision(precision: str) -> str:
    """The full name of a supported Trainer ``precision`` (``"bf16"`` -> ``"bf16-mixed"``), or a ValueError."""
    precision = _PRECISION_ALIASES.get(str(precision), str(precision))
    if precision == "16-mixed":
        raise ConfigError(
            "MMFSDP2Strategy does not support precision='16-mixed': fp16 autocast needs a sharded gradient scaler, "
            "which this strategy does not provide. Use precision='bf16-mixed' (bf16 parameters, fp32 reduction), "
            "or set `param_dtype: fp16` in the FSDP2 YAML if you handle loss scaling yourself."
        )
    if precision not in SUPPORTED_PRECISION:
        raise ConfigError(
            f"MMFSDP2Strategy does not support precision={precision!r}; supported: {', '.join(SUPPORTED_PRECISION)}"
        )
    return precision


def resolve_precision_policy(config: FSDP2Config, precision: str = "32-true") -> PrecisionPolicy:
    """Reconcile the Trainer ``precision`` with the YAML dtypes; explicit YAML dtypes win, contradictions fail.

    ``bf16-mixed`` with no dtypes in the YAML means bf16 parameters and fp32 gradient reduction. A ``bf16-*`` or
    ``16-*`` precision next to a different ``param_dtype`` in the YAML is a contradiction and an error.
    """
    precision = check_supported_precision(precision)
    param, reduce = config.param_dtype, config.reduce_dtype
    wanted = {"bf16-mixed": torch.bfloat16, **TRUE_DTYPES}.get(precision)
    if wanted is not None and param is not None and param != wanted:
        where = f" in {config.source}" if config.source else ""
        raise FSDP2ConfigError(
            f"FSDP2 config key `param_dtype`{where} is {str(param).removeprefix('torch.')}, which contradicts "
            f"Trainer(precision={precision!r}); remove one of them or make them agree"
        )
    if precision == "bf16-mixed" and param is None:
        param = torch.bfloat16
        reduce = reduce if reduce is not None else torch.float32
    return PrecisionPolicy(param, reduce, config.output_dtype, config.cast_forward_inputs)
