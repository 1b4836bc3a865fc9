"""One place where the Trainer's ``precision`` and the YAML dtypes become FSDP2's mixed-precision policy.

FSDP2 does mixed precision itself (parameters cast per unit, gradients reduced in ``reduce_dtype``), so the
precision plugin here never autocasts; it converts the module for the ``*-true`` modes and clips gradients
correctly over DTensors. It also stops training on a non-finite loss or gradient norm, on every rank before the
optimizer step (``stop_on_nonfinite``, :mod:`lightning_mm.core.finite`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mm._compat import attached_trainer
from lightning_mm.core import finite
from lightning_mm.core.grad_clip import clip_grads_with_norm_, total_grad_norm
from lightning_mm.core.precision_policy import SUPPORTED_PRECISION, TRUE_DTYPES, check_supported_precision
from lightning_mm.errors import InputTypeError

__all__ = ["MMFSDP2Precision", "SUPPORTED_PRECISION", "as_mm_precision"]

# The plugins Lightning's connector makes from ``Trainer(precision=...)``: replaced by MMFSDP2Precision of the same
# precision, which refuses the ones it does not support by name (``DoublePrecision``, i.e. "64-true", is refused
# there with the list of supported values, rather than as an unknown plugin).
_STOCK_PRECISION = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision", "MMFSDP2Precision")


class MMFSDP2Precision(Precision):
    """Precision plugin for :class:`~lightning_mm.MMFSDP2Strategy`: no autocast, DTensor-aware clipping."""

    def __init__(self, precision: str = "32-true", stop_on_nonfinite: bool = True) -> None:
        check_supported_precision(precision)
        self.precision = precision  # type: ignore[assignment]
        self._true_dtype = TRUE_DTYPES.get(precision)
        # (id(optimizer), norm) of the step under way: this plugin's own cache, computed once per step and read by
        # others only through the public ``grad_norm(optimizer)`` (MMLightningModule's ``train/grad_norm``)
        self._step_norm: tuple[int, torch.Tensor] | None = None
        self.stop_on_nonfinite = stop_on_nonfinite
        """Before each optimizer step: a non-finite loss on any rank (any micro-batch since the last step) or a
        non-finite gradient norm raises :class:`~lightning_mm.core.finite.NonFiniteError` on every rank, before the
        step. Set from ``MMFSDP2Strategy(stop_on_nonfinite=...)``."""
        self._bad_loss: torch.Tensor | None = None  # whether a loss since the last check was not finite (a tensor)
        self.norm_groups: dict[int, tuple[Any, ...]] = {}
        """Set by the strategy after sharding: parameters whose norm terms are summed over further process groups
        (local experts over their EP group; see :func:`~lightning_mm.core.grad_clip.total_grad_norm`)."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(self._true_dtype) if self._true_dtype is not None else module

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        if self._true_dtype is None:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self._true_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        with self.tensor_init_context():
            yield

    def convert_input(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(self._true_dtype) if torch.is_floating_point(t) else t
        )

    def grad_norm(self, optimizer: Optimizer) -> torch.Tensor:
        """The global gradient norm of ``optimizer``'s parameters in the optimizer step under way, before clipping.

        Computed once per step: ``MMLightningModule`` logs it (``train/grad_norm``, from ``on_before_optimizer_step``,
        which Lightning calls just before clipping) and norm clipping then reuses it instead of reducing again.
        """
        if self._step_norm is None or self._step_norm[0] != id(optimizer):
            self._step_norm = (id(optimizer), total_grad_norm(_params(optimizer), sum_over=self.norm_groups))
        return self._step_norm[1]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        norm = self.grad_norm(optimizer)
        self._step_norm = None  # the gradients change now
        clip_grads_with_norm_(_params(optimizer), float(clip_val), norm)

    @override
    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.stop_on_nonfinite:  # noted without a host synchronisation; checked before the optimizer step
            bad = finite.nonfinite(tensor)
            self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad.to(self._bad_loss.device)
        return super().post_backward(tensor, module)

    @override
    # Lightning's own Precision.optimizer_step adds `model` and `closure` to Fabric's signature (ignoring the same)
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        self._step_norm = None  # a norm from before this step's backward is stale
        if self.stop_on_nonfinite:
            inner = closure

            def closure() -> Any:  # backward, then the check: before the step's hooks, clipping and the step
                result = inner()
                self._check_finite(optimizer, model)
                return result

        try:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        finally:
            self._step_norm = None

    def _check_finite(self, optimizer: Any, model: Any) -> None:
        """Agree over all ranks on the losses' and the gradient norm's finiteness; raise on every rank or none.

        The per-rank loss flags ride in the gradient norm's all-reduce, and the norm is kept for this step's
        ``train/grad_norm`` and clipping: one norm computation per step, as without the check.
        """
        bad_loss, self._bad_loss = self._bad_loss, None
        params = _params(optimizer)
        device = next(
            (p.grad.device for p in params if p.grad is not None),
            bad_loss.device if bad_loss is not None else torch.device("cpu"),
        )
        flags = finite.rank_flags(bad_loss, device)
        norm = total_grad_norm(params, sum_over=self.norm_groups, also_reduce=flags)
        self._step_norm = (id(optimizer), norm)
        trainer = attached_trainer(model)
        finite.check_step(
            flags,
            norm,
            trainer.global_step if trainer is not None else None,
            "MMFSDP2Strategy(stop_on_nonfinite=False)",
        )


def as_mm_precision(plugin: Precision | None) -> MMFSDP2Precision | None:
    """The plugin ``MMFSDP2Strategy`` uses for ``plugin``: an :class:`MMFSDP2Precision` as it is, one of the same
    precision for Lightning's stock plugins (what ``Trainer(precision=...)`` makes), a ``TypeError`` for any other."""
    if plugin is None or isinstance(plugin, MMFSDP2Precision):
        return plugin
    if type(plugin).__name__ not in _STOCK_PRECISION:
        raise InputTypeError(
            f"MMFSDP2Strategy handles precision itself and cannot use {type(plugin).__name__}; pass "
            "Trainer(precision=...) or MMFSDP2Precision"
        )
    return MMFSDP2Precision(str(plugin.precision))


def _params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
