"""FLOPs of one training step of a Transformers model, from its config and the batch (Lightning-free).

:class:`FlopCounter` reads a model's config (decoder LMs: Llama, Mistral, Qwen2, Qwen3, Gemma 3; Qwen2-MoE,
Qwen3-MoE, Qwen3-Next; the Qwen2.5-VL, Qwen3-VL (-MoE), Qwen3.5 (-MoE), GLM-4.1V and GLM-4.5V VLMs and the
Qwen2.5-Omni thinker (with its audio tower); InternVL, LLaVA, Gemma 3, Idefics3, SmolVLM, Mistral 3 over their ViT
towers), which of its weights train (all, a frozen tower, LoRA adapters from PEFT) and whether its blocks recompute,
and counts each batch with the formulas of :mod:`lightning_mm.core.flop_formulas`:

Counted ``model_type`` s: :data:`COUNTED_MODEL_TYPES`; any other is an :class:`UnsupportedFlopsModel` error.

* language model: per layer the ``q``/``k``/``v``/``o`` projections, attention over each sample's real length
  (a packed row's samples from its restarting ``position_ids``, a padded row's from ``attention_mask``; sliding
  window layers from ``layer_types``), the gated MLP, or for a MoE layer the router, ``top_k`` experts per token
  (``num_experts_per_tok``) and any shared expert; then the output layer over every token;
* vision tower: the patch embedding, per block ``qkv``, attention per image frame (Qwen2.5-VL: over each window of
  ``window_size`` pixels in the layers outside ``fullatt_block_indexes``, the edge windows clipped as the model
  clips them), ``proj`` and the MLP, then the merger (and Qwen3-VL's DeepStack mergers); a ViT tower (InternViT,
  CLIP, SigLIP) over ``(N, C, H, W)`` images: the patch embedding, per layer ``q``/``k``/``v``/``out``, attention
  per image (its class token included) and the MLP, the layers after ``vision_feature_layer`` forward only (no
  gradient reaches them); then the projector (its own trained or frozen part, ``multi_modal_projector``);
* LoRA: each adapted layer's ``A`` and ``B`` (trained, 3x forward) beside its frozen base (2x: only the gradient of
  its input; 1x while no gradient flows yet, e.g. a frozen tower);
* recomputation: each recomputed block's forward once more, in ``StepFlops.hardware`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mm.core.flop_formulas import (
    Block,
    Op,
    StepFlops,
    attention,
    linear,
    lora_ops,
    training_flops,
    window_lengths,
)
from lightning_mm.core.packed_rows import is_packed, segment_ids
from lightning_mm.errors import ConfigError, DataError

__all__ = [
    "COUNTED_MODEL_TYPES",
    "FlopCounter",
    "TowerTraining",
    "UnsupportedFlopsModel",
    "sample_lengths",
    "target_tokens",
]

# VLMs of a Qwen2-VL-style tower over flattened patches and ``image_grid_thw`` (GLM-4.1V/4.5V's too).
_QWEN_VLM_TYPES = (
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "glm4v_moe",
    "qwen2_5_omni_thinker",
    "qwen3_5",
    "qwen3_5_moe",
)
# VLMs of a ViT tower (a class token or none) over square images ``(N, C, H, W)`` and a projector into the LM.
_VIT_VLM_TYPES = ("internvl", "llava", "gemma3", "idefics3", "smolvlm", "mistral3")
_VLM_TYPES = _QWEN_VLM_TYPES + _VIT_VLM_TYPES
# Decoders whose layers are q/k/v/o attention and a gated MLP (or Qwen-style MoE): the formula below is theirs.
_TEXT_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gemma3_text",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
)
# Decoders of Gated DeltaNet and gated-query attention layers.
_HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_AUDIO_PREFIXES = ("audio_tower.",)
# ViT towers: whether they put a class token before the patches.
_VIT_CLASS_TOKEN = {
    "internvl_vision": True,
    "clip_vision_model": True,
    "siglip_vision_model": False,
    "idefics3_vision": False,
    "smolvlm_vision": False,
    "pixtral": False,
}
# Projectors that start with a norm of their own: when they train, their first linear layer's input takes a gradient.
_NORMED_PROJECTORS = ("internvl", "gemma3", "mistral3")
_VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "connector.")

COUNTED_MODEL_TYPES = _TEXT_TYPES + _VLM_TYPES


class UnsupportedFlopsModel(ConfigError):
    """The counter has no formula for this model's architecture."""


@dataclass(frozen=True)
class TowerTraining:
    """How one tower trains: its base weights, its LoRA adapters (leaf module name -> rank), recomputation of its
    blocks (``reentrant``: with ``checkpoint(use_reentrant=True)``, which replays the whole block)."""

    base: bool = True
    lora: Mapping[str, int] = field(default_factory=dict)
    recompute: bool = False
    reentrant: bool = False

    def block(self, stages: Sequence[tuple[Op, ...]], exact_tail: bool = True) -> Block:
        """A block of this tower (recomputed as the tower is)."""
        return Block(tuple(stages), self.recompute, self.reentrant, exact_tail)

    def linear(self, name: str, tokens: int, d_in: int, d_out: int) -> tuple[tuple[Op, ...], ...]:
        """The stages of one linear layer (its LoRA ``B`` as a stage of its own after it)."""
        base = linear(tokens, d_in, d_out, self.base)
        rank = self.lora.get(name)
        if rank is None:
            return ((base,),)
        a, b = lora_ops(tokens, d_in, d_out, rank)
        return ((base, a), (b,))

    def parallel(self, layers: Sequence[tuple[str, int, int]], tokens: int) -> tuple[tuple[Op, ...], ...]:
        """Linear layers reading the same input (``q``/``k``/``v``; ``gate``/``up``), then their LoRA ``B`` s."""
        first: list[Op] = []
        second: list[Op] = []
        for name, d_in, d_out in layers:
            stages = self.linear(name, tokens, d_in, d_out)
            first.extend(stages[0])
            if len(stages) > 1:
                second.extend(stages[1])
        return (tuple(first), tuple(second)) if second else (tuple(first),)


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is not None:
        return default
    raise UnsupportedFlopsModel(f"{type(config).__name__} has none of {list(names)}: no FLOP formula for it")


def _call(model: nn.Module, method: str) -> Any:
    function = getattr(model, method, None)
    return function() if callable(function) else None


def sample_lengths(batch: Mapping[str, Any]) -> list[int]:
    """The real lengths of the sequences of a batch's ``input_ids``: packed samples, unpadded rows."""
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.ndim != 2:
        raise DataError("a FLOP count needs the batch's 2-D `input_ids`")
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor):
        return [int(n) for n in mask.reshape(ids.shape[0], -1).sum(-1).tolist()]
    positions = batch.get("position_ids")
    if isinstance(positions, Tensor) and is_packed(positions):
        segments = segment_ids(positions).reshape(ids.shape[0], -1)
        return [int(n) for row in segments for n in torch.bincount(row).tolist() if n > 0]
    return [int(ids.shape[1])] * int(ids.shape[0])


def _rows(batch: Mapping[str, Any]) -> tuple[int, int]:
    ids = batch["input_ids"]
    return int(ids.shape[0]), int(ids.shape[1])


def target_tokens(batch: Any) -> int | None:
    """The tokens a batch trains on (``labels != -100``), ``None`` without ``labels``."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return int((labels != -100).sum()) if isinstance(labels, Tensor) else None


def _grids(batch: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    grids: list[tuple[int, int, int]] = []
    for key in ("image_grid_thw", "video_grid_thw"):
        value = batch.get(key)
        if isinstance(value, Tensor):
            grids.extend((int(t), int(h), int(w)) for t, h, w in value.reshape(-1, 3).tolist())
    return grids


@dataclass(frozen=True)
class FlopCounter:
    """Model and hardware FLOPs of a training step of one model, per batch (``counter(batch)``).

    Build it with :meth:`from_model` (reads what trains from the model's parameters and PEFT's LoRA layers), or
    directly from a config and :class:`TowerTraining` s. ``embed_trains``: the input embedding takes a gradient
    (so everything after it does); ``head_trains``: the output layer's weight does.
    """

    config: Any
    language: TowerTraining = field(default_factory=TowerTraining)
    vision: TowerTraining = field(default_factory=TowerTraining)
    embed_trains: bool = True
    head_trains: bool = True
    projector: TowerTraining = field(default_factory=TowerTraining)
    audio: TowerTraining = field(default_factory=TowerTraining)

    def __post_init__(self) -> None:
        self._text_config()  # unsupported architectures fail here, before training

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        recompute: bool = False,
        recompute_vision: bool | None = None,
        reentrant: bool = False,
    ) -> FlopCounter:
        """The counter of ``model`` (a Transformers model, PEFT-wrapped or not) as it trains now.

        ``recompute`` (``recompute_vision``, the same unless given): the language (vision) blocks recompute,
        ``reentrant``: with the reentrant checkpoint.
        """
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedFlopsModel(f"{type(model).__name__} has no Transformers `config`")
        trains = {"language": False, "vision": False, "projector": False, "audio": False}
        lora: dict[str, dict[str, int]] = {"language": {}, "vision": {}, "projector": {}, "audio": {}}
        embed = head = False
        inputs = _call(model, "get_input_embeddings")
        outputs = _call(model, "get_output_embeddings")
        for name, module in model.named_modules():
            ranks = getattr(module, "r", None)
            if hasattr(module, "lora_A") and isinstance(ranks, Mapping) and ranks:
                lora[_tower_of(name)][name.rsplit(".", 1)[-1]] = int(next(iter(ranks.values())))
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_" not in name:
                trains[_tower_of(name)] = True
        if isinstance(inputs, nn.Module):
            embed = any(p.requires_grad for p in inputs.parameters())
        if isinstance(outputs, nn.Module):
            head = any(p.requires_grad for n, p in outputs.named_parameters() if "lora_" not in n)
        recompute_vision = recompute if recompute_vision is None else recompute_vision
        return cls(
            config,
            TowerTraining(trains["language"], lora["language"], recompute, reentrant),
            TowerTraining(trains["vision"], lora["vision"], recompute_vision, reentrant),
            embed_trains=embed,
            head_trains=head,
            projector=TowerTraining(trains["projector"], lora["projector"]),
            audio=TowerTraining(trains["audio"], lora["audio"], recompute_vision, reentrant),
        )

    # ----------------------------------------------------------------------------------------------- configs
    def _text_config(self) -> Any:
        config = self.config
        model_type = getattr(config, "model_type", "")
        if model_type in _VLM_TYPES:
            text = config.text_config
            if model_type in _VIT_VLM_TYPES:  # a LM of its own choice (the Qwen VLMs' are theirs)
                if getattr(text, "model_type", "") not in _TEXT_TYPES:
                    raise UnsupportedFlopsModel(
                        f"no FLOP formula for the {model_type!r} language model {text.model_type!r}"
                    )
                self._vit_spec()
            return text
        if model_type not in _TEXT_TYPES:
            raise UnsupportedFlopsModel(
                f"no FLOP formula for model_type {model_type!r} (counted: {list(_TEXT_TYPES + _VLM_TYPES)})"
            )
        return config

    # ----------------------------------------------------------------------------------------------- counting
    def __call__(self, batch: Mapping[str, Any], backward: bool = True) -> StepFlops:
        """FLOPs of forward (and backward) over ``batch`` (a mapping with ``input_ids``, as the model takes)."""
        lengths = sample_lengths(batch)
        model_type = self.config.model_type
        vision_blocks: list[Block] = []
        unused: list[Block] = []  # tower layers after the one whose features are used: no gradient reaches them
        projector_blocks: list[Block] = []
        if model_type in _QWEN_VLM_TYPES:
            vision_blocks = self._vision_blocks(_grids(batch))
        elif model_type == "mistral3":
            vision_blocks, unused, projector_blocks = self._pixtral_blocks(batch.get("pixel_values"), batch)
        elif model_type in _VIT_VLM_TYPES:
            vision_blocks, unused, projector_blocks = self._vit_blocks(batch.get("pixel_values"))
        vision = training_flops(vision_blocks, inputs_need_grad=False, backward=backward)
        vision += training_flops(unused, inputs_need_grad=False, backward=False)
        vision_flows = self.vision.base or bool(self.vision.lora)
        norm_trains = model_type in _NORMED_PROJECTORS and self.projector.base
        projector = training_flops(projector_blocks, inputs_need_grad=vision_flows or norm_trains, backward=backward)
        audio = training_flops(self._audio_blocks(batch), inputs_need_grad=False, backward=backward)
        vision += audio
        audio_flows = model_type == "qwen2_5_omni_thinker" and (self.audio.base or bool(self.audio.lora))
        projector_flows = vision_flows or audio_flows or self.projector.base or bool(self.projector.lora)
        language = training_flops(
            self._language_blocks(lengths, _rows(batch)),
            inputs_need_grad=self.embed_trains or projector_flows,
            backward=backward,
        )
        total = vision + projector + language
        parts = {"language": language.model, "vision": vision.model - audio.model, "projector": projector.model}
        parts["audio"] = audio.model
        return StepFlops(total.model, total.hardware, total.forward, parts)

    def _language_blocks(self, lengths: Sequence[int], rows: tuple[int, int]) -> list[Block]:
        c = self._text_config()
        tower = self.language
        tokens = sum(lengths)
        hidden = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        kv_heads = int(_get(c, "num_key_value_heads", default=heads))
        head_dim = int(_get(c, "head_dim", default=hidden // heads))
        layer_types = getattr(c, "layer_types", None)
        experts = int(_get(c, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
        sparse_step = int(_get(c, "decoder_sparse_step", default=1))
        dense_layers = set(getattr(c, "mlp_only_layers", None) or [])
        dense_layers |= set(range(int(getattr(c, "first_k_dense_replace", None) or 0)))  # GLM-4.5V
        fused_mlp = getattr(c, "model_type", "") == "glm4v_text"  # one gate_up_proj
        gated_query = getattr(c, "model_type", "") in _HYBRID_TYPES  # q_proj also gives the output gate
        blocks: list[Block] = []
        for index in range(int(c.num_hidden_layers)):
            window = None
            if layer_types is not None and layer_types[index] == "sliding_attention":
                window = getattr(c, "sliding_window", None)
            stages: list[tuple[Op, ...]] = []
            if layer_types is not None and layer_types[index] == "linear_attention":
                stages += self._gated_delta_net(c, rows, hidden)
            else:
                query = heads * head_dim * (2 if gated_query else 1)
                stages += tower.parallel(
                    [("q_proj", hidden, query), ("k_proj", hidden, kv_heads * head_dim)]
                    + [("v_proj", hidden, kv_heads * head_dim)],
                    tokens,
                )
                stages.append((attention(lengths, heads, head_dim, window=window),))
                stages += tower.linear("o_proj", tokens, heads * head_dim, hidden)
            moe = experts > 0 and index not in dense_layers and (index + 1) % sparse_step == 0
            if moe:
                stages += self._moe_stages(c, tokens, hidden, experts)
            else:
                inner = int(c.intermediate_size)
                if fused_mlp:
                    stages += tower.linear("gate_up_proj", tokens, hidden, 2 * inner)
                else:
                    stages += tower.parallel([("gate_proj", hidden, inner), ("up_proj", hidden, inner)], tokens)
                stages += tower.linear("down_proj", tokens, inner, hidden)
            blocks.append(tower.block(stages, exact_tail=not moe))
        head = TowerTraining(self.head_trains, self.language.lora)
        blocks.append(Block(head.linear("lm_head", tokens, hidden, int(c.vocab_size))))
        return blocks

    def _gated_delta_net(self, c: Any, rows: tuple[int, int], hidden: int) -> list[tuple[Op, ...]]:
        """Qwen3-Next's (Qwen3.5's) Gated DeltaNet over whole rows (it does not restart at packed samples), its
        products as the chunked torch fallback computes them: the projections, the causal depthwise convolution, per
        row and value head the in-chunk products over chunks of 64 and the scan over the chunks (whose first state is
        zero and whose last is dropped), the gated output projection."""
        tower = self.language
        count, length = rows
        tokens = count * length
        k_heads, v_heads = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
        dk, dv = int(c.linear_key_head_dim), int(c.linear_value_head_dim)
        key_dim, value_dim = k_heads * dk, v_heads * dv
        channels, kernel = 2 * key_dim + value_dim, int(c.linear_conv_kernel_dim)
        size = 64
        chunks = -(-length // size)
        if c.model_type == "qwen3_next":
            projections = [("in_proj_qkvz", hidden, 2 * key_dim + 2 * value_dim), ("in_proj_ba", hidden, 2 * v_heads)]
        else:  # Qwen3.5: the same products, apart
            projections = [("in_proj_qkv", hidden, 2 * key_dim + value_dim), ("in_proj_z", hidden, value_dim)]
            projections += [("in_proj_b", hidden, v_heads), ("in_proj_a", hidden, v_heads)]
        stages = list(tower.parallel(projections, tokens))
        stages.append((Op(2 * count * (length + kernel - 1) * channels * kernel, tower.base),))
        per_chunk = 2 * size * size * (2 * dk + dv) + 2 * size * dk * dv * 3
        scan = 2 * size * dk * dv  # one product of the scan over one chunk
        backward = 2 * chunks * 2 * size * size * (2 * dk + dv)  # k_beta k^T, q k^T, the in-chunk attention
        backward += chunks * 2 * size * size * (dv + dk)  # the triangular solves' gradients of their matrix
        backward += (2 * 2 * (chunks - 1) + 2) * scan  # the state reads (the first state takes no gradient)
        backward += 2 * (chunks - 1) * scan  # the state updates (the last one is dropped)
        stages.append((Op(count * v_heads * chunks * per_chunk, None, backward=count * v_heads * backward),))
        stages += tower.linear("out_proj", tokens, value_dim, hidden)
        return stages

    def _moe_stages(self, c: Any, tokens: int, hidden: int, experts: int) -> list[tuple[Op, ...]]:
        top_k = int(_get(c, "num_experts_per_tok"))
        inner = int(_get(c, "moe_intermediate_size"))
        trains = self.language.base
        first = [linear(tokens, hidden, experts, trains), linear(tokens * top_k, hidden, 2 * inner, trains)]
        second = [linear(tokens * top_k, inner, hidden, trains)]
        shared = getattr(c, "shared_expert_intermediate_size", None)
        if shared:  # Qwen2-MoE: a gated shared expert beside the routed ones
            first += [linear(tokens, hidden, 2 * int(shared), trains), linear(tokens, hidden, 1, trains)]
            second.append(linear(tokens, int(shared), hidden, trains))
        shared_experts = int(getattr(c, "n_shared_experts", None) or 0)
        if shared_experts:  # GLM-4.5V (DeepSeek-style): ungated shared experts beside the routed ones
            first.append(linear(tokens, hidden, 2 * inner * shared_experts, trains))
            second.append(linear(tokens, inner * shared_experts, hidden, trains))
        return [tuple(first), tuple(second)]

    def _vision_blocks(self, grids: Sequence[tuple[int, int, int]]) -> list[Block]:
        if not grids:
            return []
        v = self.config.vision_config
        tower = self.vision
        hidden = int(v.hidden_size)
        heads = int(v.num_heads)
        merge = int(v.spatial_merge_size)
        patches = sum(t * h * w for t, h, w in grids)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        patch_in = int(v.in_channels) * int(v.temporal_patch_size) * int(v.patch_size) ** 2
        omni = self.config.model_type == "qwen2_5_omni_thinker"  # Qwen2.5-VL's tower with q, k, v apart
        qwen25 = self.config.model_type == "qwen2_5_vl" or omni
        glm = self.config.model_type in ("glm4v", "glm4v_moe")
        windows: list[int] = []
        if qwen25:
            cells = int(v.window_size) // merge // int(v.patch_size)
            for t, h, w in grids:
                windows += [n * merge * merge for n in window_lengths(h // merge, w // merge, cells) * t]
        blocks = [Block(((linear(patches, patch_in, hidden, tower.base),),))]
        full = set(getattr(v, "fullatt_block_indexes", None) or [])
        inner = int(v.intermediate_size)
        merged = patches // merge**2
        merger_in = hidden * merge**2
        out = int(v.out_hidden_size)
        for index in range(int(v.depth)):
            stages: list[tuple[Op, ...]]
            if omni:
                stages = list(tower.parallel([(n, hidden, hidden) for n in ("q", "k", "v")], patches))
            else:
                stages = list(tower.linear("qkv", patches, hidden, 3 * hidden))
            seqs = windows if qwen25 and index not in full else frames
            stages.append((attention(seqs, heads, hidden // heads),))
            stages += tower.linear("proj", patches, hidden, hidden)
            if qwen25 or glm:
                width = int(v.out_hidden_size) if glm else inner  # GLM's block MLP is out_hidden_size wide
                stages += tower.parallel([("gate_proj", hidden, width), ("up_proj", hidden, width)], patches)
                stages += tower.linear("down_proj", patches, width, hidden)
            else:
                stages += tower.linear("linear_fc1", patches, hidden, inner)
                stages += tower.linear("linear_fc2", patches, inner, hidden)
            blocks.append(tower.block(stages))
        if glm:  # a merge_size-strided convolution, then a projection and a gated MLP
            stages = list(tower.linear("downsample", merged, merger_in, out))
            stages += tower.linear("proj", merged, out, out)
            stages += tower.parallel([("gate_proj", out, inner), ("up_proj", out, inner)], merged)
            stages += tower.linear("down_proj", merged, inner, out)
            return blocks + [Block(tuple(stages))]
        mergers = 1 + len(getattr(v, "deepstack_visual_indexes", None) or [])
        names = ("0", "2") if qwen25 else ("linear_fc1", "linear_fc2")
        for _ in range(mergers):
            stages = list(tower.linear(names[0], merged, merger_in, merger_in))
            stages += tower.linear(names[1], merged, merger_in, out)
            blocks.append(Block(tuple(stages)))
        return blocks

    def _audio_blocks(self, batch: Mapping[str, Any]) -> list[Block]:
        """Qwen2.5-Omni's Whisper-like audio tower: each sample cut into chunks of ``2 * n_window`` frames, padded to
        the longest; two convolutions (the second of stride 2), per layer ``q``/``k``/``v``/``out``, attention per
        chunk and the MLP, then the projection of the stride-2 pooled frames."""
        features = batch.get("input_features")
        if self.config.model_type != "qwen2_5_omni_thinker" or not isinstance(features, Tensor):
            return []
        mask = batch.get("feature_attention_mask")
        lens = batch.get("audio_feature_lengths")
        if isinstance(lens, Tensor):
            lengths = [int(n) for n in lens.reshape(-1).tolist()]
        elif isinstance(mask, Tensor):
            lengths = [int(n) for n in mask.sum(-1).reshape(-1).tolist()]
        else:
            lengths = [int(features.shape[-1])] * int(features.shape[0])
        a = self.config.audio_config
        tower = self.audio
        window = 2 * int(a.n_window)
        chunks = [min(window, n - start) for n in lengths for start in range(0, n, window)]
        if not chunks:
            return []
        d, mel = int(a.d_model), int(a.num_mel_bins)
        longest = max(chunks)
        after = [(n - 1) // 2 + 1 for n in chunks]
        tokens = sum(after)
        inner = int(a.encoder_ffn_dim)
        heads = int(a.encoder_attention_heads)
        blocks = [
            Block(((linear(len(chunks) * longest, 3 * mel, d, tower.base),),)),
            Block(((linear(len(chunks) * ((longest - 1) // 2 + 1), 3 * d, d, tower.base),),)),
        ]
        for _ in range(int(a.encoder_layers)):
            stages = list(tower.parallel([(n, d, d) for n in ("q_proj", "k_proj", "v_proj")], tokens))
            stages.append((attention(after, heads, d // heads),))
            stages += tower.linear("out_proj", tokens, d, d)
            stages += tower.linear("fc1", tokens, d, inner)
            stages += tower.linear("fc2", tokens, inner, d)
            blocks.append(tower.block(stages))
        pooled = sum(((n - 1) // 2 + 1 - 2) // 2 + 1 for n in lengths)
        blocks.append(Block(tower.linear("proj", pooled, d, int(a.output_dim))))
        return blocks

    # ----------------------------------------------------------------------------------------------- ViT VLMs
    def _vit_spec(self) -> tuple[Any, bool, int]:
        """The tower's config, whether it has a class token, and the hidden state whose features are used."""
        c = self.config
        v = c.vision_config
        vision_type = getattr(v, "model_type", "")
        if vision_type not in _VIT_CLASS_TOKEN or (vision_type == "pixtral") != (c.model_type == "mistral3"):
            raise UnsupportedFlopsModel(f"no FLOP formula for the {c.model_type!r} vision tower {vision_type!r}")
        if c.model_type == "gemma3" and getattr(v, "vision_use_head", False):
            raise UnsupportedFlopsModel("no FLOP formula for a Gemma 3 SigLIP tower with its pooling head")
        depth = int(v.num_hidden_layers)
        layer = getattr(c, "vision_feature_layer", -1)
        layers = [layer] if isinstance(layer, int) else list(layer)
        used = max(index if index >= 0 else depth + 1 + index for index in layers)  # hidden_states[0]: embeddings
        return v, _VIT_CLASS_TOKEN[vision_type], used

    def _vit_blocks(self, pixels: Any) -> tuple[list[Block], list[Block], list[Block]]:
        if not isinstance(pixels, Tensor) or pixels.numel() == 0:
            return [], [], []
        c = self.config
        if c.model_type in ("idefics3", "smolvlm") and pixels.ndim == 5:  # (batch, images, C, H, W), zero padding
            pixels = pixels.flatten(0, 1)
            pixels = pixels[pixels.flatten(1).ne(0).any(-1)]  # the model drops the all-zero padding images
        if pixels.ndim != 4:
            raise DataError(f"a FLOP count of {self.config.model_type!r} needs 4-D `pixel_values`, got {pixels.ndim}-D")
        v, class_token, used = self._vit_spec()
        tower = self.vision
        size = v.patch_size
        patch = int(size[0] if isinstance(size, (list, tuple)) else size)
        images, channels = int(pixels.shape[0]), int(pixels.shape[1])
        grid = (int(pixels.shape[2]) // patch) * (int(pixels.shape[3]) // patch)
        sequence = grid + int(class_token)
        tokens = images * sequence
        hidden = int(v.hidden_size)
        heads = int(v.num_attention_heads)
        inner = int(v.intermediate_size)
        out_name = "projection_layer" if c.model_type == "internvl" else "out_proj"
        blocks = [Block(((linear(images * grid, channels * patch * patch, hidden, tower.base),),))]
        for _ in range(int(v.num_hidden_layers)):
            stages = list(tower.parallel([(n, hidden, hidden) for n in ("q_proj", "k_proj", "v_proj")], tokens))
            stages.append((attention([sequence] * images, heads, hidden // heads),))
            stages += tower.linear(out_name, tokens, hidden, hidden)
            stages += tower.linear("fc1", tokens, hidden, inner)
            stages += tower.linear("fc2", tokens, inner, hidden)
            blocks.append(tower.block(stages))
        text_hidden = int(c.text_config.hidden_size)
        projector = self.projector
        stages = []
        if c.model_type == "internvl":
            if getattr(c, "vision_feature_select_strategy", "default") != "default":
                raise UnsupportedFlopsModel("InternVL's FLOPs are counted for vision_feature_select_strategy 'default'")
            ratio = int(round(1 / float(c.downsample_ratio)))
            merged = images * grid // ratio**2
            stages += projector.linear("linear_1", merged, hidden * ratio**2, text_hidden)
            stages += projector.linear("linear_2", merged, text_hidden, text_hidden)
        elif c.model_type == "llava":
            layer = c.vision_feature_layer
            width = hidden * (1 if isinstance(layer, int) else len(layer))
            selected = images * (grid if c.vision_feature_select_strategy == "default" else sequence)
            stages += projector.linear("linear_1", selected, width, text_hidden)
            stages += projector.linear("linear_2", selected, text_hidden, text_hidden)
        elif c.model_type in ("idefics3", "smolvlm"):  # pixel shuffle by scale_factor, then one linear layer
            scale = int(c.scale_factor)
            merged = images * grid // scale**2
            stages += projector.linear("proj", merged, hidden * scale**2, text_hidden)
        else:  # Gemma 3: average-pooled to mm_tokens_per_image, then one projection matrix
            stages.append((linear(images * int(c.mm_tokens_per_image), hidden, text_hidden, projector.base),))
        return blocks[: used + 1], blocks[used + 1 :], [Block(tuple(stages))]

    def _pixtral_blocks(self, pixels: Any, batch: Mapping[str, Any]) -> tuple[list[Block], list[Block], list[Block]]:
        """Mistral 3: Pixtral over each image's ``image_sizes`` (its patch convolution over the padded tensor),
        attention per image (as its flash path computes it: eager attention masks the images' concatenation), a
        gated MLP; the patch merger and two linear layers."""
        if not isinstance(pixels, Tensor) or pixels.numel() == 0:
            return [], [], []
        sizes = batch.get("image_sizes")
        if pixels.ndim != 4 or not isinstance(sizes, Tensor):
            raise DataError("a FLOP count of 'mistral3' needs 4-D `pixel_values` and `image_sizes`")
        c = self.config
        v, _, used = self._vit_spec()
        tower = self.vision
        patch = int(v.patch_size)
        merge = int(c.spatial_merge_size)
        grids = [(int(h) // patch, int(w) // patch) for h, w in sizes.reshape(-1, 2).tolist()]
        lengths = [h * w for h, w in grids]
        tokens = sum(lengths)
        hidden = int(v.hidden_size)
        heads = int(v.num_attention_heads)
        head_dim = int(_get(v, "head_dim", default=hidden // heads))
        inner = int(v.intermediate_size)
        padded = int(pixels.shape[0]) * (int(pixels.shape[2]) // patch) * (int(pixels.shape[3]) // patch)
        blocks = [Block(((linear(padded, int(pixels.shape[1]) * patch * patch, hidden, tower.base),),))]
        for _ in range(int(v.num_hidden_layers)):
            stages = list(
                tower.parallel([(n, hidden, heads * head_dim) for n in ("q_proj", "k_proj", "v_proj")], tokens)
            )
            stages.append((attention(lengths, heads, head_dim),))
            stages += tower.linear("o_proj", tokens, heads * head_dim, hidden)
            stages += tower.parallel([("gate_proj", hidden, inner), ("up_proj", hidden, inner)], tokens)
            stages += tower.linear("down_proj", tokens, inner, hidden)
            blocks.append(tower.block(stages))
        projector = self.projector
        layer = c.vision_feature_layer
        width = hidden * (1 if isinstance(layer, int) else len(layer))
        merged = sum((h // merge) * (w // merge) for h, w in grids)
        text_hidden = int(c.text_config.hidden_size)
        stages = list(projector.linear("merging_layer", merged, width * merge**2, width))
        stages += projector.linear("linear_1", merged, width, text_hidden)
        stages += projector.linear("linear_2", merged, text_hidden, text_hidden)
        return blocks[: used + 1], blocks[used + 1 :], [Block(tuple(stages))]


def _tower_of(name: str) -> str:
    """The tower a module or parameter of this name belongs to: vision, audio, projector or language."""
    dotted = f".{name}"
    if any(f".{p}" in dotted for p in _AUDIO_PREFIXES):
        return "audio"
    if any(f".{p}" in dotted for p in _VISION_PREFIXES):
        return "vision"
    if any(f".{p}" in dotted for p in _PROJECTOR_PREFIXES):
        return "projector"
    return "language"
