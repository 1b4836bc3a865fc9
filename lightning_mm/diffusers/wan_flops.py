"""FLOPs of one training step of a Wan 2.x transformer (diffusers' ``WanTransformer3DModel``), Lightning-free.

:class:`WanFlopCounter` reads the model's config, which of its weights train (all, a frozen part, LoRA adapters
from PEFT) and whether its blocks recompute, and counts a batch from its latent shape ``(B, C, F, H, W)`` and the
text (and, for image-to-video, image) token counts with the formulas of :mod:`lightning_mm.core.flop_formulas`:

* the patch embedding (a ``Conv3d`` whose stride is its kernel: a linear layer per video token; its input, the
  noisy latent, takes no gradient, so its backward is its weight's gradient only);
* the condition embedders: the timestep MLP and ``time_proj`` (one row per sample), the text projection (per text
  token), the image embedder's MLP (per image token, image-to-video only);
* per block: self-attention over the ``L`` video tokens (``q``/``k``/``v``/``o`` projections, ``L^2``
  attention), cross-attention from the video tokens to the text tokens (``q`` over the video, ``k``/``v`` over the
  text, ``L x T`` attention; image-to-video adds ``add_k``/``add_v`` over the image tokens and ``L x I``
  attention) and the FFN; then ``proj_out``;
* backward: 3x forward for a trained layer, 2x for a frozen one a gradient flows through, 1x where none does
  (:func:`~lightning_mm.core.flop_formulas.training_flops`); LoRA's ``A``/``B`` beside their frozen base layers;
  recomputation of the blocks in ``StepFlops.hardware`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from math import prod
from typing import Any

from torch import nn

from lightning_mm.core.flop_formulas import Block, Op, StepFlops, attention, linear, training_flops
from lightning_mm.core.recompute import is_recomputed
from lightning_mm.errors import DataError
from lightning_mm.hf.transformers_flops import TowerTraining, UnsupportedFlopsModel

__all__ = ["WAN_CLASS_NAMES", "WanFlopCounter"]

WAN_CLASS_NAMES = ("WanTransformer3DModel",)
_EMBEDDERS = ("patch_embedding", "time", "text", "image", "proj_out")


def _cross(q_tokens: int, kv_tokens: int, samples: int, heads: int, head_dim: int) -> Op:
    """Attention of ``q_tokens`` queries to ``kv_tokens`` keys, per sample (backward 2x while a gradient flows)."""
    return Op(2 * samples * q_tokens * kv_tokens * heads * 2 * head_dim, None)


def _with_input_grad(stage: Sequence[Op], flows: bool) -> tuple[Op, ...]:
    """The ops of a stage reading a stream of its own (the text): their input needs a gradient iff ``flows``."""
    return tuple(op if op.input_grad is not None else replace(op, input_grad=flows) for op in stage)


@dataclass(frozen=True)
class WanFlopCounter:
    """Model and hardware FLOPs of a training step of a ``WanTransformer3DModel``: ``counter(latent_shape, text)``.

    ``blocks``: how the transformer blocks train (LoRA keyed by the name inside a block, e.g. ``attn1.to_q``,
    ``ffn.net.0.proj``); ``trains``: which of :data:`_EMBEDDERS` (``patch_embedding``, ``time``, ``text``,
    ``image``, ``proj_out``) train.
    """

    config: Any
    blocks: TowerTraining = field(default_factory=TowerTraining)
    trains: frozenset[str] = frozenset(_EMBEDDERS)

    @classmethod
    def from_model(cls, model: nn.Module, reentrant: bool = False) -> WanFlopCounter:
        """Read what trains (and LoRA ranks, recomputation: diffusers' gradient checkpointing or the strategy's
        ``recompute_modules``; ``reentrant``: the strategy's ``use_reentrant``) from a ``WanTransformer3DModel``
        (PEFT-wrapped or not)."""
        base = model
        for attribute in ("get_base_model",):
            if callable(getattr(base, attribute, None)):
                base = base.get_base_model()  # type: ignore[operator]
        if not any(k.__name__ in WAN_CLASS_NAMES for k in type(base).__mro__):  # the FSDP-adapted class too
            raise UnsupportedFlopsModel(f"{type(base).__name__} is not a Wan transformer: no FLOP formula for it")
        lora: dict[str, int] = {}
        blocks_train = False
        trains: set[str] = set()
        for name, module in base.named_modules():
            ranks = getattr(module, "r", None)
            if hasattr(module, "lora_A") and isinstance(ranks, dict) and ranks and name.startswith("blocks."):
                lora[name.split(".", 2)[2]] = int(next(iter(ranks.values())))
        for name, param in base.named_parameters():
            if not param.requires_grad or "lora_" in name:
                continue
            if name.startswith("blocks."):
                blocks_train = True
            elif name.startswith("patch_embedding."):
                trains.add("patch_embedding")
            elif name.startswith("condition_embedder.text_embedder."):
                trains.add("text")
            elif name.startswith("condition_embedder.image_embedder."):
                trains.add("image")
            elif name.startswith("condition_embedder."):
                trains.add("time")
            elif name.startswith("proj_out."):
                trains.add("proj_out")
        recompute = bool(getattr(base, "gradient_checkpointing", False))
        recompute = recompute or any(is_recomputed(block) for block in getattr(base, "blocks", ()))
        return cls(base.config, TowerTraining(blocks_train, lora, recompute, reentrant), frozenset(trains))

    def video_tokens(self, latent_shape: Sequence[int]) -> tuple[int, int]:
        """``(samples, video tokens per sample)`` of a latent batch ``(B, C, F, H, W)``."""
        if len(latent_shape) != 5:
            raise DataError(f"a Wan FLOP count needs the latent shape (B, C, F, H, W), got {tuple(latent_shape)}")
        batch, _, frames, height, width = (int(n) for n in latent_shape)
        pt, ph, pw = (int(n) for n in self.config.patch_size)
        return batch, (frames // pt) * (height // ph) * (width // pw)

    def __call__(
        self, latent_shape: Sequence[int], text_tokens: int, image_tokens: int = 0, backward: bool = True
    ) -> StepFlops:
        """FLOPs of forward (and backward) over a batch of latents ``(B, C, F, H, W)`` with ``text_tokens`` text
        tokens per sample (the text encoder's padded length) and ``image_tokens`` image tokens (image-to-video)."""
        c = self.config
        batch, length = self.video_tokens(latent_shape)
        heads, head_dim = int(c.num_attention_heads), int(c.attention_head_dim)
        dim = heads * head_dim
        video, text, image = batch * length, batch * int(text_tokens), batch * int(image_tokens)
        i2v = c.added_kv_proj_dim is not None and image_tokens > 0
        if image_tokens and not i2v:
            raise DataError("image tokens given, but this Wan model has no image cross-attention (added_kv_proj_dim)")

        def mlp(stream: str, rows: int, sizes: Sequence[int], normed: bool = False) -> StepFlops:
            """A stream's linear layers; ``normed``: after a norm of its own (whose affine weights train with it)."""
            ops = [Block(((linear(rows, a, b, stream in self.trains),),)) for a, b in zip(sizes, sizes[1:])]
            return training_flops(ops, inputs_need_grad=normed and stream in self.trains, backward=backward)

        conditions = mlp("time", batch, (int(c.freq_dim), dim, dim, 6 * dim))  # time_embedder, then time_proj
        conditions += mlp("text", text, (int(c.text_dim), dim, dim))
        text_flows = "text" in self.trains
        image_flows = "image" in self.trains
        if i2v:
            conditions += mlp("image", image, (int(c.image_dim), int(c.image_dim), dim), normed=True)

        t = self.blocks
        patch = linear(video, prod(c.patch_size) * int(c.in_channels), dim, "patch_embedding" in self.trains)
        # the noisy latent takes no gradient; the video stream needs one after a trained patch embedding or from the
        # blocks' timestep modulation (``time_proj``'s output scales and shifts it) when the time embedder trains
        embedded = training_flops([Block(((patch,),))], inputs_need_grad=False, backward=backward)
        flows = "patch_embedding" in self.trains or "time" in self.trains
        blocks: list[Block] = []
        for _ in range(int(c.num_layers)):
            stages: list[tuple[Op, ...]] = []
            stages += t.parallel([(f"attn1.to_{x}", dim, dim) for x in "qkv"], video)
            stages.append((attention([length] * batch, heads, head_dim),))
            stages += t.linear("attn1.to_out.0", video, dim, dim)
            # cross-attention: q over the video; k/v (and add_k/add_v) over the text (image) stream, computed first
            kv = t.parallel([(f"attn2.to_{x}", dim, dim) for x in "kv"], text)
            stages.append(_with_input_grad(kv[0], text_flows))
            stages += kv[1:]
            if i2v:
                added = t.parallel([(f"attn2.add_{x}_proj", int(c.added_kv_proj_dim), dim) for x in "kv"], image)
                stages.append(_with_input_grad(added[0], image_flows))
                stages += added[1:]
            stages += t.linear("attn2.to_q", video, dim, dim)
            stages.append((_cross(length, int(text_tokens), batch, heads, head_dim),))
            if i2v:
                stages.append((_cross(length, int(image_tokens), batch, heads, head_dim),))
            stages += t.linear("attn2.to_out.0", video, dim, dim)
            stages += t.linear("ffn.net.0.proj", video, dim, int(c.ffn_dim))
            stages += t.linear("ffn.net.2", video, int(c.ffn_dim), dim)
            # the FFN output is gated by the timestep modulation: the backward needs it, so the replay runs it too
            blocks.append(t.block(stages, exact_tail=False))
        out = int(c.out_channels or c.in_channels) * prod(c.patch_size)
        blocks.append(Block(((linear(video, dim, out, "proj_out" in self.trains),),)))
        return conditions + embedded + training_flops(blocks, inputs_need_grad=flows, backward=backward)
