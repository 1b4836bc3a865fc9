"""`lightning-mm plan` prints the plan the strategy applies: one resolution (``MMFSDP2Strategy.plan_for``).

The example configs are compared in tests/test_cli.py, inside their real fits (``tests.helpers.probes.PlanProbe``); here
a plain LightningModule whose config paths are relative to its ``sharding_target()``.
"""

import pytest
import torch

from lightning_mm import MMFSDP2Strategy
from lightning_mm.core.init_context import meta_parameters
from lightning_mm.strategies.precision import MMFSDP2Precision
from tests.helpers.probes import plan_record
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import plan_match_scenarios
from tests.scenarios.plan_match_scenarios import CONFIG, PRECISION, PlainWithTarget


def planned_offline() -> dict:
    """The plan of a fresh module on the meta device, from the strategy's own planning, without processes."""
    strategy = MMFSDP2Strategy(fsdp2_config=CONFIG)
    strategy.precision_plugin = MMFSDP2Precision(PRECISION)
    with meta_parameters():
        module = PlainWithTarget()
    return plan_record(strategy.plan_for(module, 2).plan)


def test_the_plan_of_a_plain_lightning_module_with_a_sharding_target_is_the_plan_its_run_applies(tmp_path):
    run(plan_match_scenarios.plain_target, tmp_path)
    applied = read_results(tmp_path, "plain_target")
    planned = planned_offline()
    assert applied[0] == applied[1] == planned
    # The paths are the target's (the backbone's) and the policy is the Trainer's precision reconciled.
    assert planned["ignored_modules"] == ["embed"]
    assert planned["precision"]["param_dtype"] == str(torch.bfloat16)
    assert [u["modules"] for u in planned["units"]] == [["blocks.0"], ["blocks.1"], ["blocks.2"]]


def test_a_config_on_both_the_strategy_and_the_module_must_agree_in_the_plan_too():
    strategy = MMFSDP2Strategy(fsdp2_config=CONFIG)
    with meta_parameters():
        module = PlainWithTarget()
    module.fsdp2_config = {**CONFIG, "num_to_backward_prefetch": 1}
    with pytest.raises(ValueError, match="give it in one place"):
        strategy.plan_for(module, 2)
