"""Messages from libraries that a ``lightning-mm`` run hides because nobody running it can act on them.

Each entry is matched narrowly (message, category and the module that emits it), so that the same warning from
anywhere else, and every other message, still shows. Applied by the training commands in every rank.

* Lightning's advertisement for its ``litlogger`` package, logged at the start of every fit.
* torch 2.13's ``FutureWarning`` that ``LeafSpec`` is deprecated, triggered inside Lightning's own
  ``lightning.pytorch.utilities._pytree`` (Lightning's code, not the user's, has to change).
* Lightning's model summary saying it counts bytes at 32 bits under a mixed precision it does not know.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_library_noise"]

_TIP_PREFIX = "💡 Tip: For seamless cloud logging"
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP_PREFIX)


_FILTER = _DropTips()


def quiet_library_noise() -> None:
    """Install the filters (idempotent)."""
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    warnings.filterwarnings(
        "ignore",
        message=r"Precision .* is not supported by the model summary",
        module=r"lightning\.pytorch\.utilities\.model_summary",
    )
