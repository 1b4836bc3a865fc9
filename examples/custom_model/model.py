"""A small vision-encoder + text-decoder model whose module names match MindSpeed MM's ``fsdp2_config.yaml``.

``text_decoder.embedding``, ``text_decoder.rotary_pos_emb``, ``text_decoder.decoder.layers.{*}``,
``text_decoder.output_layer`` and ``image_encoder`` are exactly the paths MindSpeed MM's YAML names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mm.modules import FSDP2Mixin, MultiModalModule, WeightInitMixin


@dataclass
class TinyVLMConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    image_size: int = 32
    patch_size: int = 8
    vision_layers: int = 1
    initializer_range: float = 0.02


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: a buffer computed at construction, no parameters."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Block(nn.Module):
    """Pre-norm transformer block; causal attention with rotary embedding when ``rope`` is given."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, causal: bool = True
    ) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if rope is not None:
            cos, sin = rope
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.norm2(x))


class ImageEncoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.blocks = nn.ModuleList(Block(cfg.hidden_size, cfg.num_heads) for _ in range(cfg.vision_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, causal=False)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg.hidden_size, cfg.num_heads) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size)


class TextDecoder(nn.Module):
    def __init__(self, cfg: TinyVLMConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(cfg.hidden_size // cfg.num_heads)
        self.decoder = Decoder(cfg)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(input_ids)
        if prefix is not None:
            x = torch.cat([prefix.to(x.dtype), x], dim=1)
        rope = self.rotary_pos_emb(x.shape[1])
        for layer in self.decoder.layers:
            x = layer(x, rope)
        return self.output_layer(self.decoder.final_norm(x))


class TinyVLM(MultiModalModule, FSDP2Mixin, WeightInitMixin):
    """Image patches are prefixed to the caption tokens; the loss is next-token prediction on the caption."""

    def __init__(self, config: TinyVLMConfig | None = None) -> None:
        config = config or TinyVLMConfig()
        super().__init__(config)
        self.image_encoder = ImageEncoder(config)
        self.text_decoder = TextDecoder(config)

    def forward(
        self, images: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        prefix = self.image_encoder(images)
        logits = self.text_decoder(input_ids, prefix)[:, prefix.shape[1] :]
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return out
