"""A small decoder-only transformer of our own (gpt-fast style).

It exists so that autosp is tested on a model that is not from Hugging Face:
pre-norm blocks, rotary positions computed from global position ids, grouped
KV heads expanded before SDPA (unlike HF Llama, which passes ``enable_gqa``),
and a loss that shifts labels on the full sequence (pad + slice the labels,
never the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ReferenceConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2 * c.n_kv_heads, c.head_dim).transpose(1, 2).chunk(2, dim=1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = c.n_heads // c.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class ReferenceTransformer(nn.Module):
    def __init__(self, cfg: ReferenceConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or ReferenceConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]          # [b|1, 1, s, head_dim]
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        # Shift on the full sequence: pad labels by one ignored token and drop the first.
        targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def reference_factory(**overrides) -> ReferenceTransformer:
    """Factory for ``--model autosp.models.reference:reference_factory``."""
    return ReferenceTransformer(ReferenceConfig(**overrides))
