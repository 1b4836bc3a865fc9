"""The chunked cross-entropy (issue #25, item 3): equal to the full loss, and no ``[tokens, vocab]`` tensor.

* :func:`lightning_mm.core.chunked_loss.linear_cross_entropy` against ``cross_entropy`` of the full logits (fp32,
  relative 1e-6), with ignored targets, a bias, several linear terms and an explicit normaliser;
* ``TransformersModel(enable_chunk_loss=True)`` against the plain Transformers model's own loss, in one process:
  loss and every parameter's gradient relative 1e-6 for Qwen3, Llama with tied embeddings and Qwen2.5-VL, and
  LoRA on the head (with dropout) against the same LoRA model unchunked; ``MMLightningModule(enable_chunk_loss)``
  with a plain Transformers model;
* the largest allocation during forward and backward (torch's profiler, CPU memory events) stays below a
  ``tokens x vocab`` float32 tensor with the chunked loss, and reaches it without;
* 2 ranks (``tests/scenarios/chunkloss_scenarios.py``, one launch): MMFSDP2Strategy with the chunked loss equals,
  step by step, the one-process plain Transformers reference of ``tests/helpers/parity.py`` (output layer as a unit,
  tied with the embeddings, in the root; Qwen2.5-VL), and LoRA on the head against the same adapters unchunked in one
  process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mm.core.chunked_loss import ChunkedLossError, linear_cross_entropy
from tests.helpers.parity import (
    batch_of,
    global_losses,
    global_steps,
    noise_fraction,
    reference_run,
    relative_errors,
    weight_errors,
)
from tests.helpers.scenario_kit import run
from tests.scenarios import chunkloss_scenarios
from tests.scenarios.hf_scenarios import FAMILIES, save_tiny_checkpoints

TIGHT = 1e-6
FP32_LOSS, FP32_WEIGHTS, NOISE_SHARE = 1e-5, 3e-4, 1e-2  # tests/test_parity.py's fp32 tolerances


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------ the math
@pytest.mark.parametrize("num_items", [None, 23.0])
def test_linear_cross_entropy_equals_the_full_computation(num_items):
    g = torch.Generator().manual_seed(0)
    tokens, width, vocab, rank = 37, 16, 50, 4
    x = torch.randn(2, tokens, width, generator=g, requires_grad=True)
    w = torch.randn(vocab, width, generator=g, requires_grad=True)
    bias = torch.randn(vocab, generator=g, requires_grad=True)
    x2 = torch.randn(2, tokens, rank, generator=g, requires_grad=True)  # a second term, as LoRA's adapters add
    w2 = torch.randn(vocab, rank, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (2, tokens), generator=g)
    targets[0, :5] = -100
    inputs = [x, w, bias, x2, w2]
    loss = linear_cross_entropy([x, x2], [w, w2], targets, bias=bias, chunk_size=8, num_items=num_items)
    grads = torch.autograd.grad(loss * 3, inputs)
    logits = x @ w.T + x2 @ w2.T + bias
    full = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab), targets.reshape(-1), reduction="mean" if num_items is None else "sum"
    )
    full = full if num_items is None else full / num_items
    expected = torch.autograd.grad(full * 3, inputs)
    assert _rel(loss.detach(), full.detach()) < TIGHT
    for got, want in zip(grads, expected):
        assert _rel(got, want) < TIGHT


def test_linear_cross_entropy_without_grad_and_bad_inputs():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, chunk_size=3)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(x @ w.T, t))
    with pytest.raises(ChunkedLossError, match="do not fit"):
        linear_cross_entropy(x, w, t[:3])
    with pytest.raises(ChunkedLossError, match="chunk_size"):
        linear_cross_entropy(x, w, t, chunk_size=0)


# --------------------------------------------------------------------------------------- one process, real models
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("chunk") / "ckpts"  # the 2-rank scenario reads them from OUTDIR/ckpts
    save_tiny_checkpoints(directory, ["qwen3", "llama_tied", "qwen2_5_vl"])
    return directory


def _batch(family: str) -> dict[str, torch.Tensor]:
    batch = batch_of(family, [0, 1])
    batch["labels"][0, :4] = -100  # prompt tokens without loss
    return batch


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], seed: int = 0):
    torch.manual_seed(seed)  # LoRA dropout draws the same mask on both sides
    out = model(**batch)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(out.loss, list(params.values()), allow_unused=True)
    return out, {n: g for n, g in zip(params, grads) if g is not None}


def _compare(out, grads, ref_out, ref_grads) -> None:
    assert out.logits is None and ref_out.logits is not None  # the chunked path ran; the reference formed logits
    assert _rel(out.loss.detach(), ref_out.loss.detach()) < TIGHT, (float(out.loss), float(ref_out.loss))
    assert grads.keys() == ref_grads.keys()
    worst = max((_rel(grads[n], ref_grads[n]), n) for n in ref_grads if ref_grads[n].norm() > 0)
    assert worst[0] < TIGHT, worst


@pytest.mark.parametrize("family", ["qwen3", "llama_tied", "qwen2_5_vl"])
def test_transformers_model_chunked_loss_equals_plain_transformers(ckpts, family):
    import transformers

    from lightning_mm.modules import TransformersModel

    reference = getattr(transformers, FAMILIES[family][0]).from_pretrained(str(ckpts / family), dtype=torch.float32)
    model = TransformersModel(
        {"init_from_hf_path": str(ckpts / family), "enable_chunk_loss": True, "chunk_loss_size": 5}
    )
    if family == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = _batch(family)
    _compare(*_loss_and_grads(model.train(), batch), *_loss_and_grads(reference.train(), batch))


def test_lora_on_the_head_chunked_equals_unchunked(ckpts):
    from lightning_mm.modules import TransformersModel

    lora = {
        "rank": 4,
        "alpha": 8,
        "dropout": 0.1,
        "init_lora_weights": "gaussian",
        "target_modules": ["lm_head", "model.layers.{*}.self_attn.q_proj"],
    }
    config = {"init_from_hf_path": str(ckpts / "qwen3"), "lora": lora}
    model = TransformersModel({**config, "enable_chunk_loss": True, "chunk_loss_size": 7}).train()
    reference = TransformersModel(config).train()
    assert type(model.lm_head).__name__ == "Linear" and hasattr(model.lm_head, "lora_A")
    out, grads = _loss_and_grads(model, _batch("qwen3"))
    assert any("lm_head.lora_B" in n for n in grads)
    _compare(out, grads, *_loss_and_grads(reference, _batch("qwen3")))


def test_lightning_module_default_loss_is_chunked(ckpts):
    import transformers

    from lightning_mm import MMLightningModule

    def plain() -> torch.nn.Module:
        return transformers.Qwen3ForCausalLM.from_pretrained(str(ckpts / "qwen3"), dtype=torch.float32).train()

    module = MMLightningModule(model_provider=plain, enable_chunk_loss=True, chunk_loss_size=6, log_throughput=False)
    module.configure_model()
    batch = _batch("qwen3")
    loss, _ = module.compute_loss(batch)
    assert module.forward_step(batch).logits is None  # the chunked path ran
    reference = plain()
    expected = reference(**batch).loss
    assert _rel(loss.detach(), expected.detach()) < TIGHT
    with pytest.raises(ValueError, match="chunk_loss_size"):
        MMLightningModule(enable_chunk_loss=True, chunk_loss_size=0)


def test_bad_chunk_loss_config_is_named(ckpts):
    from lightning_mm.hf.transformers_model import TransformersModelConfigError
    from lightning_mm.modules import TransformersModel

    path = str(ckpts / "qwen3")
    with pytest.raises(TransformersModelConfigError, match="`enable_chunk_loss`"):
        TransformersModel({"init_from_hf_path": path, "enable_chunk_loss": "yes"})
    with pytest.raises(TransformersModelConfigError, match="`chunk_loss_size`"):
        TransformersModel({"init_from_hf_path": path, "enable_chunk_loss": True, "chunk_loss_size": -1})
    with pytest.raises(TransformersModelConfigError, match="chunk_loss_siz"):
        TransformersModel({"init_from_hf_path": path, "chunk_loss_siz": 8})
    model = TransformersModel({"init_from_hf_path": path, "enable_chunk_loss": True})
    with pytest.raises(ChunkedLossError, match="logits_to_keep"):
        model(**_batch("qwen3"), logits_to_keep=1)


def test_context_parallelism_with_the_chunked_loss_is_refused(ckpts):
    from lightning_mm.core.context_parallel import ContextParallelError
    from lightning_mm.hf.cp_attention import enable_context_parallel
    from lightning_mm.modules import TransformersModel

    model = TransformersModel({"init_from_hf_path": str(ckpts / "qwen3"), "enable_chunk_loss": True})
    with pytest.raises(ContextParallelError, match="enable_chunk_loss"):
        enable_context_parallel(model, group=None)  # refused before any collective


# ------------------------------------------------------------------------------------------------ memory
def _largest_allocation(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """The largest single CPU allocation (bytes) during the model's forward and backward (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(**batch).loss.backward()
    return max(e.self_cpu_memory_usage for e in prof.events())  # what each op itself allocated


def test_no_tokens_by_vocab_tensor_in_forward_or_backward():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lightning_mm.hf.chunk_loss import enable_chunk_loss

    vocab, width, seq = 2048, 16, 64
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    full, chunked = Qwen3ForCausalLM(config).train(), Qwen3ForCausalLM(config).train()
    chunk = 16
    enable_chunk_loss(chunked, chunk)
    ids = torch.randint(0, vocab, (2, seq))
    batch = {"input_ids": ids, "labels": ids}
    logits_bytes = 2 * seq * vocab * 4  # one [tokens, vocab] float32 tensor
    assert _largest_allocation(full, batch) >= logits_bytes  # the measure sees the full logits
    largest = _largest_allocation(chunked, batch)
    # At most one chunk of logits, or a weight-sized tensor (the head's gradient), whichever is larger.
    assert largest <= max(chunk * vocab, vocab * width) * 4 < logits_bytes, largest


# ------------------------------------------------------------------------------------------------ 2 ranks
@pytest.fixture(scope="module")
def trained(ckpts) -> Path:
    out = ckpts.parent
    run(chunkloss_scenarios.all_cases, out, timeout=600)
    return out


def _scenario_cases():
    from tests.scenarios.chunkloss_scenarios import CASES

    return CASES


def _lora_reference(case, steps, ckpts: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The LoRA case's reference: the same adapters unchunked (PEFT on plain Transformers), one process, the same
    AdamW over the same global batches (each micro-batch: the mean of the ranks' losses)."""
    from lightning_mm.modules import TransformersModel
    from tests.helpers.parity import LR
    from tests.scenarios.chunkloss_scenarios import model_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = TransformersModel(model_config(case, ckpts, chunked=False)).train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        losses = []
        for micro in steps:
            for ranks in micro:
                group = []
                for indices in ranks:
                    loss = model(**batch_of(case.family, indices)).loss
                    (loss / (len(ranks) * case.accumulate)).backward()
                    group.append(float(loss.detach()))
                losses.append(sum(group) / len(group))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", _scenario_cases(), ids=lambda c: c.name)
def test_two_ranks_chunked_equal_plain_transformers(trained, ckpts, case):
    ranks = [json.loads((trained / f"{case.name}.rank{r}.json").read_text()) for r in range(2)]
    errors = [r["error"] for r in ranks if r["error"]]
    assert not errors, errors[0]
    part = [r["parts"][0] for r in ranks]
    assert all(all(p["no_logits"]) and p["no_logits"] for p in part), "the chunked loss did not run"
    final = torch.load(trained / f"{case.name}.pt", weights_only=True)
    if "-lora-" in case.name:
        losses, expected = _lora_reference(case, global_steps(case, part), ckpts)
        assert max(relative_errors(global_losses(part), losses)) <= FP32_LOSS, (global_losses(part), losses)
        worst = max((_rel(final[n], expected[n]), n) for n in expected if "lora_" in n)
        assert worst[0] <= FP32_WEIGHTS, worst
        return
    ref = reference_run(case, global_steps(case, part), ckpts / case.family)
    errors = relative_errors(global_losses(part), ref.losses)
    assert max(errors) <= FP32_LOSS, (global_losses(part), ref.losses)
    worst = sorted(weight_errors(final, ref).items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= FP32_WEIGHTS, worst
    assert noise_fraction(ref) <= NOISE_SHARE
