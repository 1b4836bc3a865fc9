"""Expert parallelism: the public face of :mod:`lightning_mm.core.expert_parallel` (kept where docs/parallelism.md names it)."""

from lightning_mm.core.expert_parallel import *  # noqa: F403
from lightning_mm.core.expert_parallel import __all__  # noqa: F401
