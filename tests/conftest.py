from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.scenario_kit import read_results, run


@pytest.fixture
def scenario(tmp_path: Path) -> Callable[..., list[dict]]:
    """``scenario(fn, **run_options)``: run the scenario function ``fn`` (a ``@scenario`` of a
    ``tests/scenarios/*_scenarios.py`` script) through ``tests/helpers/scenario_kit.py::run`` in ``tmp_path``; return
    what its ranks wrote (``read_results``)."""

    def _run(fn: Callable[..., None], ranks: int = 2, **options) -> list[dict]:
        run(fn, tmp_path, **options)
        return read_results(tmp_path, fn.scenario_name, ranks)

    return _run
