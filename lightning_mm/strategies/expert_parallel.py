"""Expert parallelism: the public face of :mod:`lightning_mm.core.expert_parallel` (named in docs/parallelism.md)."""

from lightning_mm.core.expert_parallel import *  # noqa: F403
from lightning_mm.core.expert_parallel import __all__  # noqa: F401
