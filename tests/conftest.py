from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import tiers
from tests.helpers.scenario_kit import read_results, run


def pytest_configure(config: pytest.Config) -> None:
    """The two tiers (``tests/helpers/tiers.py``): tests that start processes are marked ``multiprocess``
    automatically at collection, and a test that starts one unmarked fails."""
    if not config.pluginmanager.has_plugin("lightning_mm_tiers"):
        config.pluginmanager.register(tiers, "lightning_mm_tiers")


@pytest.fixture
def scenario(tmp_path: Path) -> Callable[..., list[dict]]:
    """``scenario(fn, **run_options)``: run the scenario function ``fn`` (a ``@scenario`` of a
    ``tests/scenarios/*_scenarios.py`` script) through ``tests/helpers/scenario_kit.py::run`` in ``tmp_path``; return
    what its ranks wrote (``read_results``)."""

    def _run(fn: Callable[..., None], ranks: int = 2, **options) -> list[dict]:
        run(fn, tmp_path, **options)
        return read_results(tmp_path, fn.scenario_name, ranks)

    return _run
