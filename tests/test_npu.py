"""The NPU accelerator and the device-agnostic runtime, without NPU hardware.

* In this process: registration, the clear errors when torch_npu is missing or broken (raised by the Trainer
  constructor), device parsing, backend selection, ``lightning-mm env``.
* In fresh interpreters: lazy import (``import lightning_mm`` imports no torch_npu), and the strategy's process
  group after a failed run.
* In a fresh interpreter: Lightning's accelerator connector is not patched, and a CPU Trainer is the same with and
  without ``import lightning_mm``.
* In a subprocess with the TEST DOUBLE of tests/helpers/fake_npu_backend.py (PrivateUse1 renamed to ``npu`` plus
  a Python ``torch.npu``): what needs an ``npu`` device type to exist. It covers availability and counting,
  ``strategy="single_npu"`` (its device from ``Trainer(devices=...)``, mixed precision autocasting on ``npu``),
  ``auto`` staying Lightning's choice, setup_device/get_device_stats/teardown reaching ``torch.npu``, the parallel
  devices and backend of MMFSDP2Strategy on NPUs, and ``lightning-mm env``. It does NOT cover anything that allocates
  memory on the NPU: no training step, no HCCL collective, no real torch_npu/CANN; that needs Ascend hardware.
* benchmarks/fsdp2_smoke.py, the end-to-end FSDP2 run that a GPU or NPU machine runs, runs here on 2 CPU ranks.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_mm
from lightning_mm.accelerators import NPUAccelerator, NPUUnavailableError
from lightning_mm.accelerators.device_parsing import parse_device_indices
from lightning_mm.accelerators.npu import torch_npu_version
from lightning_mm.core.backend import process_group_backend

ROOT = Path(__file__).resolve().parents[1]


def _python(
    code: str, *, fake_npu: int | None = None, extra_path: Path | None = None, timeout: int = 180
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (with the fake NPU backend installed first when ``fake_npu`` is set)."""
    if fake_npu is not None:
        # lightning_mm first: transformers (imported by it) probes for torch_npu once, at import, and would take
        # the double's stand-in for the real torch_npu.
        code = (
            f"import lightning_mm\nfrom tests.helpers.fake_npu_backend import install\nfake = install({fake_npu})\n"
            + textwrap.dedent(code)
        )
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "OMP_NUM_THREADS": "1",
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        "LIGHTNING_MM_FAKE_NPU_SUBPROCESS": "1",
    }
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _json_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def no_torch_npu(monkeypatch):
    """torch_npu is absent (``None`` in sys.modules makes ``import torch_npu`` fail as if not installed)."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)


@pytest.fixture
def broken_torch_npu(tmp_path, monkeypatch):
    """A torch_npu whose import fails the way it does when CANN is not sourced."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")\n'
    )
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("torch_npu", None)
    importlib.invalidate_caches()


# --------------------------------------------------------------------------------- registration
def test_npu_is_registered_and_exported():
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mm.accelerators import SingleNPUStrategy

    assert lightning_mm.NPUAccelerator is NPUAccelerator and "NPUAccelerator" in lightning_mm.__all__
    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator and NPUAccelerator.name() == "npu"
    assert StrategyRegistry["single_npu"]["strategy"] is SingleNPUStrategy
    assert "SingleNPUStrategy" in lightning_mm.__all__
    NPUAccelerator.register_accelerators(AcceleratorRegistry)  # idempotent: a second import-time call is harmless
    SingleNPUStrategy.register_strategies(StrategyRegistry)


def test_import_lightning_mm_patches_nothing_and_a_cpu_trainer_is_unaffected():
    # Registering the NPU must not change how Trainers without it behave: Lightning's accelerator connector keeps
    # its own methods, and CPU Trainers (explicit, auto, mixed precision) are built the same before and after.
    proc = _python("""
        import json
        import lightning as L
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as C

        def methods():
            return {k: repr(v) for k, v in vars(C).items() if callable(v) or isinstance(v, staticmethod)}

        def trainers():
            out = []
            for kwargs in ({"accelerator": "cpu", "devices": 1}, {"accelerator": "cpu", "devices": 1,
                           "precision": "bf16-mixed"}, {"accelerator": "auto"}, {"accelerator": "cpu", "devices": 2}):
                t = L.Trainer(logger=False, **kwargs)
                out.append([type(t.accelerator).__name__, type(t.strategy).__name__, str(t.strategy.root_device),
                            type(t.precision_plugin).__name__, getattr(t.precision_plugin, "device", None)])
            return out

        before = (methods(), trainers())
        import lightning_mm
        after = (methods(), trainers())
        print(json.dumps({"methods_unchanged": before[0] == after[0], "trainers": [before[1], after[1]]}))
    """)
    out = _json_result(proc)
    assert out["methods_unchanged"] is True
    before, after = out["trainers"]
    assert before == after
    assert after[0] == ["CPUAccelerator", "SingleDeviceStrategy", "cpu", "Precision", None]
    assert after[1] == ["CPUAccelerator", "SingleDeviceStrategy", "cpu", "MixedPrecision", "cpu"]


def test_import_lightning_mm_never_imports_torch_npu():
    # A meta-path finder sees every lookup of torch_npu (an import or an importlib.util.find_spec probe) and the code
    # that asked. `import lightning_mm`, registering the accelerator and building a CPU or an "auto" Trainer must not
    # import torch_npu, and no lightning_mm code may even look for it ("auto" is Lightning's own choice, which never
    # considers the NPU). (Device-backend autoload is off here.)
    proc = _python("""
        import json, sys, traceback

        class Watch:
            lookups = []
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch_npu":
                    frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename
                              and not f.filename.startswith("<")]
                    self.lookups.append(frames[-1].filename if frames else "?")
                return None

        def ours():
            return [f for f in Watch.lookups if "lightning_mm" in f]

        sys.meta_path.insert(0, Watch())
        import lightning_mm
        from lightning.pytorch.accelerators import AcceleratorRegistry
        import lightning as L
        L.Trainer(accelerator="cpu", devices=1, logger=False)
        out = {"npu": "npu" in AcceleratorRegistry, "torch_npu": "torch_npu" in sys.modules, "at_import": ours()}
        L.Trainer(accelerator="auto", devices=1, logger=False)
        out["auto_looked"] = len(ours()) > 0
        out["torch_npu_after_auto"] = "torch_npu" in sys.modules
        print(json.dumps(out))
    """)
    assert _json_result(proc) == {
        "npu": True,
        "torch_npu": False,
        "at_import": [],
        "auto_looked": False,
        "torch_npu_after_auto": False,
    }


# --------------------------------------------------------------------------- clear errors
def test_missing_torch_npu_is_a_clear_error_when_the_trainer_is_built(no_torch_npu):
    from lightning_mm import MMFSDP2Strategy

    assert not NPUAccelerator.is_available() and NPUAccelerator.auto_device_count() == 0
    for kwargs in ({"devices": 1}, {"devices": 2, "strategy": MMFSDP2Strategy()}):
        with pytest.raises(NPUUnavailableError) as info:
            L.Trainer(accelerator="npu", logger=False, **kwargs)
        message = str(info.value)
        assert "torch_npu is not installed" in message
        assert "pip install lightning-mm[npu]" in message and "CANN" in message
    assert not torch.distributed.is_initialized()  # failed before any process or group existed
    # Without an NPU, "auto" keeps Lightning's own choice.
    assert type(L.Trainer(accelerator="auto", devices=1, logger=False).accelerator).__name__ == "CPUAccelerator"


def test_torch_npu_that_cannot_be_imported_is_a_clear_error(broken_torch_npu):
    with pytest.raises(NPUUnavailableError) as info:
        L.Trainer(accelerator="npu", devices=1, logger=False)
    message = str(info.value)
    assert "torch_npu is installed but cannot be imported" in message and "libhccl.so" in message
    assert "set_env.sh" in message
    assert not NPUAccelerator.is_available()  # and availability checks never raise


# ------------------------------------------------------------------------- deciding, no device
@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (1, [0]),
        (3, [0, 1, 2]),
        (-1, [0, 1, 2, 3]),
        ("auto", [0, 1, 2, 3]),
        ("-1", [0, 1, 2, 3]),
        ("2", [0, 1]),
        ("1,3", [1, 3]),
        ("2,", [2]),
        (" 0, 1 ", [0, 1]),
        ([3, 1], [3, 1]),
        ((0,), [0]),
    ],
)
def test_device_parsing(devices, expected):
    assert parse_device_indices(devices, available=4) == expected


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        (5, ValueError, r"only 4 NPU\(s\) are visible.*not visible: \[4\]"),
        ([0, 4], ValueError, r"not visible: \[4\]"),
        ([1, 1], ValueError, "same NPU twice"),
        (0, ValueError, "not a valid number"),
        (-2, ValueError, "not a valid"),
        ("x", ValueError, "not a count"),
        ([], ValueError, "selects no NPU"),
        ([-1], ValueError, "non-negative"),
        (True, TypeError, "bool"),
        ([0.5], TypeError, "ints only"),
        (1.0, TypeError, "float"),
    ],
)
def test_device_parsing_errors(devices, error, message):
    with pytest.raises(error, match=message):
        parse_device_indices(devices, available=4)


def test_device_parsing_without_devices_names_the_hint():
    with pytest.raises(ValueError, match="none is visible. Set ASCEND_RT_VISIBLE_DEVICES"):
        parse_device_indices(1, available=0, hint="Set ASCEND_RT_VISIBLE_DEVICES")


@pytest.mark.parametrize(
    ("device", "offload", "backend"),
    [
        ("npu:0", False, "hccl"),
        ("npu:3", True, "npu:hccl,cpu:gloo"),
        ("xpu", False, "xccl"),
        ("cpu", True, "gloo"),
        ("cuda:1", False, "nccl"),
    ],
)
def test_process_group_backend_follows_the_device(device, offload, backend):
    assert process_group_backend(device, offload) == backend


def test_unknown_device_type_has_no_silent_backend():
    with pytest.raises(ValueError, match="no known process-group backend for device type 'meta'"):
        process_group_backend("meta")


# ------------------------------------------------------------------------------------ env command
def test_env_command_reports_versions_accelerators_backends_and_auto(no_torch_npu, capsys):
    from lightning_mm.cli import COMMANDS, main

    assert COMMANDS["env"][0] == "lightning_mm.commands.env"
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"] == torch.__version__ and info["versions"]["lightning"] == L.__version__
    assert info["versions"]["torch_npu"] == torch_npu_version()  # None here; read without importing torch_npu
    assert info["accelerators"]["cpu"] == {"class": "CPUAccelerator", "available": True, "devices": 1}
    npu = info["accelerators"]["npu"]
    assert npu["available"] is False and "torch_npu is not installed" in npu["reason"]
    assert info["distributed_backends"]["gloo"] is True and info["distributed_backends"]["hccl"] is False
    assert info["auto"] == {"accelerator": "cpu", "devices": 1}

    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"torch:         {torch.__version__}" in text and "torch_npu:" in text
    assert "npu    not available (torch_npu is not installed" in text
    assert 'accelerator="auto" chooses: cpu' in text and "gloo yes" in text


def test_env_asks_torch_what_lightning_would_find(no_torch_npu):
    """``env`` reports Lightning's accelerators and ``auto`` choice without importing Lightning: the answers equal
    Lightning's own on this machine."""
    from lightning_mm._compat import auto_accelerator
    from lightning_mm.commands import env

    assert env._accelerators() == env._lightning_accelerators() | {"npu": env._accelerators()["npu"]}
    assert env._lightning_accelerators()["npu"]["available"] is False
    assert env._auto_choice(env._accelerators())["accelerator"] == auto_accelerator()


# ----------------------------------------------------------------------------- with the test double
def test_npu_accelerator_and_trainer_wiring_with_the_fake_npu_backend():
    proc = _python(
        """
        import json
        import lightning as L, torch
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning.pytorch.strategies import SingleDeviceStrategy
        from lightning_mm import MMFSDP2Strategy, NPUAccelerator
        from lightning_mm.accelerators import NPUUnavailableError
        from lightning_mm.core.backend import process_group_backend
        from lightning_mm.strategies.precision import MMFSDP2Precision
        from lightning_mm.commands.env import collect
        out = {}
        acc = NPUAccelerator
        out["available"], out["count"] = acc.is_available(), acc.auto_device_count()
        out["parse"] = [acc.parse_devices(d) for d in (1, -1, "auto", "1", "0,1", [1])]
        out["parallel"] = [str(d) for d in acc.get_parallel_devices([0, 1])]
        try:
            acc.parse_devices(3)
        except ValueError as err:
            out["parse_error"] = str(err)

        # One NPU, bf16-mixed: strategy="single_npu" on npu:0, autocast on npu.
        t = L.Trainer(accelerator="npu", devices=1, strategy="single_npu", precision="bf16-mixed", logger=False)
        plugin = t.precision_plugin
        with plugin.forward_context():
            autocast = [torch.is_autocast_enabled("npu"), str(torch.get_autocast_dtype("npu")),
                        torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu")]
        out["single"] = {"accelerator": type(t.accelerator).__name__, "strategy": type(t.strategy).__name__,
                         "root": str(t.strategy.root_device), "precision": type(plugin).__name__,
                         "autocast_device": plugin.device, "autocast": autocast}
        t = L.Trainer(accelerator="npu", devices=[1], strategy="single_npu", precision="16-mixed", logger=False)
        out["single_16"] = [str(t.strategy.root_device), t.precision_plugin.device,
                            str(t.precision_plugin.scaler._device)]
        # accelerator="auto" stays Lightning's choice; one NPU without strategy="single_npu" gets Lightning's CPU
        # strategy, which the accelerator refuses, naming the fix, when the run starts.
        out["auto"] = type(L.Trainer(accelerator="auto", devices=1, logger=False).accelerator).__name__
        t = L.Trainer(accelerator="npu", devices=1, logger=False)
        try:
            t.accelerator.setup_device(t.strategy.root_device)
        except Exception as err:
            out["no_single_npu"] = str(err)
        try:
            L.Trainer(accelerator="npu", devices=2, strategy="single_npu", logger=False)
        except ValueError as err:
            out["single_npu_two"] = str(err)

        # MMFSDP2Strategy on every NPU, with CPU offload: devices, root device, backend, precision.
        s = MMFSDP2Strategy({"sharding_size": "auto", "offload_to_cpu": True})
        t = L.Trainer(accelerator="npu", devices="auto", strategy=s, precision="bf16-mixed", logger=False)
        out["fsdp2"] = {"devices": [str(d) for d in s.parallel_devices], "root": str(s.root_device),
                        "backend": process_group_backend(s.root_device, s.fsdp2_config.offload_to_cpu),
                        "backend_no_offload": process_group_backend(s.root_device),
                        "precision": [type(s.precision_plugin).__name__, s.precision_plugin.precision]}

        # The accelerator reaches torch.npu (the double records the calls); it refuses a CPU placement.
        a = t.accelerator
        a.setup_device(torch.device("npu", 1))
        out["stats"] = a.get_device_stats(torch.device("npu", 1))
        a.teardown()
        out["calls"] = fake.calls
        try:
            a.setup_device(torch.device("cpu"))
        except Exception as err:
            out["cpu_placement"] = str(err)
        out["cuda_untouched"] = [torch.cuda.__name__, torch.cuda.is_available(), torch.npu is fake]

        info = collect()
        out["env"] = {"npu": info["accelerators"]["npu"], "auto": info["auto"],
                      "torch_npu": info["versions"]["torch_npu"], "torch_accelerator": info["torch_accelerator"]}

        # No NPU visible: a clear error, and "auto" falls back to the CPU.
        fake.count = 0
        try:
            L.Trainer(accelerator="npu", devices=1, logger=False)
        except NPUUnavailableError as err:
            out["no_device_error"] = str(err)
        out["auto_without_npu"] = type(L.Trainer(accelerator="auto", devices=1, logger=False).accelerator).__name__
        print(json.dumps(out))
    """,
        fake_npu=2,
    )
    out = _json_result(proc)
    assert out["available"] is True and out["count"] == 2
    assert out["parse"] == [[0], [0, 1], [0, 1], [0], [0, 1], [1]]
    assert out["parallel"] == ["npu:0", "npu:1"]
    assert "only 2 NPU(s) are visible" in out["parse_error"] and "ASCEND_RT_VISIBLE_DEVICES" in out["parse_error"]

    assert out["single"] == {
        "accelerator": "NPUAccelerator",
        "strategy": "SingleNPUStrategy",
        "root": "npu:0",
        "precision": "MixedPrecision",
        "autocast_device": "npu",
        "autocast": [True, "torch.bfloat16", False, False],
    }
    assert out["single_16"] == ["npu:1", "npu", "npu"]
    assert out["auto"] == "CPUAccelerator"
    assert "strategy='single_npu'" in out["no_single_npu"] and "given the device cpu" in out["no_single_npu"]
    assert "runs on one NPU, but 2 devices" in out["single_npu_two"]

    assert out["fsdp2"] == {
        "devices": ["npu:0", "npu:1"],
        "root": "npu:0",
        "backend": "npu:hccl,cpu:gloo",
        "backend_no_offload": "hccl",
        "precision": ["MMFSDP2Precision", "bf16-mixed"],
    }

    assert out["stats"] == {"allocated_bytes.all.current": 1024, "allocated_bytes.all.peak": 4096}
    assert out["calls"] == [["set_device", "npu:1"], ["memory_stats", "npu:1"], ["empty_cache", None]]
    assert "NPUAccelerator was given the device cpu" in out["cpu_placement"]
    assert out["cuda_untouched"] == ["torch.cuda", False, True]  # torch.cuda is not patched onto the NPU

    assert out["env"] == {
        "npu": {"class": "NPUAccelerator", "available": True, "devices": 2},
        "auto": {"accelerator": "cpu", "devices": 1},
        "torch_npu": "0.0.0+fake",
        "torch_accelerator": "npu",
    }

    assert "no NPU is visible" in out["no_device_error"] and "npu-smi info" in out["no_device_error"]
    assert out["auto_without_npu"] == "CPUAccelerator"


# ------------------------------------------------------------------------------- the strategy's group
def test_process_group_is_destroyed_after_a_failed_run_and_kept_after_a_successful_one():
    proc = _python("""
        import json
        import lightning as L, torch, torch.distributed as dist
        from torch import nn
        from lightning_mm import MMFSDP2Strategy

        class Net(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
            def training_step(self, batch, idx):
                return self.layers(batch).pow(2).mean()
            def validation_step(self, batch, idx):
                self.log("val", self.layers(batch).pow(2).mean())
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        class Boom(L.Callback):
            def on_train_batch_start(self, *args):
                raise RuntimeError("boom")

        def trainer(callbacks=()):
            return L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=1, callbacks=list(callbacks),
                             strategy=MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}))

        data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
        out = {}
        try:
            trainer([Boom()]).fit(Net(), train_dataloaders=data)
        except RuntimeError as err:
            out["error"] = str(err)
        out["group_after_failure"] = dist.is_initialized()
        t, net = trainer(), Net()
        t.fit(net, train_dataloaders=data)
        out["group_after_success"] = dist.is_initialized() and dist.get_backend()
        out["validate_same_model"] = t.validate(net, dataloaders=data, verbose=False)[0]["val"] >= 0
        print(json.dumps(out))
    """)
    assert _json_result(proc) == {
        "error": "boom",
        "group_after_failure": False,
        "group_after_success": "gloo",
        "validate_same_model": True,
    }


# ------------------------------------------------------------------------ the end-to-end smoke run
def test_fsdp2_smoke_script_trains_the_seed_yaml_on_two_cpu_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fsdp2_smoke.py"),
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--steps",
            "6",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "PASS: FSDP2 on 2 x cpu (backend gloo)" in proc.stdout
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["passed"] and all(r["checks"].values()) and r["backend"] == "gloo" and r["device"] == "cpu"
        assert len(r["losses"]) == 6
    assert r0["full_weight_sum"] == r1["full_weight_sum"]
    assert r0["losses"] != r1["losses"]  # each rank trained on its own batches
    assert r0["losses"][-1] < r0["losses"][0]
