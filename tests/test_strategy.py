"""In-process checks of the strategy's wiring (no processes are started here)."""

import lightning as L
import pytest

import lightning_mm
from lightning_mm import FSDP2Config, MMFSDP2Strategy
from lightning_mm.core.backend import process_group_backend
from lightning_mm.core.config import FSDP2ConfigError
from lightning_mm.core.sharded_run import sharding_target
from lightning_mm.strategies.precision import MMFSDP2Precision


def test_registered_as_mm_fsdp2():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "mm_fsdp2" in StrategyRegistry
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mm_fsdp2", logger=False)
    assert isinstance(trainer.strategy, MMFSDP2Strategy)


def test_public_api():
    for name in ("MMFSDP2Strategy", "FSDP2Config", "MMLightningModule", "MMDataModule"):
        assert hasattr(lightning_mm, name)
    from lightning_mm.modules import FSDP2Mixin, MultiModalModule, WeightInitMixin  # noqa: F401


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_precision_becomes_the_strategy_plugin(precision):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MMFSDP2Strategy(), precision=precision, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, MMFSDP2Precision) and plugin.precision == precision


def test_fp16_mixed_is_rejected_when_the_plugin_is_attached():
    # (On CPU the Trainer itself turns 16-mixed into bf16-mixed, so the plugin is handed over directly.)
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(ValueError, match="16-mixed"):
        MMFSDP2Strategy(precision_plugin=MixedPrecision("16-mixed", "cuda"))


def test_double_precision_is_refused_with_the_supported_values():
    with pytest.raises(ValueError, match="does not support precision='64-true'; supported: "):
        L.Trainer(accelerator="cpu", devices=1, precision="64-true", strategy=MMFSDP2Strategy(), logger=False)


def test_sharding_size_that_does_not_divide_the_world_fails_before_launch():
    with pytest.raises(FSDP2ConfigError, match="`sharding_size`.*does not divide the world size 2"):
        L.Trainer(accelerator="cpu", devices=2, strategy=MMFSDP2Strategy({"sharding_size": 3}), logger=False)


def test_yaml_errors_surface_when_the_strategy_is_built(tmp_path):
    path = tmp_path / "fsdp2_config.yaml"
    path.write_text("sharding_size: auto\nreshard_after_froward: false\n")
    with pytest.raises(FSDP2ConfigError, match="did you mean `reshard_after_forward`"):
        MMFSDP2Strategy(fsdp2_config=str(path))


def test_config_sources():
    assert MMFSDP2Strategy({"sharding_size": 2}).fsdp2_config == FSDP2Config(sharding_size=2)


@pytest.mark.parametrize(
    ("device", "offload", "backend"),
    [("cpu", False, "gloo"), ("cpu", True, "gloo"), ("cuda:0", False, "nccl"), ("cuda:1", True, "cuda:nccl,cpu:gloo")],
)
def test_process_group_backend(device, offload, backend):
    assert process_group_backend(device, offload) == backend


def test_two_different_configs_are_an_error_not_a_silent_choice():
    from lightning_mm import MMLightningModule

    strategy = MMFSDP2Strategy({"sharding_size": 2})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    trainer.strategy.connect(MMLightningModule(fsdp2_config={"sharding_size": 1}))
    with pytest.raises(ValueError, match="give it in one place"):
        _ = trainer.strategy.fsdp2_config
    trainer.strategy.connect(MMLightningModule(fsdp2_config={"sharding_size": 2}))
    assert trainer.strategy.fsdp2_config.sharding_size == 2


def test_strategy_name_needs_the_package_import_as_the_readme_says():
    # Lightning resolves strategy names when the Trainer is built and has no entry point for them: in a script that
    # only imports Lightning, "mm_fsdp2" is Lightning's invalid-name error; `import lightning_mm` registers it.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import json
import lightning as L
out = {}
try:
    L.Trainer(accelerator="cpu", devices=2, strategy="mm_fsdp2", logger=False)
except ValueError as err:
    out["without"] = str(err)
import lightning_mm
out["with"] = type(L.Trainer(accelerator="cpu", devices=2, strategy="mm_fsdp2", logger=False).strategy).__name__
print(json.dumps(out))
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "invalid strategy name: `strategy='mm_fsdp2'`" in out["without"]
    assert out["with"] == "MMFSDP2Strategy"
    assert "add `import lightning_mm`" in (root / "README.md").read_text()


def test_the_sharding_target_comes_from_the_module_protocol():
    from torch import nn

    from lightning_mm import MMLightningModule

    class Plain(L.LightningModule):
        pass

    class WithTarget(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def sharding_target(self):
            return self.inner

    for module, expected in ((Plain(), None), (WithTarget(), "inner")):
        strategy = MMFSDP2Strategy()
        strategy.connect(module)
        assert sharding_target(strategy.lightning_module) is (module if expected is None else getattr(module, expected))
    strategy = MMFSDP2Strategy()
    mm = MMLightningModule(model_provider=lambda: nn.Linear(2, 2))
    strategy.connect(mm)
    with pytest.raises(RuntimeError, match="did not build a model"):
        sharding_target(strategy.lightning_module)
    mm.configure_model()
    assert sharding_target(strategy.lightning_module) is mm.model


def test_only_an_overridden_fully_shard_replaces_the_plan_units():
    from torch import nn

    from lightning_mm.core.apply import model_unit_sharding
    from lightning_mm.modules import FSDP2Mixin

    class Default(nn.Linear, FSDP2Mixin):
        pass

    class Custom(nn.Linear, FSDP2Mixin):
        def _fully_shard(self, fsdp2_kwargs=None, fsdp2_config=None):
            self.seen = (fsdp2_kwargs, fsdp2_config)

    class NoMixin(nn.Linear):
        def _fully_shard(self, fsdp2_kwargs=None, fsdp2_config=None):
            self.seen = (fsdp2_kwargs, fsdp2_config)

    config = FSDP2Config()
    assert model_unit_sharding(Default(1, 1), config) is None and model_unit_sharding(nn.Linear(1, 1), config) is None
    for model in (Custom(1, 1), NoMixin(1, 1)):
        model_unit_sharding(model, config)({"mesh": None})
        assert model.seen == ({"mesh": None}, config) and model.fsdp2_config is config


def test_the_strategy_names_neither_the_model_side_nor_hugging_face():
    from pathlib import Path

    text = Path(lightning_mm.strategies.fsdp2.__file__).read_text()
    assert "lightning_mm.modules" not in text and "hf_records" not in text and "FSDP2Mixin" not in text
