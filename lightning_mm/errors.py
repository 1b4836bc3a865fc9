"""The error family of lightning-mm: every error raised on purpose for bad input derives from
:class:`LightningMMError`.

An error that subclasses :class:`LightningMMError` tells the user what to fix: the ``lightning-mm`` command prints it
as one line, without a traceback, and exits non-zero (``LIGHTNING_MM_TRACEBACK=1`` or ``--traceback`` shows the
traceback). Each class also subclasses the built-in type that callers catch, so ``except ValueError`` keeps working,
e.g. ``class FSDP2ConfigError(ConfigError)`` (a ``LightningMMError`` and a ``ValueError``).

The family, by concern (modules add their own subclasses of these, e.g.
:class:`~lightning_mm.core.config.FSDP2ConfigError`; checkpoints have theirs in
:mod:`lightning_mm.checkpoint.checkpoint_errors`):

* :class:`ConfigError` (``ValueError``): a setting or argument with a bad value.
* :class:`InputTypeError` (``TypeError``): a setting, argument or batch of the wrong type.
* :class:`InputKeyError` (``KeyError``): a mapping without a key it must have.
* :class:`DataError` (``ValueError``): a record, sample or batch that cannot be used.
* :class:`MissingFileError` (``FileNotFoundError``): a file or directory the run names does not exist.
* :class:`OutputExistsError` (``FileExistsError``): an output that exists and would be overwritten.
* :class:`StateError` (``RuntimeError``): a call made before what it needs exists, or after it is used up.
* :class:`DependencyError` (``ImportError``): a package, module or import path that cannot be imported.

This module imports nothing, so that any layer can use it.
"""

from __future__ import annotations

__all__ = [
    "LightningMMError",
    "ConfigError",
    "InputTypeError",
    "InputKeyError",
    "DataError",
    "MissingFileError",
    "OutputExistsError",
    "StateError",
    "DependencyError",
]


class LightningMMError(Exception):
    """Bad input (config, data, checkpoint, command line): the message names the key, file or line to fix."""


class ConfigError(LightningMMError, ValueError):
    """A run's configuration (YAML, command line, constructor argument) has a bad value or contradicts itself."""


class InputTypeError(LightningMMError, TypeError):
    """A setting, argument, returned value or batch of the wrong type."""


class InputKeyError(LightningMMError, KeyError):
    """A mapping (a batch, a loss, a module's buffers) without a key it must have."""


class DataError(LightningMMError, ValueError):
    """A record, sample or batch that cannot be used (in strict mode, or no usable record at all)."""


class MissingFileError(LightningMMError, FileNotFoundError):
    """A file or directory that the run names does not exist."""


class OutputExistsError(LightningMMError, FileExistsError):
    """An output path exists, and writing there would overwrite it."""


class StateError(LightningMMError, RuntimeError):
    """A call made before what it needs exists (e.g. before ``setup``), or after it was used up."""


class DependencyError(LightningMMError, ImportError):
    """A package, module or import path that the run needs cannot be imported."""
