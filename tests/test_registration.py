"""``strategy="mm_fsdp2"``, ``"single_npu"`` and ``accelerator="npu"`` exist after any ``import lightning_mm``, however
Python was started, while the commands that do not train still import neither Lightning nor Transformers.

Every case runs in a fresh Python process: how the interpreter was started (``python -m``, ``-c``, a script path,
the ``lightning-mm`` console script) and which module came first are exactly what is under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the training script checks: the name resolves to our class through Lightning's own Trainer, the other names
# are in Lightning's registries, and the import watch is gone without a trace once it has registered them.
_CHECK = """
import json
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
from lightning_mm.strategies import MMFSDP2Strategy
import lightning.pytorch, sys
trainer = Trainer(strategy="mm_fsdp2", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
print(json.dumps({
    "strategy": type(trainer.strategy).__name__,
    "is_ours": isinstance(trainer.strategy, MMFSDP2Strategy),
    "single_npu": "single_npu" in StrategyRegistry,
    "npu": "npu" in AcceleratorRegistry,
    "watch_left": [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("lightning_mm")],
    "loader": type(lightning.pytorch.__loader__).__name__,
}))
"""

# The first lines of each program: the import orders that matter.
_FIRST = {
    # the package root first, Lightning later (the reported failure under `python -m`)
    "root_first": "import lightning_mm\n",
    # one of our Lightning-layer modules first: it is what imports Lightning, half-way through its own import
    "strategies_first": "from lightning_mm.strategies import MMFSDP2Strategy\n",
    # Lightning first, then only a lower layer of the package (which runs the package root)
    "lightning_first": "import lightning\nimport lightning_mm.core\n",
}

_EXPECTED = {
    "strategy": "MMFSDP2Strategy",
    "is_ours": True,
    "single_npu": True,
    "npu": True,
    "watch_left": [],
    "loader": "SourceFileLoader",
}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    return env


def _program(tmp_path: Path, first: str, imported_by_package: bool) -> str:
    """A package ``mypkg`` with ``train.py``, on the path of the child process (its working directory).

    With ``imported_by_package``, the first imports are in ``mypkg/model.py``, which ``mypkg/__init__.py`` imports
    (the usual layout): under ``python -m mypkg.train`` they then run while Python is still locating the module,
    when ``sys.argv[0]`` is ``"-m"``.
    """
    source = _FIRST[first] + _CHECK
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "model.py").write_text(_FIRST[first])
    (tmp_path / "mypkg" / "__init__.py").write_text("from mypkg import model\n" if imported_by_package else "")
    (tmp_path / "mypkg" / "train.py").write_text(_CHECK if imported_by_package else source)
    return source


@pytest.mark.parametrize(
    ("how", "first", "imported_by_package"),
    [
        ("-m", "root_first", True),
        ("-m", "root_first", False),
        ("-c", "strategies_first", False),
        ("script", "lightning_first", False),
    ],
)
def test_the_names_are_registered_however_python_was_started(tmp_path, how, first, imported_by_package):
    source = _program(tmp_path, first, imported_by_package)
    launch = {"-m": ["-m", "mypkg.train"], "-c": ["-c", source], "script": [str(tmp_path / "mypkg" / "train.py")]}
    proc = subprocess.run(
        [sys.executable, *launch[how]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == _EXPECTED


# ------------------------------------------------------------------------------ light commands stay light
def _console_script(tmp_path: Path) -> Path:
    """The ``lightning-mm`` console script as an installer writes it, from pyproject's ``[project.scripts]``."""
    found = re.search(r'^lightning-mm\s*=\s*"([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert found, 'pyproject.toml: no `lightning-mm = "module:function"` under [project.scripts]'
    module, function = found.groups()
    script = tmp_path / "bin" / "lightning-mm"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(f"""\
        import sys
        from {module} import {function}
        if __name__ == '__main__':
            sys.argv[0] = sys.argv[0].removesuffix('.exe')
            sys.exit({function}())
    """)
    )
    return script


def _imported_top_level_modules(stderr: str) -> set[str]:
    """Top-level module names from ``python -X importtime`` output."""
    return {
        line.rsplit("|", 1)[-1].strip().split(".")[0] for line in stderr.splitlines() if line.startswith("import time:")
    }


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_commands_that_do_not_train_import_neither_lightning_nor_transformers(tmp_path, how):
    command = [str(_console_script(tmp_path))] if how == "console script" else ["-m", "lightning_mm.cli"]
    for args in (["--help"], ["migrate", "examples/migration/pretrain_custom.sh"], ["convert", "--help"], ["env"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", *command, *args],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert proc.stdout.strip(), args
        heavy = _imported_top_level_modules(proc.stderr) & {"lightning", "pytorch_lightning", "transformers"}
        assert heavy == set(), (how, args, heavy)


# ------------------------------------------------------------------------------ the import watch itself
_WATCH_SCENARIO = """
import json, os, sys
from lightning_mm._utils.import_watch import call_once_imported
calls, tries = [], []

def callback():
    import ourpkg.layer  # half-imported when lib.inner completes: the callback must wait for it to finish
    calls.append(ourpkg.layer.READY)

def fails_once():
    tries.append(1)
    if len(tries) == 1:
        raise RuntimeError("callback failed")

call_once_imported("lib.inner", callback, also_wait_for=("ourpkg.",))
call_once_imported("other", fails_once)
import ourpkg.helpers        # watched, does not import the target: no call
after_helpers = list(calls)
os.environ["BREAK_LIB"] = "1"
try:
    import lib.inner         # the target's parent fails to import: no call
except RuntimeError:
    pass
os.environ["BREAK_LIB"] = "0"
after_failure = list(calls)
import ourpkg.layer          # imports lib.inner half-way through its own import
import lib.inner, ourpkg
try:
    import other             # the callback's error is the import's error ...
except RuntimeError as error:
    first_error = str(error)
import other                 # ... and it is tried again on the next import
print(json.dumps({"after_helpers": after_helpers, "after_failure": after_failure, "calls": calls,
                  "first_error": first_error, "tries": len(tries),
                  # (lightning_mm's own watch for Lightning stays: this process never imports Lightning)
                  "finder_left": [f._target for f in sys.meta_path if getattr(f, "_target", "") in ("lib.inner",
                                                                                                   "other")],
                  "loaders": sorted({type(m.__loader__).__name__ for m in (lib.inner, ourpkg.layer, other)}),
                  "spec_loaders": sorted({type(m.__spec__.loader).__name__ for m in (lib.inner, ourpkg.layer)})}))
"""


def test_the_import_watch_calls_back_once_the_target_and_the_watched_modules_are_complete(tmp_path):
    files = {
        "lib/__init__.py": "import os\nif os.environ.get('BREAK_LIB') == '1':\n    raise RuntimeError('broken')\n",
        "lib/inner.py": "VALUE = 1\n",
        "other.py": "",
        "ourpkg/__init__.py": "",
        "ourpkg/helpers.py": "",
        "ourpkg/layer.py": "import lib.inner\nREADY = lib.inner.VALUE\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    proc = subprocess.run(
        [sys.executable, "-c", _WATCH_SCENARIO], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {
        "after_helpers": [],
        "after_failure": [],
        "calls": [1],
        "first_error": "callback failed",
        "tries": 2,
        "finder_left": [],
        "loaders": ["SourceFileLoader"],
        "spec_loaders": ["SourceFileLoader"],
    }
