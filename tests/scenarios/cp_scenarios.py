"""The strategy's side of the context-parallel tests (``tests/test_context_parallel.py``).

    python tests/scenarios/cp_scenarios.py GROUP OUTDIR --arg ckptdir=CKPTDIR     (tests/helpers/scenario_kit.py)

``GROUP`` is ``two`` (the cases of :data:`TWO_RANK_CASES` on 2 ranks, then a checkpoint written with context
parallelism resumed without it) or ``four`` (:data:`FOUR_RANK_CASES` on 4 ranks: 2 data parallel x 2 context
parallel, then a setting that must fail at setup). Each rank writes ``OUTDIR/CASE.rank{R}.json`` (per micro-batch
its loss, sample indices and optimizer step); rank 0 writes the gathered final weights to ``OUTDIR/CASE.pt`` and
the gathered gradients of the first step to ``OUTDIR/CASE.grad.pt``. Real gloo collectives; nothing is mocked.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.parity import LR, RECOMPUTE, IndexedData  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402
from tests.scenarios.hf_scenarios import model_inputs  # noqa: E402
from tests.scenarios.parity_scenarios import _dump, _full, _gathered  # noqa: E402

SAMPLES = 8
GLOBAL_BATCH = 2


@dataclass(frozen=True)
class CPCase:
    """One run: a tiny model family, a sequence length, the context-parallel size and the YAML keys."""

    name: str
    family: str
    seq_len: int
    cp: int = 2
    fsdp2: dict[str, Any] = field(default_factory=dict)
    steps: int = 3
    custom: bool = False
    """``TinyAttentionLM`` in an MMLightningModule with ``handles_context_parallel = True`` (family: the data)."""
    left_pad: int = 0
    """Left-pad the odd samples by this many tokens (a padding ``attention_mask``)."""
    resume_at: int | None = None
    resume_cp: int = 1
    """With ``resume_at``: train ``resume_at`` steps with ``cp``, save, resume with ``resume_cp`` to ``steps``."""
    data: str = ""
    """The family whose samples it trains on (default: ``family``)."""
    packed: bool = False
    """The samples of a micro-batch packed into one row (``PackedCollator``: position ids restart, no mask)."""

    @property
    def data_family(self) -> str:
        return self.data or self.family


def _recompute(family: str, reentrant: bool) -> dict[str, Any]:
    return {"recompute_modules": RECOMPUTE[family], "use_reentrant": reentrant}


TWO_RANK_CASES = [
    CPCase("qwen3-cp2-len16", "qwen3", 16),
    CPCase("qwen3-nocp-len16", "qwen3", 16, cp=1),
    CPCase("qwen3-cp2-len15", "qwen3", 15),
    CPCase("qwen3-cp2-len15-padding-mask", "qwen3", 15, left_pad=3),
    CPCase("qwen2_5_vl-cp2-len15", "qwen2_5_vl", 15),
    CPCase("internvl-cp2-len15", "internvl", 15),
    CPCase("custom-cp2-len15", "qwen3", 15, custom=True),
    CPCase("qwen2_5_vl-cp2-len16-recompute", "qwen2_5_vl", 16, fsdp2=_recompute("qwen2_5_vl", False)),
    # Qwen3.5 (tests/helpers/packing_families.py): a Gated DeltaNet layer, run on the sequence gathered over the group.
    CPCase("qwen3_5-cp2-len15-padding-mask", "qwen3_5", 15, left_pad=3, data="qwen3"),
]
# KV all-gather (MindSpeed MM's megatron_cp_algo, the YAML key): 3 query heads and 1 key/value head, which Ulysses
# refuses at context_parallel_size 2; the zig-zag layout of the tokens; padding, packed rows, M-RoPE positions.
QWEN3_3HEADS = "qwen3_3heads"
RING = {"context_parallel_algo": "megatron_cp_algo"}
RING_CASES = [
    CPCase("qwen3h3-ring-cp2-len15-padding-mask", QWEN3_3HEADS, 15, fsdp2=RING, left_pad=3, data="qwen3"),
    CPCase("qwen3h3-ring-cp2-packed", QWEN3_3HEADS, 15, fsdp2=RING, data="qwen3", packed=True),
    CPCase("qwen2_5_vl-ring-cp2-len13", "qwen2_5_vl", 13, fsdp2=RING),
    # Gated DeltaNet: the layer runs on the whole sequence gathered in natural order, each rank keeps its chunks
    CPCase("qwen3_5-ring-cp2-len15-padding-mask", "qwen3_5", 15, fsdp2=RING, left_pad=3, data="qwen3"),
]
TWO_RANK_CASES += RING_CASES
RESUME_CASES = [CPCase("qwen3-cp2-resume-nocp", "qwen3", 15, steps=4, resume_at=2)]
FOUR_RANK_CASES = [
    CPCase("qwen3-dp2xcp2-len15-recompute", "qwen3", 15, fsdp2=_recompute("qwen3", True), steps=2),
    CPCase("qwen2_5_vl-dp2xcp2-len16-hsdp", "qwen2_5_vl", 16, fsdp2={"sharding_size": 2}, steps=2),
]
BAD_CASE = CPCase("qwen3-cp4-heads", "qwen3", 16, cp=4, steps=1)  # 2 key/value heads do not divide by 4
CASES = {c.name: c for c in [*TWO_RANK_CASES, *RESUME_CASES, *FOUR_RANK_CASES, BAD_CASE]}


class CPData(torch.utils.data.Dataset):
    """The parity samples cut to ``seq_len`` tokens, with their index."""

    def __init__(self, family: str, seq_len: int, n: int = SAMPLES, left_pad: int = 0) -> None:
        self.data, self.seq_len, self.left_pad = IndexedData(family, n), seq_len, left_pad

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = dict(self.data[i])
        for key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids"):
            if key in sample:
                sample[key] = sample[key][: self.seq_len]
        if self.left_pad and i % 2:  # odd samples left-padded; no target is predicted from a padded position
            sample["attention_mask"][: self.left_pad] = 0
            sample["labels"][: self.left_pad + 1] = -100
        return sample


def tiny_qwen3_3heads(seed: int = 7) -> torch.nn.Module:
    """The tiny Qwen3 with 3 attention heads and 1 key/value head (neither divides by 2)."""
    import transformers

    from tests.scenarios.hf_scenarios import FAMILIES

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**FAMILIES["qwen3"][1], "num_attention_heads": 3, "num_key_value_heads": 1})
    config.architectures = ["Qwen3ForCausalLM"]
    return transformers.Qwen3ForCausalLM(config).eval()


def qwen3_3heads_provider() -> torch.nn.Module:
    """:func:`tiny_qwen3_3heads`, for ``lightning-mm plan`` in the tests."""
    return tiny_qwen3_3heads()


def packed_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The samples packed into one row by the project's ``PackedCollator``, with their indices."""
    from lightning_mm.core.packed_rows import PackedCollator

    indices = torch.stack([s["index"] for s in samples])
    batch = PackedCollator()([{k: v for k, v in s.items() if k != "index"} for s in samples])
    return {**batch, "index": indices}


def batch_of(case: CPCase, indices: list[int]) -> dict[str, torch.Tensor]:
    data = CPData(case.data_family, case.seq_len, left_pad=case.left_pad)
    batch = torch.utils.data.default_collate([data[i] for i in indices])
    batch.pop("index")
    return model_inputs(batch)


class TinyAttentionLM(torch.nn.Module):
    """A custom (non-Transformers) causal LM whose own attention runs context-parallel through the documented
    helpers: :func:`split_sequence`, :func:`ulysses_attention`, :func:`context_parallel_loss`."""

    def __init__(self, vocab: int = 128, width: int = 32, heads: int = 4, max_len: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(max_len, width)
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, group: Any = None, **_: Any) -> torch.Tensor:
        from lightning_mm.core.context_parallel import (
            context_parallel_loss,
            shift_labels,
            split_sequence,
            ulysses_attention,
        )

        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        targets = shift_labels(labels)  # shifted over the whole sequence, then split
        if group is not None:
            input_ids, positions = split_sequence(input_ids, 1, group), split_sequence(positions, 1, group)
            targets = split_sequence(targets, 1, group, pad_value=-100)
        x = self.embed(input_ids) + self.pos(positions)
        local = x.shape[1]
        q, k, v = self.qkv(self.norm(x)).view(batch, local, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        out = ulysses_attention(attention, q, k, v, group) if group is not None else attention(q, k, v)
        logits = self.head(x + self.proj(out.transpose(1, 2).reshape(batch, local, -1)))
        if group is not None:
            return context_parallel_loss(logits, targets, group)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def qwen3_provider() -> torch.nn.Module:
    """The tiny Qwen3 (4 heads, 2 key/value heads), for ``lightning-mm plan`` in the tests."""
    from tests.scenarios.hf_scenarios import tiny_hf_model

    return tiny_hf_model("qwen3")


def qwen3_5_provider() -> torch.nn.Module:
    """The tiny Qwen3.5 (a Gated DeltaNet layer, then full attention), for ``lightning-mm plan`` in the tests."""
    from tests.helpers.packing_families import tiny_packing_model

    return tiny_packing_model("qwen3_5")


def qwen3_datasets() -> tuple[Any, None, None]:
    return CPData("qwen3", 16), None, None


def _fit(
    case: CPCase, cp: int, ckptdir: Path, outdir: Path, max_steps: int, devices: int, ckpt_path: str | None = None
) -> tuple[dict[str, Any], Any]:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    record: dict[str, Any] = {"losses": [], "indices": [], "steps": [], "positions": []}

    class Module(MMLightningModule):
        handles_context_parallel = case.custom

        def model_provider(self) -> torch.nn.Module:
            if case.custom:
                return TinyAttentionLM()
            return TransformersModel({"init_from_hf_path": str(ckptdir / case.family)})

        def forward_step(self, batch: dict[str, torch.Tensor]) -> Any:
            if case.custom:
                return self.model(**batch, group=self.context_parallel_group)
            return super().forward_step(batch)

        def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            batch = dict(batch)
            record["indices"].append(batch.pop("index").tolist())
            return model_inputs(batch)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            record["losses"].append(float(loss.detach()))
            record["steps"].append(self.trainer.global_step)
            return loss

        def on_fit_start(self) -> None:
            if not case.custom:  # the positions (and so the tokens) each rank's decoder layers see
                from lightning_mm.hf.cp_attention import find_hf_model

                hf: Any = find_hf_model(self.model)

                def seen(_: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
                    positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
                    record["positions"].append(positions.tolist())

                hf.get_decoder().rotary_emb.register_forward_pre_hook(seen, with_kwargs=True)
            initial = _gathered(self.model)  # a collective
            if self.trainer.global_rank == 0 and ckpt_path is None:
                torch.save(initial, outdir / f"{case.name}.init.pt")

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if self.trainer.global_step == 0 and ckpt_path is None:  # a collective: every rank
                grads = {n: _full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
                if self.trainer.global_rank == 0:
                    torch.save(grads, outdir / f"{case.name}.grad.pt")

    torch.manual_seed(0)
    module = Module(lr=LR, log_grad_norm=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
        log_every_n_steps=1,  # the ThroughputMonitor averages over 2 batches: enough steps here to report rates
        strategy=MMFSDP2Strategy({"sharding_size": "auto", **case.fsdp2}, context_parallel_size=cp),
    )
    loader = torch.utils.data.DataLoader(
        CPData(case.data_family, case.seq_len, left_pad=case.left_pad),
        batch_size=GLOBAL_BATCH * cp // devices,
        collate_fn=packed_collate if case.packed else None,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return record, (trainer, module)


def _finish(case: CPCase, outdir: Path, parts: list[dict[str, Any]], trainer: Any, module: Any) -> None:
    final = _gathered(module.model)
    if trainer.global_rank == 0:
        torch.save(final, outdir / f"{case.name}.pt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    _dump(
        case,
        outdir,
        trainer.global_rank,
        {"parts": parts, "error": None, "metrics": metrics, "throughput": _throughput(trainer)},
    )


def _throughput(trainer: Any) -> dict[str, float]:
    """What MMLightningModule's ThroughputMonitor computes for training at the end (global and per-device rates)."""
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.trainer.states import RunningStage

    from lightning_mm._compat import throughput_meters

    if trainer.global_rank != 0:  # Lightning's monitor measures on rank 0 only
        return {}
    try:  # an error here must not leave the other ranks waiting for this one
        monitor = next(c for c in trainer.callbacks if isinstance(c, ThroughputMonitor))
        return {k: float(v) for k, v in throughput_meters(monitor)[RunningStage.TRAINING].compute().items()}
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": repr(err)}


def _run(case: CPCase, outdir: Path, ckptdir: Path, devices: int) -> None:
    if case.resume_at is None:
        record, (trainer, module) = _fit(case, case.cp, ckptdir, outdir, case.steps, devices)
        _finish(case, outdir, [record], trainer, module)
        return
    first, (trainer, _) = _fit(case, case.cp, ckptdir, outdir, case.resume_at, devices)
    trainer.save_checkpoint(outdir / f"{case.name}.ckpt")
    second, (trainer, module) = _fit(
        case, case.resume_cp, ckptdir, outdir, case.steps, devices, ckpt_path=str(outdir / f"{case.name}.ckpt")
    )
    _finish(case, outdir, [first, second], trainer, module)


def _error_case(case: CPCase, outdir: Path, ckptdir: Path, devices: int) -> None:
    """A setting that must fail at setup: record the error (last, as the failed run ends the process group)."""
    try:
        _fit(case, case.cp, ckptdir, outdir, case.steps, devices)
        error = None
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        error = f"{type(err).__name__}: {err}"
    import os

    _dump(case, outdir, int(os.environ.get("LOCAL_RANK", 0)), {"parts": [], "error": error})


def _predict_refused(outdir: Path, ckptdir: Path) -> None:
    """``trainer.predict`` with context parallel 2: refused at setup (last: the failed run ends the process group)."""
    import os

    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel({"init_from_hf_path": str(ckptdir / "qwen3")})

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=outdir,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", "context_parallel_size": 2}),  # the YAML key
    )
    try:
        trainer.predict(Module(), torch.utils.data.DataLoader(CPData("qwen3", 16), batch_size=1))
        error = None
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        error = f"{type(err).__name__}: {err}"
    (outdir / f"predict-cp2.rank{os.environ.get('LOCAL_RANK', 0)}.json").write_text(json.dumps({"error": error}))


@scenario
def two(outdir: Path, ckptdir: str) -> None:
    ckptdir = Path(ckptdir)
    for case in [*TWO_RANK_CASES, *RESUME_CASES]:
        _run(case, outdir, ckptdir, 2)
    _predict_refused(outdir, ckptdir)


@scenario
def four(outdir: Path, ckptdir: str) -> None:
    ckptdir = Path(ckptdir)
    for case in FOUR_RANK_CASES:
        _run(case, outdir, ckptdir, 4)
    _error_case(BAD_CASE, outdir, ckptdir, 4)


if __name__ == "__main__":
    scenario_kit.main()
