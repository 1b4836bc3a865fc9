"""Every combination a checkpoint save refuses is refused at the strategy's setup, before the first step
(one 2-rank launch of tests/scenarios/setup_refusal_scenarios.py; each fit saves after every step, so a refusal left to
the save would come after one batch)."""

from __future__ import annotations

import pytest

from lightning_mm import MMFSDP2Strategy
from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import setup_refusal_scenarios

EXPECTED = {
    "hf_lora": "checkpoint_format='hf' does not save LoRA adapters; use 'torch_dcp' and export with "
    "`lightning-mm convert dcp-to-hf --merge-lora`",
    "hf_url": "ModelCheckpoint(dirpath='memory://refusals/hf'): checkpoint_format='hf' cannot be written to a URL; "
    "checkpoints at URLs are 'torch_dcp' directories",
    "torch_url": "ModelCheckpoint(dirpath='memory://refusals/pt'): checkpoint_format='torch' cannot be written to a "
    "URL; checkpoints at URLs are 'torch_dcp' directories",
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    work = tmp_path_factory.mktemp("refusals")
    run(setup_refusal_scenarios.refusals, work, timeout=600)
    return read_results(work, "refusals")


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_combination_a_save_refuses_fails_at_setup_before_the_first_step(ranks, case):
    for r in ranks:
        assert r[case] == {"error": EXPECTED[case], "batches": 0}  # one line, on every rank, no step ran
    assert ranks[0]["lora_dir"] == []  # nothing was written


def test_a_url_dirpath_is_checked_only_for_what_it_cannot_take():
    """``torch_dcp`` at a URL passes the setup check (what the S3 tests train with); a local one takes any format."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = MMFSDP2Strategy()
    strategy.checkpoints.refuse_at_urls([ModelCheckpoint(dirpath="memory://ok", save_last=True), object()])
    strategy.checkpoint_format = "torch"
    strategy.checkpoints.refuse_at_urls([ModelCheckpoint(dirpath="/local/dir", save_last="link")])
    # Without a dirpath, Lightning puts the checkpoints under the logger's save_dir or default_root_dir.
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(under 'memory://root'\): checkpoint_format='torch'"):
        strategy.checkpoints.refuse_at_urls([ModelCheckpoint()], "memory://root")
