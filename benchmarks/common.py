"""Shared pieces of the benchmarks: models, data, a step timer, launching 2 ranks, machine facts, results.

Nothing here is timed itself. The benchmark scripts import it as ``common`` (they put ``benchmarks/`` on the path).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
# Where results go: benchmarks/results, or $LMM_BENCH_RESULTS (run_cpu.sh's QUICK mode, so a check run does not
# overwrite the recorded figures).
RESULTS = Path(os.environ.get("LMM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
for _path in (str(ROOT), str(ROOT / "examples" / "custom_model")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


# ----------------------------------------------------------------------------------------------- models
@dataclass
class LMConfig:
    """A small decoder-only (GPT-style) transformer: learned positions, pre-norm blocks, untied output head."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4

    @property
    def num_params(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * (self.mlp_ratio * h * h) + self.mlp_ratio * h + h
        return v * h + self.seq_len * h + self.num_layers * block + 2 * h + v * h


class Block(nn.Module):
    """Pre-norm causal self-attention + GELU MLP."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class DecoderLM(nn.Module):
    """Token embedding + positions, ``num_layers`` blocks in ``layers``, final norm, output ``head``."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg.hidden_size, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


# --------------------------------------------------------------------------------------------------- data
def token_batches(cfg: LMConfig, samples: int, seed: int = 1234) -> torch.utils.data.TensorDataset:
    """``samples`` random token sequences of ``seq_len + 1`` tokens (the same for every contender)."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randint(0, cfg.vocab_size, (samples, cfg.seq_len + 1), generator=g))


class CaptionData(torch.utils.data.Dataset):
    """Images with captions for TinyVLM (deterministic per index)."""

    def __init__(self, n: int, seq: int, vocab: int, image_size: int = 32) -> None:
        self.n, self.seq, self.vocab, self.image_size = n, seq, vocab, image_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        return {
            "images": torch.randn(3, self.image_size, self.image_size, generator=g),
            "input_ids": ids,
            "labels": ids,
        }


# ------------------------------------------------------------------------------------------------ timing
class CommCounter:
    """Counts the collectives issued through ``torch.distributed``'s Python functions, and their bytes.

    FSDP2 (``all_gather_single``, ``reduce_scatter_single``), FSDP1 on CPU (``all_gather``,
    ``reduce_scatter_single``) and Lightning (``broadcast``) go through these; DDP's bucketed all-reduces are
    issued from C++ and are not seen. Installed for the benchmark process only.
    """

    # function name -> the argument whose size is the traffic (the gathered output, the scattered input)
    FUNCTIONS = {
        "all_gather_single": "output_tensor",
        "reduce_scatter_single": "input",
        "all_gather_into_tensor": "output_tensor",
        "reduce_scatter_tensor": "input",
        "all_gather": "tensor_list",
        "all_reduce": "tensor",
        "broadcast": "tensor",
    }

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CommCounter:
        import torch.distributed as dist

        for name, arg in self.FUNCTIONS.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, arg, original))
        return self

    def _wrap(self, name: str, arg: str, original: Any) -> Any:
        import inspect

        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            value = signature.bind_partial(*args, **kwargs).arguments.get(arg)
            tensors = value if isinstance(value, (list, tuple)) else [value]
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + sum(
                t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
            )
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}

    def snapshot(self) -> dict[str, int]:
        return {**{f"{k}_calls": v for k, v in self.calls.items()}, **{f"{k}_bytes": v for k, v in self.bytes.items()}}


class StepTimer(L.Callback):
    """Wall time between the starts of consecutive training batches: everything a step costs, loop included.

    With a :class:`CommCounter`, the collectives of each step are counted too.
    """

    def __init__(self, comm: CommCounter | None = None) -> None:
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.comm_starts: list[dict[str, int]] = []
        self.losses: list[float] = []
        self.comm = comm

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        if self.comm is not None:
            self.comm_starts.append(self.comm.snapshot())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def step_times(self, warmup: int) -> list[float]:
        """Wall seconds per step after the first ``warmup`` steps."""
        gaps = [b - a for a, b in zip(self.starts, self.starts[1:])]
        return gaps[warmup:]

    def comm_per_step(self, warmup: int) -> dict[str, float]:
        """Collective calls and bytes per step over the timed steps."""
        if len(self.comm_starts) < warmup + 2:
            return {}
        first, last = self.comm_starts[warmup], self.comm_starts[-1]
        steps = len(self.comm_starts) - 1 - warmup
        return {k: (v - first.get(k, 0)) / steps for k, v in last.items()}

    def cpu_times(self, warmup: int) -> list[float]:
        """CPU seconds of this process (all its threads) per step after the first ``warmup`` steps: less
        sensitive than wall time to other programs on a shared machine, blind to time spent waiting."""
        gaps = [b - a for a, b in zip(self.cpu_starts, self.cpu_starts[1:])]
        return gaps[warmup:]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def quiet_trainer_kwargs() -> dict[str, Any]:
    return dict(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )


# ------------------------------------------------------------------------------------------------ launch
def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line of a benchmark script, its module docstring as the help text."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_or_work(
    parser: argparse.ArgumentParser, worker: Callable[[argparse.Namespace], None], out: str
) -> argparse.Namespace | None:
    """Parse the command line of a script that :func:`launch_ranks` re-runs on each rank with ``--worker``.

    Adds the hidden ``--worker`` and ``--out`` (default ``out``, the ranks' scratch folder). In a rank, runs
    ``worker(args)`` and returns ``None``; in the launching process, returns the parsed arguments.
    """
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=out, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return None
    return args


def launch_ranks(script: Path, args: list[str], nproc: int = 2, timeout: int = 3600, log: Path | None = None) -> None:
    """Run ``script args`` on ``nproc`` local ranks with torchrun (one thread each); raise with the log tail."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("LOCAL_RANK", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + "\n----- stderr -----\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{script.name} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
        )


def pin_threads() -> None:
    """One compute thread per rank (2 ranks on 2 cores), so that the contenders compete on equal terms."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work has started
        pass


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_rank_json(outdir: Path, name: str, data: dict[str, Any]) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{name}.rank{rank()}.json").write_text(json.dumps(data, indent=1))


def read_rank_jsons(outdir: Path, name: str, nproc: int = 2) -> list[dict[str, Any]]:
    return [json.loads((outdir / f"{name}.rank{r}.json").read_text()) for r in range(nproc)]


# ------------------------------------------------------------------------------------------------ machine
def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    import lightning

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": mem_gib,
        "loadavg": loadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def wait_for_quiet(threshold: float = 0.5, max_wait_s: float = 1800, step_s: float = 60) -> list[float]:
    """Sleep until the 1-minute load average is below ``threshold`` (at most ``max_wait_s``); return the load."""
    waited = 0.0
    while waited < max_wait_s:
        load = loadavg()
        if not load or load[0] < threshold:
            return load
        print(f"load {load[0]:.2f} >= {threshold}: waiting ({waited:.0f}s so far)", flush=True)
        time.sleep(step_s)
        waited += step_s
    return loadavg()


def save_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_jsonable))
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
