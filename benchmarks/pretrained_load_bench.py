"""Peak resident memory per rank while loading a pretrained Hugging Face model on 2 ranks.

    python benchmarks/pretrained_load_bench.py --dir /tmp/load_bench [--hidden 2048 --layers 6 --vocab 32000]

A Llama checkpoint of ``--layers`` decoder layers is made once with random weights and ``save_pretrained`` into
``--dir/llama`` (defaults: 439M parameters, 1.76 GB in fp32; no hub download). It is then loaded on 2 CPU ranks
(gloo) by a Lightning ``Trainer`` with ``MMFSDP2Strategy`` (layers, embeddings and head sharded over both ranks),
in two ways, each in fresh processes:

* ``sharded``: ``TransformersModel({"init_from_hf_path": ...})`` in ``model_provider``: built on the meta device,
  sharded, then each rank reads only its own rows of every weight (lightning-mm's path);
* ``from_pretrained``: ``LlamaForCausalLM.from_pretrained(...)`` in ``model_provider`` on every rank (the full
  model on each rank), then sharded by the same strategy.

Per rank it reports the resident memory when the LightningModule is set up (the runtime's baseline: torch,
Lightning, Transformers, the process group), the peak resident memory until the model is ready (sampled every
2 ms from /proc; the kernel's ``ru_maxrss``, the peak of the whole process, is shown as a cross-check), and the
sampled peak over the baseline. The target is a per-rank increase of at most about half the model. A Markdown
table is printed; ``--dir/results.json`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The highest RSS seen between ``start()`` and ``stop()``, sampled in a thread every 2 ms."""

    def start(self) -> None:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def make_checkpoint(path: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama saved with ``save_pretrained`` (fp32); returns the bytes of its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(hidden * 2.75),
            num_hidden_layers=layers,
            num_attention_heads=hidden // 128,
            num_key_value_heads=hidden // 128,
            tie_word_embeddings=False,
        )
        config.architectures = ["LlamaForCausalLM"]
        model = LlamaForCausalLM(config)
        model.save_pretrained(path)
        del model
        gc.collect()
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run_rank(mode: str, path: Path, out: Path) -> None:
    """One rank of one measurement (Lightning's launcher starts the second rank from this same command)."""
    import lightning as L
    from transformers import LlamaForCausalLM

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    sampler = PeakSampler()
    timing: dict[str, float] = {}

    class Module(MMLightningModule):
        def setup(self, stage: str) -> None:
            gc.collect()
            timing["start"] = time.perf_counter()
            sampler.start()

        def model_provider(self) -> torch.nn.Module:
            if mode == "sharded":
                return TransformersModel({"init_from_hf_path": str(path)})
            return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)

        def on_fit_start(self) -> None:
            sampler.stop()
            timing["seconds"] = time.perf_counter() - timing["start"]

    config = {"sharding_size": "auto", "sub_modules_to_wrap": ["model.embed_tokens", "model.layers.{*}", "lm_head"]}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy(config, empty_init=(mode == "sharded")),
    )
    data = torch.utils.data.DataLoader([{"input_ids": torch.zeros(8, dtype=torch.long)}] * 2, batch_size=1)
    module = Module()
    trainer.fit(module, train_dataloaders=data)
    local_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in module.model.parameters()
    )
    result = {
        "mode": mode,
        "rank": trainer.global_rank,
        "baseline": sampler.base,
        "peak_sampled": sampler.peak,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "local_param_bytes": local_bytes,
        "seconds": timing["seconds"],
    }
    (out / f"{mode}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/load_bench")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--run", choices=["sharded", "from_pretrained"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = Path(args.dir)
    path = root / "llama"
    if args.run:
        run_rank(args.run, path, root)
        return

    root.mkdir(parents=True, exist_ok=True)
    size = make_checkpoint(path, args.hidden, args.layers, args.vocab)
    print(f"checkpoint: {path} ({size / GB:.2f} GB of safetensors)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    results: dict[str, Any] = {"checkpoint_bytes": size, "runs": []}
    for mode in ("sharded", "from_pretrained"):
        cmd = [sys.executable, __file__, "--dir", str(root), "--run", mode]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
        for rank in range(2):
            results["runs"].append(json.loads((root / f"{mode}.rank{rank}.json").read_text()))
    (root / "results.json").write_text(json.dumps(results, indent=1))

    print(f"\nModel: Llama, {size / GB:.2f} GB fp32; half: {size / 2 / GB:.2f} GB. 2 CPU ranks, gloo.\n")
    print("| load | rank | baseline RSS | peak RSS (sampled / ru_maxrss) | peak - baseline | local params | time |")
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        peak = r["peak_sampled"]  # ru_maxrss is the whole process's peak, a cross-check
        print(
            f"| {r['mode']} | {r['rank']} | {r['baseline'] / GB:.2f} GB | {r['peak_sampled'] / GB:.2f} / "
            f"{r['ru_maxrss'] / GB:.2f} GB | {(peak - r['baseline']) / GB:.2f} GB | "
            f"{r['local_param_bytes'] / GB:.2f} GB | {r['seconds']:.1f} s |"
        )


if __name__ == "__main__":
    main()
