"""Checkpoint formats behind one small interface (:class:`CheckpointFormat`: write, read, recognise) and their
registry, one class per value of ``MMFSDP2Strategy(checkpoint_format=...)``.

The checkpoint I/O registers its two storage layouts (:class:`~.dcp_format.DCPFormat`, ``torch_dcp``;
:class:`~.torch_format.TorchFormat`, ``torch``); a layer above registers formats that need its knowledge (the
Hugging Face package registers ``hf`` and ``torch_dcp+hf``, :mod:`lightning_mm.hf.checkpoint_format`, when it is
imported, as it registers its checkpoint records). Adding a format is one class in one module plus its
:func:`register_format` call; the strategy and the writer ask the format object, never its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, ClassVar

from lightning_mm.errors import ConfigError

__all__ = ["CheckpointFormat", "register_format", "checkpoint_format", "format_names", "recognise"]


class CheckpointFormat:
    """One checkpoint format: how a checkpoint is written (:meth:`write`), read (:meth:`read`) and recognised on
    disk (:meth:`recognise`), and what the strategy may ask of it (the class attributes)."""

    name: ClassVar[str]
    """The value of ``checkpoint_format`` (also recorded in the checkpoint's meta as ``format``)."""
    full: ClassVar[bool] = False
    """State dicts are gathered on rank 0 (full tensors) rather than kept as each rank's shards."""
    at_urls: ClassVar[bool] = False
    """It can be written to an fsspec URL (``s3://...``)."""
    in_background: ClassVar[bool] = True
    """``async_save`` can write it in the background (its state is staged; nothing reads the live model later)."""
    casts_weights: ClassVar[bool] = False
    """It writes model weights that ``save_ckpt_dtype`` casts."""

    def write(
        self,
        checkpoint: dict[str, Any],
        path: Path | str,
        extra: dict[str, Any],
        rng: dict[str, Any] | None,
        *,
        module: Any = None,
        dtype: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        background: Executor | None = None,
        group: Any = None,
        staging: Any = None,
    ) -> Future | None:
        """Write ``checkpoint`` (Lightning's dict) at ``path`` (a local path, or a URL where :attr:`at_urls`);
        every rank calls this. ``module`` is the LightningModule saved (formats that name its tensors read it),
        ``dtype`` the ``save_ckpt_dtype``; ``background``/``group``/``staging`` as
        :func:`lightning_mm.checkpoint.writer.save` (returns its future)."""
        raise NotImplementedError

    def read(self, path: Path, full_check: bool = False, share: tuple[int, int] | None = None) -> Any:
        """Open the checkpoint at ``path`` (one this format recognises), every byte checked against its manifest:
        a :class:`~lightning_mm.checkpoint.source.CheckpointSource` (see
        :func:`lightning_mm.checkpoint.source.open_source`, which calls this)."""
        raise NotImplementedError

    def recognise(self, path: Path) -> bool:
        """Whether the existing ``path`` is a checkpoint this format reads (a look at its files, nothing trusted)."""
        return False

    def refuse_module(self, module: Any, fqns: Callable[[], Sequence[str]]) -> None:
        """At the setup of a fit: raise the error the first save of ``module`` (its model tensors ``fqns()``)
        would raise, before any step; by default nothing."""

    def refuse_url(self, where: str) -> None:
        """Raise where ``where`` (a URL) cannot take this format."""
        if not self.at_urls:
            raise ConfigError(
                f"{where}: checkpoint_format={self.name!r} cannot be written to a URL; checkpoints at URLs are "
                f"{_names(f.name for f in _REGISTRY.values() if f.at_urls)} directories"
            )


_REGISTRY: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> None:
    """Make ``fmt`` a value of ``checkpoint_format`` (a second registration of the same class is a no-op)."""
    known = _REGISTRY.get(fmt.name)
    if known is not None and type(known) is not type(fmt):
        raise ValueError(f"checkpoint format {fmt.name!r} is already registered ({type(known).__name__})")
    _REGISTRY.setdefault(fmt.name, fmt)


def format_names() -> tuple[str, ...]:
    """The registered formats' names, in registration order."""
    return tuple(_REGISTRY)


def checkpoint_format(name: str) -> CheckpointFormat:
    """The format registered as ``name``; a :class:`~lightning_mm.errors.ConfigError` (a ``ValueError``) naming
    the known ones otherwise."""
    fmt = _REGISTRY.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ConfigError(f"checkpoint_format must be one of {format_names()}, got {name!r}")
    return fmt


def recognise(path: Path) -> CheckpointFormat | None:
    """The first registered format that recognises ``path`` (None: none does)."""
    return next((fmt for fmt in _REGISTRY.values() if fmt.recognise(path)), None)


def _names(names: Any) -> str:
    return " or ".join(repr(n) for n in names)
