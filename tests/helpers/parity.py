"""Parity harness: a model trained by MMFSDP2Strategy on 2 ranks against plain Transformers + torch in one process.

A :class:`Case` names a model (a tiny random Hugging Face family of ``tests/scenarios/hf_scenarios.py``, saved with
``save_pretrained``, or :class:`TorchLayersLM` built from torch's own layers) and how it is trained. The 2-rank
side (``tests/scenarios/parity_scenarios.py``) trains it with the strategy and records, per rank and micro-batch, the
loss and the indices of the samples it saw, and the gathered final weights. :func:`reference_run` then trains a plain
one-process model with the same AdamW over the same global batches (each micro-batch: the mean of the ranks'
losses, as data parallelism averages gradients) and :func:`compare` checks losses and weights step by step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.helpers import qwen3_vl_family
from tests.helpers.moe_models import MOE_MODULES
from tests.scenarios.hf_scenarios import FAMILIES, VOCAB, FamilyData, model_inputs

LR = 5e-3
PER_RANK_BATCH = 2
SAMPLES = 12  # 3 global batches of 2 ranks x 2 samples per epoch

# Recomputed in the recompute cases: every decoder layer and every vision block.
RECOMPUTE = {
    "qwen2_5_vl": ["model.visual.blocks.{*}", "model.language_model.layers.{*}"],
    "internvl": ["model.vision_tower.encoder.layer.{*}", "model.language_model.layers.{*}"],
    "llava": ["model.vision_tower.encoder.layers.{*}", "model.language_model.layers.{*}"],
    "qwen3": ["model.layers.{*}"],
    "llama_tied": ["model.layers.{*}"],
    "qwen3_vl": qwen3_vl_family.RECOMPUTE,
}
QWEN3_VL = "qwen3_vl"  # not in hf_scenarios.FAMILIES: its batches are tests/helpers/qwen3_vl_family.py's
TORCH_LAYERS = "torch_layers"
EXTRA: dict[str, tuple[str, Callable[[int], torch.utils.data.Dataset]]] = {
    "qwen3_kv4": ("Qwen3ForCausalLM", lambda n: FamilyData("qwen3", n)),
}
"""Families other test modules add (``tests/helpers/derive_models.py``): name -> (architecture, dataset of ``n``
samples)."""


@dataclass(frozen=True)
class Case:
    """One training configuration: a model family, the FSDP2 YAML keys, and the Trainer settings."""

    name: str
    family: str
    fsdp2: dict[str, Any] = field(default_factory=dict)
    freeze: tuple[str, ...] = ()
    steps: int = 6
    accumulate: int = 1
    clip: float | None = None
    precision: str = "32-true"
    resume_at: int | None = None
    """Stop after this many optimizer steps, save a checkpoint, and resume from it for the rest."""
    lora: dict[str, Any] | None = None
    """``TransformersModel``'s ``lora`` block (targets: ``nn.Linear`` paths); the reference adapts the same layers
    with PEFT's ``get_peft_model`` after ``torch.manual_seed(0)``."""
    model: dict[str, Any] = field(default_factory=dict)
    """More ``TransformersModel`` keys (e.g. ``enable_chunk_loss``); the reference is plain Transformers whatever
    they say."""


def _recompute(family: str, reentrant: bool) -> dict[str, Any]:
    return {"recompute_modules": RECOMPUTE[family], "use_reentrant": reentrant}


TRAIN_CASES = [
    *[Case(f"{f}-plain", f) for f in RECOMPUTE if f != QWEN3_VL],  # qwen3_vl-resume trains it plain
    *[Case(f"{f}-recompute-reentrant", f, _recompute(f, True)) for f in RECOMPUTE],
    *[Case(f"{f}-recompute-nonreentrant", f, _recompute(f, False)) for f in ("qwen2_5_vl", "qwen3")],
    Case(
        "qwen3_vl-recompute-nonreentrant-frozen-tower", QWEN3_VL, _recompute(QWEN3_VL, False), freeze=("model.visual",)
    ),
    Case("internvl-trainable-ignored-tower", "internvl", {"ignored_modules": ["model.vision_tower"]}),
    Case("internvl-frozen-tower", "internvl", freeze=("model.vision_tower",)),
    Case("qwen3-accumulate-2", "qwen3", steps=4, accumulate=2),
    Case("qwen2_5_vl-clip", "qwen2_5_vl", clip=0.5),
    Case("llama_tied-bf16", "llama_tied", precision="bf16-mixed"),
    Case(
        "torch_layers-recompute",
        TORCH_LAYERS,
        {"sub_modules_to_wrap": ["encoder.layers.{*}"], "recompute_modules": ["encoder.layers.{*}"]},
    ),
]
RESUME_CASES = [
    Case("qwen3-resume", "qwen3", resume_at=3),
    # LLaVA's last vision layer gets no gradient (its output is not used): no AdamW state for its parameters.
    Case("llava-trainable-tower-resume", "llava", resume_at=3),
    Case("qwen3_vl-resume", QWEN3_VL, resume_at=3),
]
# On 4 ranks (tests/test_tensor_parallel.py): TP 2 inside, FSDP2 over the 2 data-parallel ranks; clipping on (a
# norm below the gradients' own, so that every step clips).
SP_PLAN = {
    **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
}
# Qwen2.5-VL: its language model split by its text config's own plan, the vision tower replicated over tp.
TP_CASES = [
    Case("qwen3-tp2-fsdp2-clip", "qwen3", {"tensor_parallel_size": 2}, clip=0.05),
    Case("qwen2_5_vl-tp2-fsdp2-clip", "qwen2_5_vl", {"tensor_parallel_size": 2}, clip=0.05),
    # Qwen3-MoE: attention TP 2 from its own plan, the experts split by EP 2 on their own (ep_replicate, ep) mesh
    # (the plan's expert entries left out), routers and norms replicated.
    Case(
        "qwen3_moe-tp2-ep2-clip",
        "qwen3_moe",
        {"tensor_parallel_size": 2, "expert_parallel_size": 2, "moe_modules": [MOE_MODULES["qwen3_moe"]]},
        clip=0.05,
    ),
    # Recomputed decoder layers: their TP'd linears' hooks run again in the recomputation.
    Case(
        "qwen3-tp2-recompute",
        "qwen3",
        {"tensor_parallel_size": 2, "recompute_modules": ["model.layers.{*}"], "use_reentrant": False},
        clip=0.05,
    ),
    # Compiled decoder layers (torch.compile, one graph each): the TP'd linears' DTensor hooks traced into the graphs.
    Case(
        "qwen3-tp2-compile",
        "qwen3",
        {"tensor_parallel_size": 2, "compile_modules": ["model.layers.{*}"]},
        clip=0.05,
    ),
    # Context parallelism, KV all-gather, over every other rank (CP groups (0, 2) and (1, 3)): TP splits the heads
    # locally, the keys/values of the local heads are gathered over the CP group; all 4 ranks read the same samples.
    Case(
        "qwen3-tp2-cp2-kv-allgather",
        "qwen3",
        {"tensor_parallel_size": 2, "context_parallel_size": 2, "context_parallel_algo": "kv_allgather"},
        clip=0.05,
    ),
    # Ulysses over the CP group of every other rank: each rank's 2 heads (of 4, TP 2) scattered over CP 2.
    Case(
        "qwen3_kv4-tp2-cp2-ulysses",
        "qwen3_kv4",
        {"tensor_parallel_size": 2, "context_parallel_size": 2, "context_parallel_algo": "ulysses"},
        clip=0.05,
    ),
    # Sequence parallelism: the decoder layers' norms split along the sequence (a YAML tp_plan in Transformers'
    # notation: Qwen3's own plan plus `sequence_parallel` norms).
    Case(
        "qwen3-tp2-sequence-parallel",
        "qwen3",
        {"tensor_parallel_size": 2, "tp_plan": SP_PLAN},
        clip=0.05,
    ),
    # LoRA on column-parallel (q, v, up) and row-parallel (o, down) layers: the adapters follow their base layer.
    Case(
        "qwen3-tp2-lora-recompute",
        "qwen3",
        {"tensor_parallel_size": 2, "recompute_modules": ["model.layers.{*}"], "use_reentrant": True},
        clip=0.01,
        lora={
            "rank": 4,
            "alpha": 8,
            "target_modules": [
                "model.layers.{*}.self_attn.q_proj",
                "model.layers.{*}.self_attn.v_proj",
                "model.layers.{*}.self_attn.o_proj",
                "model.layers.{1}.mlp.up_proj",
                "model.layers.{1}.mlp.down_proj",
            ],
        },
    ),
    # The chunked loss (chunks of 12 of the 30 targets per rank): the output layer column-parallel (the vocabulary
    # split over tp), the loss the vocabulary-parallel cross-entropy; the reference: Transformers' own loss.
    Case(
        "qwen3-tp2-chunked-loss",
        "qwen3",
        {"tensor_parallel_size": 2},
        clip=0.05,
        model={"enable_chunk_loss": True, "chunk_loss_size": 12},
    ),
]
# Saved at TP 2 x FSDP2 2 after 3 steps, resumed at TP 1 x FSDP2 4 (the same 4 ranks; DCP reshards).
# The same checkpoint also resumed at TP 4 x FSDP2 1: a Qwen3 with 4 key/value heads (TP 4 must divide them).
TP_RESUME = Case("qwen3-tp2-resume-tp1", "qwen3_kv4", {"tensor_parallel_size": 2}, clip=0.05, resume_at=3)
QWEN3_KV4 = {**FAMILIES["qwen3"][1], "num_key_value_heads": 4}
"""The config of ``TP_RESUME``'s family (``tests/test_tensor_parallel.py`` saves it)."""
CASES = {c.name: c for c in [*TRAIN_CASES, *RESUME_CASES, *TP_CASES, TP_RESUME]}


# ------------------------------------------------------------------------------------------- models and data
class TorchLayersLM(nn.Module):
    """A causal LM made only of torch's built-in layers (``nn.TransformerEncoder`` of ``TransformerEncoderLayer``,
    whose ``nn.MultiheadAttention`` initialises in ``_reset_parameters()``)."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        hidden = self.encoder(self.embed(input_ids), mask=mask, is_causal=True)
        logits = self.head(hidden)[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class IndexedData(torch.utils.data.Dataset):
    """``FamilyData`` samples with their index, so that each side can say which samples a step used."""

    def __init__(self, family: str, n: int = SAMPLES) -> None:
        if family == QWEN3_VL:
            self.data: torch.utils.data.Dataset = qwen3_vl_family.Qwen3VLData(n)
        elif family in EXTRA:
            self.data = EXTRA[family][1](n)
        else:
            self.data = FamilyData("llama_tied" if family == TORCH_LAYERS else family, n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**self.data[i], "index": torch.tensor(i)}


def batch_of(family: str, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    data = IndexedData(family)
    batch = torch.utils.data.default_collate([data[i] for i in indices])
    batch.pop("index")
    return model_inputs(batch)


def _freeze(model: nn.Module, patterns: Sequence[str]) -> None:
    from lightning_mm.core.patterns import resolve_patterns

    for path in resolve_patterns(model, list(patterns), "freeze"):
        model.get_submodule(path).requires_grad_(False)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


# --------------------------------------------------------------------------------------------- reference
def _plain_model(case: Case, ckpt: Path | None, initial: dict[str, torch.Tensor] | None) -> nn.Module:
    if case.family == TORCH_LAYERS:
        model = TorchLayersLM()
        assert initial is not None, "the torch-layers case starts from the strategy's gathered initial weights"
        model.load_state_dict(initial)
    else:
        import transformers

        assert ckpt is not None
        arch = (
            qwen3_vl_family.ARCH
            if case.family == QWEN3_VL
            else EXTRA[case.family][0]
            if case.family in EXTRA
            else FAMILIES[case.family][0]
        )
        model = getattr(transformers, arch).from_pretrained(str(ckpt), dtype=torch.float32)
    _freeze(model, case.freeze)
    if case.lora is not None:
        from peft import LoraConfig, get_peft_model

        from lightning_mm.core.patterns import resolve_patterns

        targets = resolve_patterns(model, list(case.lora["target_modules"]), "lora")
        torch.manual_seed(0)
        config = LoraConfig(r=case.lora["rank"], lora_alpha=case.lora["alpha"], target_modules=targets)
        model = get_peft_model(model, config)
    return model.train()


@dataclass
class Reference:
    losses: list[float]
    """Per micro-batch, the mean of the ranks' losses."""
    final: dict[str, torch.Tensor]
    """The trained parameters."""
    noise: dict[str, torch.Tensor]
    """Per parameter, the elements whose gradient was rounding noise at every step (see :data:`NOISE`)."""
    norms: list[float] = field(default_factory=list)
    """Per optimizer step with ``case.clip``: the gradient norm before clipping."""


NOISE = 1e-7
"""A gradient element at most this fraction of the step's largest gradient element is rounding noise: e.g. a key
bias without rotary embeddings, whose exact gradient is zero (softmax ignores a shift shared by all keys)."""


def reference_run(
    case: Case,
    steps: list[list[list[int]]],
    ckpt: Path | None = None,
    initial: dict[str, torch.Tensor] | None = None,
) -> Reference:
    """Train the plain model over ``steps`` (per micro-batch, the sample indices of each rank) in one process.

    Returns the loss of each micro-batch (mean over ranks), the final weights and their noise elements. With
    ``bf16-mixed`` the AdamW master weights stay fp32 and each step computes in a bf16 copy of them (buffers
    such as rotary tables stay fp32, as FSDP2 casts parameters only); each rank's gradients are taken in bf16
    and averaged in fp32, as FSDP2 does with ``reduce_dtype: fp32``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the same summation order in every run
    try:
        return _train_reference(case, steps, ckpt, initial)
    finally:
        torch.set_num_threads(threads)


def _train_reference(
    case: Case, steps: list[list[list[int]]], ckpt: Path | None, initial: dict[str, torch.Tensor] | None
) -> Reference:
    torch.manual_seed(0)
    master = _plain_model(case, ckpt, initial)
    named = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    small = {n: torch.ones_like(p, dtype=torch.bool) for n, p in named}
    moved = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in named}
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    bf16 = case.precision == "bf16-mixed"
    losses: list[float] = []
    norms: list[float] = []
    for micro in steps:
        compute = master
        if bf16:
            compute = copy.deepcopy(master)
            for p in compute.parameters():
                p.data = p.data.to(torch.bfloat16)
        compute_params = [p for p in compute.parameters() if p.requires_grad]
        for ranks in micro:
            group = []
            for indices in ranks:
                batch = batch_of(case.family, indices)
                if bf16:
                    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
                loss = _loss(compute, batch)
                # Lightning divides by `accumulate_grad_batches`, also on an epoch's shorter last step.
                scale = len(ranks) * case.accumulate
                grads = torch.autograd.grad(loss / scale, compute_params, allow_unused=True)
                group.append(float(loss.detach()))
                for p, g in zip(params, grads):
                    if g is not None:
                        g = g.float()
                        p.grad = g if p.grad is None else p.grad + g
            losses.append(sum(group) / len(group))
        largest = max(float(p.grad.abs().max()) for p in params if p.grad is not None)
        for n, p in named:
            if p.grad is not None:
                small[n] &= p.grad.abs() <= NOISE * largest
                moved[n] |= p.grad != 0
        if case.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, case.clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peft = "base_model.model."  # PEFT's prefix (LoRA cases); the strategy's names are the model's own
    final = {k.removeprefix(peft): v.detach().clone() for k, v in master.named_parameters()}
    noise = {n.removeprefix(peft): small[n] & moved[n] for n in small}  # no gradient at all: must not move either
    return Reference(losses, final, {n: m for n, m in noise.items() if m.any()}, norms)


# ------------------------------------------------------------------------------------------- comparison
def global_steps(case: Case, ranks: list[dict[str, Any]]) -> list[list[list[int]]]:
    """Per optimizer step, per micro-batch, the sample indices of each rank (from what the ranks recorded)."""
    per_micro = [list(group) for group in zip(*(r["indices"] for r in ranks))]
    step_of = ranks[0]["steps"]  # an epoch's last step may take fewer than `accumulate` micro-batches
    assert all(r["steps"] == step_of for r in ranks) and len(step_of) == len(per_micro)
    steps: list[list[list[int]]] = []
    for i, group in enumerate(per_micro):
        if i == 0 or step_of[i] != step_of[i - 1]:
            steps.append([])
        steps[-1].append(group)
    assert all(len(s) <= case.accumulate for s in steps)
    return steps


def global_losses(ranks: list[dict[str, Any]]) -> list[float]:
    """The loss of each micro-batch averaged over the ranks."""
    return [sum(values) / len(values) for values in zip(*(r["losses"] for r in ranks))]


def relative_errors(actual: Sequence[float], expected: Sequence[float]) -> list[float]:
    assert len(actual) == len(expected), f"{len(actual)} losses against {len(expected)} in the reference"
    return [abs(a - e) / abs(e) for a, e in zip(actual, expected)]


def weight_errors(actual: dict[str, torch.Tensor], ref: Reference) -> dict[str, float]:
    """Per tensor, ``|actual - expected| / |expected|`` (Frobenius norms, leaving out the reference's noise
    elements), over the reference's parameters."""
    missing = sorted(set(ref.final) - set(actual))
    assert not missing, f"weights missing from the trained model: {missing[:5]}"
    errors = {}
    for name, expected in ref.final.items():
        keep = ~ref.noise[name] if name in ref.noise else torch.ones_like(expected, dtype=torch.bool)
        a, e = actual[name].double()[keep], expected.double()[keep]
        errors[name] = float((a - e).norm() / e.norm().clamp_min(1e-12))
    return errors


def noise_fraction(ref: Reference) -> float:
    """The share of all parameter elements left out of the weight comparison as rounding noise."""
    total = sum(t.numel() for t in ref.final.values())
    return sum(int(m.sum()) for m in ref.noise.values()) / total
