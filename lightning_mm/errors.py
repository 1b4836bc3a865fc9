"""The common base of lightning-mm's errors for bad input.

An error that subclasses :class:`LightningMMError` (or any exception class defined in a ``lightning_mm`` module)
tells the user what to fix: the ``lightning-mm`` command prints it as one line, without a traceback, and exits
non-zero (``LIGHTNING_MM_TRACEBACK=1`` or ``--traceback`` shows the traceback). Subclass it together with the
built-in type that callers catch, e.g. ``class FSDP2ConfigError(LightningMMError, ValueError)``.

This module imports nothing, so that any layer can use it.
"""

from __future__ import annotations

__all__ = ["LightningMMError", "ConfigError"]


class LightningMMError(Exception):
    """Bad input (config, data, checkpoint, command line): the message names the key, file or line to fix."""


class ConfigError(LightningMMError, ValueError):
    """A run's configuration (YAML, command line) contradicts itself or the checkpoint it names."""
