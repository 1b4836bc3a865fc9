"""``trainer.fit`` again in the same processes after fits that failed once the process group existed (setup, the
first step; on both ranks or on one): every later fit runs, none hangs. See tests/scenarios/refit_scenarios.py."""

from tests.helpers.scenario_kit import read_results, run
from tests.scenarios import refit_scenarios

PEER_LOST = "Connection closed by peer"  # gloo's error on the rank whose peer failed alone


def test_fits_after_failed_fits_in_the_same_processes_run_and_never_hang(tmp_path):
    # A hang (both ranks waiting in the next group's rendezvous or its first collective) fails the test here.
    run(refit_scenarios.fail_then_fit, tmp_path, args={"rounds": 2}, timeout=180)
    for rank, result in enumerate(read_results(tmp_path, "fail_then_fit")):
        fits = result["fits"]
        assert [f["fail"] for f in fits] == [*refit_scenarios.FAILURES, None] * 2 + ["setup", None]
        for fit in fits:
            if fit["fail"] is None:
                assert fit["error"] is None and fit["steps"] == 2, (rank, fit)
            elif fit["fail"] in ("setup", "step", f"step_rank{rank}"):  # failed on this rank: its own error
                assert fit["error"].startswith(f"Failure: {fit['fail'].split('_')[0]} on rank {rank}"), (rank, fit)
            else:  # failed on the other rank only: this one is told by its collective, at once
                assert PEER_LOST in fit["error"], (rank, fit)
        # The failed fits' models were dropped: their groups were freed, nothing to warn about ...
        assert all(not f["held"] for f in fits[:-1]), fits
        # ... but the last failed fit's model is kept: the next fit says so on every rank, and still runs.
        assert len(fits[-1]["held"]) == 1 and "Delete the failed run's model and Trainer" in fits[-1]["held"][0]
