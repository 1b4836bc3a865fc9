"""The FSDP2 strategy: config (deciding) and application (doing) kept apart."""

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError
from lightning_mm.core.sharding_plan import ShardingPlan, build_plan
from lightning_mm.strategies.fsdp2 import MMFSDP2Strategy
from lightning_mm.strategies.precision import MMFSDP2Precision

__all__ = ["FSDP2Config", "FSDP2ConfigError", "MMFSDP2Strategy", "MMFSDP2Precision", "ShardingPlan", "build_plan"]
