"""Padding-free packing (issue #25): a packed row trains exactly as its samples unpacked.

For Qwen3 (sdpa and eager), Qwen2.5-VL and Qwen3-VL (images of different sizes in one packed row, and a sample
without an image), built by ``TransformersModel`` from a saved checkpoint, the packed row's loss and gradients
equal plain Transformers' on the same samples as a padded batch (its own positions and masks), and each
sample's loss taken from the packed logits equals that sample run alone (fp32, relative 1e-5); also with LoRA
and recomputed layers. A custom model that keeps samples apart with
:func:`~lightning_mm.core.packed_rows.block_causal_mask` equals its per-sample runs. The batch check refuses packed
batches that Transformers would get wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mm.core.packed_rows import IGNORE_INDEX, PackedCollator, block_causal_mask, packed_lengths, segment_ids
from lightning_mm.hf.batch_check import BatchCheckError
from lightning_mm.hf.chat_collate import TOKEN_KEYS, ChatCollator
from tests.helpers import packing_families, qwen3_vl_family
from tests.helpers.moe_models import tiny_moe_model
from tests.scenarios.hf_scenarios import IMAGE_TOKEN, VOCAB, tiny_hf_model

PATCH = 3 * 2 * 14 * 14
VISION_START, VISION_END, VIDEO_TOKEN = 7, 8, 6
RTOL = 1e-5
LORA = {
    "rank": 4,
    "alpha": 8,
    "target_modules": [
        "model.language_model.layers.{*}.self_attn.q_proj",
        "model.language_model.layers.{*}.self_attn.v_proj",
    ],
    "init_lora_weights": "gaussian",
}
LORA_OF = {  # Qwen3.5: layer 0 is linear attention (adapters on its projections too), layer 1 full attention
    "qwen3_5": {
        **LORA,
        "target_modules": [
            "model.language_model.layers.1.self_attn.q_proj",
            "model.language_model.layers.0.linear_attn.in_proj_qkv",
        ],
    }
}


def _text_sample(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(10, VOCAB, (n,), generator=g)
    labels = ids.clone()
    labels[1 : 1 + n // 3] = IGNORE_INDEX  # a prompt without targets (the first label stays, as in plain text)
    return {"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.long), "labels": labels}


def _vlm_sample(g: torch.Generator, n: int, grids: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    sample = _text_sample(g, n)
    ids, labels = sample["input_ids"], sample["labels"]
    at = 1
    for grid in grids:
        tokens = grid[0] * grid[1] * grid[2] // 4
        ids[at], ids[at + 1 : at + 1 + tokens], ids[at + 1 + tokens] = VISION_START, IMAGE_TOKEN, VISION_END
        at += tokens + 3
    labels[ids == IMAGE_TOKEN] = IGNORE_INDEX
    sample["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
    if grids:
        sample["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in grids), PATCH, generator=g)
        sample["image_grid_thw"] = torch.tensor(grids)
    return sample


def _fixed_size_sample(g: torch.Generator, n: int, images: int, tokens: int) -> dict[str, torch.Tensor]:
    """LLaVA / InternVL: ``images`` 28x28 images ``(N, 3, 28, 28)``, each ``tokens`` placeholders from token 2 on."""
    sample = _text_sample(g, n)
    sample["input_ids"][2 : 2 + images * tokens] = IMAGE_TOKEN
    sample["labels"][sample["input_ids"] == IMAGE_TOKEN] = IGNORE_INDEX
    if images:
        sample["pixel_values"] = torch.randn(images, 3, 28, 28, generator=g)
    return sample


TEXT_FAMILIES = ("qwen3", "mistral_sliding", "qwen3_moe", "qwen3_next")
FIXED_SIZE_TOKENS = {"llava": 4, "internvl": 1}  # per 28x28 image: 2x2 patches; InternVL pixel-shuffled 0.5


def samples_of(family: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    if family in TEXT_FAMILIES:
        return [_text_sample(g, n) for n in (11, 5, 17)]
    if family in FIXED_SIZE_TOKENS:  # 1, 0 and 2 images
        tokens = FIXED_SIZE_TOKENS[family]
        return [_fixed_size_sample(g, n, k, tokens) for n, k in ((13, 1), (6, 0), (19, 2))]
    # Images of 1, 4 and 2 tokens (grids 2x2, 4x4, 2x4 patches), and a sample without one, in one row.
    return [_vlm_sample(g, 14, [(1, 4, 4)]), _vlm_sample(g, 7, []), _vlm_sample(g, 20, [(1, 2, 4), (1, 2, 2)])]


def plain_model(family: str) -> nn.Module:
    if family == "qwen3_vl":
        return qwen3_vl_family.tiny_qwen3_vl(seed=3)
    if family in packing_families.FAMILIES:
        return packing_families.tiny_packing_model(family, seed=3)
    if family == "qwen3_vl_moe":
        return tiny_moe_model(family, seed=3)
    return tiny_hf_model(family, seed=3)


def built_model(family: str, directory: Path, attn: str, lora: bool = False) -> nn.Module:
    from lightning_mm.hf.transformers_model import TransformersModel

    plain_model(family).save_pretrained(directory)
    config: dict[str, Any] = {"init_from_hf_path": str(directory), "hf_config": {"attn_implementation": attn}}
    if lora:
        config["lora"] = dict(LORA_OF.get(family, LORA))
    return TransformersModel(config)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), _grads(model)


def _sample_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's mean next-token loss: ``logits`` ``(1, T, V)`` of one sample."""
    return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=IGNORE_INDEX)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= RTOL * max(float(b.abs().max()), 1e-12)


def _assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every gradient within relative 1e-5. A key bias adds the same amount to all scores of a query, which softmax
    cancels: its true gradient is zero and the computed one rounding noise (1e-9), so it is compared against the
    model's largest gradient instead."""
    assert got.keys() == want.keys() and got
    largest = max(float(g.abs().max()) for g in want.values())

    def same(n: str) -> bool:
        if n.endswith("k_proj.bias"):
            return float((got[n] - want[n]).abs().max()) <= RTOL * largest
        return _close(got[n], want[n])

    bad = [n for n in want if not same(n)]
    assert not bad, f"gradients differ: {bad[:5]}"


CASES = [
    ("qwen3", "sdpa", False),  # dense attention
    ("qwen3", "eager", False),
    ("mistral_sliding", "sdpa", False),  # sliding-window attention
    ("qwen3_moe", "sdpa", False),  # MoE
    ("qwen3_next", "sdpa", False),  # Gated DeltaNet (linear attention, causal conv1d) + MoE, run once per sample
    ("qwen2_5_vl", "sdpa", False),
    ("qwen3_vl", "sdpa", False),
    ("qwen3_5", "sdpa", False),  # Gated DeltaNet in a VLM, images in the packed row
    ("qwen3_5_moe", "sdpa", False),
    ("qwen3_vl_moe", "sdpa", False),
    ("llava", "sdpa", False),
    ("internvl", "sdpa", False),
    ("qwen2_5_vl", "sdpa", True),
    ("qwen3_5", "sdpa", True),
]


@pytest.mark.parametrize(
    ("family", "attn", "lora_and_recompute"),
    CASES,
    ids=[f"{f}-{a}" + ("-lora-recompute" if x else "") for f, a, x in CASES],
)
def test_packed_row_equals_plain_transformers_unpacked(
    tmp_path: Path, family: str, attn: str, lora_and_recompute: bool
) -> None:
    from lightning_mm.core.recompute import checkpointed_forward
    from lightning_mm.hf.lora import apply_lora

    samples = samples_of(family)
    packed_model = built_model(family, tmp_path / family, attn, lora=lora_and_recompute).train()
    reference = plain_model(family)
    reference.config._attn_implementation = attn
    if lora_and_recompute:
        apply_lora(reference, dict(LORA_OF.get(family, LORA)))  # the same adapters (weights copied below)
        for i, layer in enumerate(packed_model.get_decoder().layers):
            layer.forward = checkpointed_forward(layer.forward, False, f"layers.{i}")
    reference.load_state_dict(packed_model.state_dict())
    assert_packed_equals_unpacked(packed_model, reference.train(), samples)


def assert_packed_equals_unpacked(
    packed_model: nn.Module, reference: nn.Module, samples: list[dict[str, Any]], collate: Any = None
) -> None:
    """``samples`` packed into one row (by ``collate``, a :class:`PackedCollator`) train ``packed_model`` exactly as
    plain Transformers (``reference``, the same weights) trains them as a padded batch: loss and every gradient;
    and each sample's loss from the packed logits equals that sample run alone (fp32, relative 1e-5)."""
    packed = (collate or PackedCollator())(samples)
    assert packed["input_ids"].shape == (1, sum(len(s["input_ids"]) for s in samples))
    assert "attention_mask" not in packed and packed_lengths(packed["position_ids"]) == [
        [len(s["input_ids"]) for s in samples]
    ]
    loss, logits, grads = _run(packed_model, packed)

    padded = ChatCollator(pad_token_id=0)(samples)  # plain Transformers, unpacked: its own positions and masks
    ref_loss, _, ref_grads = _run(reference, padded)
    assert _close(loss, ref_loss), (float(loss), float(ref_loss))
    _assert_grads_equal(grads, ref_grads)

    start = 0
    with torch.no_grad():
        for sample in samples:  # each sample alone, in the packed model itself
            n = len(sample["input_ids"])
            alone = reference(**{k: v[None] if k in TOKEN_KEYS else v for k, v in sample.items()})
            want = _sample_losses(alone.logits, sample["labels"][None])
            got = _sample_losses(logits[:, start : start + n], sample["labels"][None])
            assert _close(got, want), (float(got), float(want))
            start += n


def test_first_token_of_a_sample_is_never_a_target() -> None:
    samples = [{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}, {"input_ids": [6, 7], "labels": [6, 7]}]
    batch = PackedCollator()(samples)
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 4, 5, IGNORE_INDEX, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert segment_ids(batch["position_ids"]).tolist() == [[0, 0, 0, 1, 1]]


def test_packing_refuses_padded_samples_and_unknown_keys() -> None:
    from lightning_mm.core.packed_rows import PackingError

    with pytest.raises(PackingError, match="sample 0 has padding"):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1, 2], "attention_mask": [1, 0]}])
    with pytest.raises(PackingError, match=r"\['images'\]"):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1, 2], "images": torch.zeros(3, 4, 4)}])
    stacked = PackedCollator(stack_keys=["images"])(
        [{"input_ids": [1], "labels": [1], "images": torch.zeros(3, 4, 4)} for _ in range(2)]
    )
    assert stacked["images"].shape == (2, 3, 4, 4)


# ------------------------------------------------------------------------------------- custom model
class TinyRopeLM(nn.Module):
    """A custom causal LM: rotary positions from ``position_ids``, sdpa with the packed block-diagonal mask."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, hidden // heads, 2) / (hidden // heads)))

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s)[None].expand(b, s)
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        freqs = position_ids[:, None, :, None].float() * self.inv_freq
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

        def rotate(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        attn = F.scaled_dot_product_attention(rotate(q), rotate(k), v, attn_mask=block_causal_mask(position_ids))
        logits = self.head(x + self.proj(attn.transpose(1, 2).reshape(b, s, -1)))
        return (
            F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            / (labels[:, 1:] != IGNORE_INDEX).sum()
        )


def test_custom_model_packed_equals_its_samples_alone() -> None:
    torch.manual_seed(0)
    model = TinyRopeLM()
    samples = [{k: v for k, v in s.items() if k != "attention_mask"} for s in samples_of("qwen3")]
    targets = sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in samples)

    batch = PackedCollator()(samples)
    loss = model(**batch)
    loss.backward()
    grads = _grads(model)

    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for sample in samples:  # each sample alone, no mask but the causal one, summed over all targets
        n = int((sample["labels"][1:] != IGNORE_INDEX).sum())
        part = model(sample["input_ids"][None], sample["labels"][None]) * n / targets
        part.backward()
        total = total + part.detach()
    assert _close(loss.detach(), total)
    _assert_grads_equal(grads, _grads(model))


# ------------------------------------------------------------------------------------- batch check
def test_batch_check_refuses_packed_batches_transformers_would_get_wrong(tmp_path: Path) -> None:
    from lightning_mm.hf.batch_check import check_batch
    from lightning_mm.hf.packed_inputs import packed_forward_inputs

    text = built_model("qwen3", tmp_path / "qwen3", "sdpa")
    packed = PackedCollator()(samples_of("qwen3"))
    with pytest.raises(BatchCheckError, match="use_cache=False"):
        check_batch(text, packed)  # Transformers would build a cache and then ignore the packing
    packed = packed_forward_inputs(text, packed)
    assert packed["use_cache"] is False
    check_batch(text, packed)
    with pytest.raises(BatchCheckError, match="has an attention_mask"):
        check_batch(text, {**packed, "attention_mask": torch.ones_like(packed["input_ids"])})
    left_padded = {
        "input_ids": torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }
    left_padded["position_ids"] = (left_padded["attention_mask"].cumsum(-1) - 1).masked_fill(
        left_padded["attention_mask"] == 0, 1
    )  # as generate() computes them: not a packed row
    check_batch(text, left_padded)
    assert packed_forward_inputs(text, left_padded) == left_padded
    with pytest.raises(BatchCheckError, match="cu_seq_lens_q.*read only by flash-attention"):
        check_batch(text, {**packed, "cu_seq_lens_q": torch.tensor([0, 11, 16, 33])})

    vlm = plain_model("qwen2_5_vl")  # not built by TransformersModel: 2-D packed positions reach the check
    vlm_packed = PackedCollator()(samples_of("qwen2_5_vl"))
    with pytest.raises(BatchCheckError, match="needs 4-D position_ids"):
        check_batch(vlm, {**vlm_packed, "use_cache": False})
    inputs = packed_forward_inputs(vlm, vlm_packed)
    assert inputs["position_ids"].shape == (4, 1, vlm_packed["input_ids"].shape[1])
    check_batch(vlm, inputs)


# ------------------------------------------------------------------------------------- videos
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def _video_sample(g: torch.Generator, n: int, grid: tuple[int, int, int], seconds: float) -> dict[str, torch.Tensor]:
    """A Qwen2.5-VL sample with one video of ``grid`` (its tokens in start/end, ``mm_token_type_ids`` 2)."""
    sample = _text_sample(g, n)
    ids, labels = sample["input_ids"], sample["labels"]
    tokens = grid[0] * grid[1] * grid[2] // 4
    ids[1], ids[2 : 2 + tokens], ids[2 + tokens] = VISION_START, VIDEO_TOKEN, VISION_END
    labels[ids == VIDEO_TOKEN] = IGNORE_INDEX
    sample["mm_token_type_ids"] = (ids == VIDEO_TOKEN).long() * 2
    sample["pixel_values_videos"] = torch.randn(grid[0] * grid[1] * grid[2], PATCH, generator=g)
    sample["video_grid_thw"] = torch.tensor([grid])
    sample["second_per_grid_ts"] = torch.tensor([seconds])
    return sample


def test_packed_videos_take_each_sample_seconds_per_grid_step(tmp_path: Path) -> None:
    """Qwen2.5-VL videos (2 and 3 temporal steps, 0.5 and 2 seconds per step) around a sample with an image: the
    packed row's M-RoPE positions use each sample's own ``second_per_grid_ts``, so the row trains exactly as plain
    Transformers on the padded samples."""
    g = torch.Generator().manual_seed(5)
    samples = [
        _video_sample(g, 16, (2, 2, 2), 0.5),
        _vlm_sample(g, 9, [(1, 2, 2)]),
        _video_sample(g, 15, (3, 2, 2), 2.0),
    ]
    model = built_model("qwen2_5_vl", tmp_path / "qwen2_5_vl", "sdpa").train()
    reference = plain_model("qwen2_5_vl")
    reference.load_state_dict(model.state_dict())
    reference.train()
    loss, _, grads = _run(model, PackedCollator()(samples))
    padded = ChatCollator(pad_token_id=0)([{k: v for k, v in s.items() if k not in VIDEO_KEYS} for s in samples])
    for key in VIDEO_KEYS:
        padded[key] = torch.cat([s[key] for s in samples if key in s])
    ref_loss, _, ref_grads = _run(reference, padded)
    assert _close(loss, ref_loss), (float(loss), float(ref_loss))
    _assert_grads_equal(grads, ref_grads)


# ------------------------------------------------------------------------------------- layers with sequence state
class RunningMean(nn.Module):
    """A token mixer of a kind the allow-list does not know: a running mean along the sequence (state)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        steps = torch.arange(1, hidden_states.shape[1] + 1, dtype=hidden_states.dtype)[None, :, None]
        return hidden_states.cumsum(1) / steps, None


def _meta(arch: str, **config: Any) -> nn.Module:
    import transformers

    cls = getattr(transformers, arch)
    with torch.device("meta"):
        return cls(cls.config_class(**config))


def test_packing_is_refused_by_layer_class_and_path_for_layers_with_sequence_state() -> None:
    """The batch check's allow-list: Mamba, a short convolution, a Gated DeltaNet without its per-sample path and
    an unknown mixer are refused by class and module path before the model computes; installed, Qwen3.5 passes."""
    from lightning_mm.hf.batch_check import check_batch
    from lightning_mm.hf.packed_inputs import install_packed_inputs, packed_forward_inputs

    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    small["intermediate_size"] = 64
    text: dict[str, Any] = {**PackedCollator()(samples_of("qwen3")), "use_cache": False}
    cases = [
        (
            _meta("JambaForCausalLM", **small, attn_layer_period=2, attn_layer_offset=1),
            r"model\.layers\.0\.mamba \(JambaMambaMixer\) carries state",
        ),
        (
            _meta("Lfm2ForCausalLM", **small, layer_types=["conv", "full_attention"]),
            r"model\.layers\.0 \(Lfm2DecoderLayer\) is of kind 'conv'",
        ),
        (plain_model("qwen3_next"), r"model\.layers\.0\.linear_attn \(Qwen3NextGatedDeltaNet\).*per-sample path"),
    ]
    unknown = plain_model("qwen3")
    unknown.model.layers[1].self_attn = RunningMean(unknown.model.layers[1].self_attn)
    cases.append((unknown, r"model\.layers\.1\.self_attn \(RunningMean\) is of a kind not proven"))
    for model, message in cases:
        with pytest.raises(BatchCheckError, match=message):
            check_batch(model, text)
        check_batch(model, {k: v for k, v in text.items() if k != "position_ids"})  # unpacked: trains

    qwen3_5 = plain_model("qwen3_5")
    vlm_packed = PackedCollator()(samples_of("qwen3_5"))
    with pytest.raises(BatchCheckError, match=r"language_model\.layers\.0\.linear_attn \(Qwen3_5GatedDeltaNet\)"):
        check_batch(qwen3_5, packed_forward_inputs(qwen3_5, vlm_packed))
    install_packed_inputs(qwen3_5)
    check_batch(qwen3_5, packed_forward_inputs(qwen3_5, vlm_packed))


def test_per_sample_path_leaves_left_padded_generation_alone() -> None:
    """Positions that skip a left-padded prompt's padding (as ``generate`` computes them) restart within a row but
    are one sample: Qwen3-Next with its per-sample path generates as plain Transformers does."""
    from lightning_mm.hf.packed_inputs import install_packed_inputs

    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    settings: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = plain_model("qwen3_next").generate(input_ids=ids, **settings)
    model = plain_model("qwen3_next")
    install_packed_inputs(model)
    assert torch.equal(model.generate(input_ids=ids, **settings), want)


STATEFUL = {  # architecture -> the layer the refusal names (Transformers' default config, built on the meta device)
    "MambaForCausalLM": r"backbone\.layers\.0 \(MambaBlock\)",
    "BambaForCausalLM": r"model\.layers\.0\.mamba \(BambaMixer\)",
    "Zamba2ForCausalLM": r"model\.layers\.0\.mamba \(Zamba2MambaMixer\)",
    "FalconH1ForCausalLM": r"model\.layers\.0 \(FalconH1DecoderLayer\) is of kind 'hybrid'",
    "GraniteMoeHybridForCausalLM": r"model\.layers\.0\.mamba \(GraniteMoeHybridMambaLayer\)",
    "NemotronHForCausalLM": r"model\.layers\.0 \(NemotronHBlock\) is of a kind not proven",
    "MiniMaxForCausalLM": r"model\.layers\.1\.self_attn \(MiniMaxLightningAttention\)",
    "KimiLinearForCausalLM": r"model\.layers\.0\.self_attn \(KimiLinearDeltaAttention\)",
    "RwkvForCausalLM": r"rwkv\.blocks\.0 \(RwkvBlock\)",
    "RecurrentGemmaForCausalLM": r"model\.layers\.0\.temporal_block \(RecurrentGemmaRecurrentBlock\)",
    "Llama4ForCausalLM": r"model\.layers\.0 \(Llama4TextDecoderLayer\) is of kind 'chunked_attention'",
}


def test_packing_refusal_names_each_listed_stateful_architecture() -> None:
    """The architectures docs/data.md lists as refused are refused, each naming the layer that carries state."""
    from lightning_mm.hf.packing_layers import packing_refusal

    for arch, message in STATEFUL.items():
        refusal = packing_refusal(_meta(arch))
        assert refusal is not None and re.search(message, refusal), (arch, refusal)


def test_two_rank_fsdp2_packed_qwen3_5_equals_plain_transformers(tmp_path: Path) -> None:
    """The per-sample Gated DeltaNet path under FSDP2 (sharded linear-attention units, recomputed decoder layers) on
    2 gloo ranks: the step's loss and gathered gradients equal plain Transformers on the padded samples; also under
    context parallel 2 (the layer on the whole sequence gathered over the group), packed and padded."""
    from tests.helpers.scenario_kit import run
    from tests.scenarios import packing_scenarios

    reference = plain_model("qwen3_5")
    reference.save_pretrained(tmp_path / "qwen3_5")
    run(packing_scenarios.stateful, tmp_path, timeout=300)
    got = torch.load(tmp_path / "qwen3_5.pt", weights_only=True)
    ref_loss, _, ref_grads = _run(reference.train(), ChatCollator(pad_token_id=0)(samples_of("qwen3_5")))
    assert _close(got["loss"], ref_loss), (float(got["loss"]), float(ref_loss))
    _assert_grads_equal(got["grads"], ref_grads)
    for tag in (".cp2", ".cp2-padded"):  # context parallel 2: Gated DeltaNet on the gathered whole sequence
        got = torch.load(tmp_path / f"qwen3_5{tag}.pt", weights_only=True)
        assert _close(got["loss"], ref_loss), (tag, float(got["loss"]), float(ref_loss))
        _assert_grads_equal(got["grads"], ref_grads)
