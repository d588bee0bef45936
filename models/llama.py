"""Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention.

A model file for ``autopar plan``; the defaults are Llama-2 7B.  Blocks live in a ``ModuleDict``
keyed by layer index so that FQNs survive a pipeline split; ``forward`` tolerates a missing
embedding or head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from autopar.models.config_checks import require_positive_ints
from torch import nn


@dataclass(kw_only=True)
class LlamaConfig:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int | None = None  # default: heads (multi-head attention)
    ffn: int = 11008
    vocab: int = 32000
    seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rms_norm: str = "fused"  # "fused": torch's RMSNorm kernel; "eager": op by op; "fp32": op by op in fp32
    rope: str = "model"  # "model": rotate in the model's precision; "fp32": in fp32, as Meta's reference does

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        require_positive_ints(self, "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.rms_norm not in ("fused", "eager", "fp32"):
            raise ValueError(f"rms_norm must be 'fused', 'eager' or 'fp32', got {self.rms_norm!r}")
        if self.rope not in ("model", "fp32"):
            raise ValueError(f"rope must be 'model' or 'fp32', got {self.rope!r}")


class EagerRMSNorm(nn.Module):
    """RMSNorm written out op by op (``x * rsqrt(mean(x^2) + eps) * weight``), as implementations without a
    fused kernel run it: one kernel per op.  ``fp32``: on an fp32 copy of ``x``, cast back before the weight,
    as Meta's reference implementation and torchtitan do (``self._norm(x.float()).type_as(x) * weight``)."""

    def __init__(self, dim: int, eps: float, fp32: bool = False) -> None:
        super().__init__()
        self.eps, self.fp32 = eps, fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() if self.fp32 else x
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rms_norm(cfg: LlamaConfig) -> nn.Module:
    if cfg.rms_norm == "fused":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return EagerRMSNorm(cfg.hidden, cfg.norm_eps, fp32=cfg.rms_norm == "fp32")


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim // 2] for rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of ``x`` [b, t, heads, head_dim]; ``fp32``: on an fp32 copy,
    cast back after (the precision of Meta's reference rotary embedding)."""
    y = x.float() if fp32 else x
    cos, sin = cos[:, None], sin[:, None]  # [t, 1, head_dim // 2]: one angle per position, for every head
    if fp32:
        cos, sin = cos.float(), sin.float()
    x1, x2 = y.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        self.group = cfg.heads // cfg.kv_heads
        self.rope_fp32 = cfg.rope == "fp32"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # rotated in [b, t, heads, head_dim], as torchtitan and Meta's reference model do: the attention kernel's
        # output then has the query's (b, t, heads, head_dim) layout, and the heads go back together as a view
        q = apply_rope(self.q(x).view(b, t, -1, self.head_dim), cos, sin, self.rope_fp32)
        k = apply_rope(self.k(x).view(b, t, -1, self.head_dim), cos, sin, self.rope_fp32)
        v = self.v(x).view(b, t, -1, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=self.group > 1)  # [b, heads, t, head_dim]
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = rms_norm(cfg)
        self.attn = Attention(cfg)
        self.ffn_norm = rms_norm(cfg)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    #: Position tables the model slices from the start, by sequence dim: context parallelism gives each rank
    #: its rows (``autopar.runtime.context_parallel``).
    cp_sequence_buffers: ClassVar[dict[str, int]] = {"rope_cos": 0, "rope_sin": 0}

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = rms_norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.hidden // cfg.heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialize every parameter (``init_parameter``)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """Initialize parameter ``name`` in place: normal(0, 0.02) for matrices, scaled by 1/sqrt(2 * layers)
        on residual outputs; ones for norms.  (autopar's runtime calls this per parameter.)"""
        if p.dim() == 1:
            nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("o.weight", "down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: token ids [b, t] when the embedding is present, else hidden states [b, t, hidden]."""
        if self.tok is not None:
            x = self.tok(x)
        t = x.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)  # [b, t, vocab]
        return x


def build_model(**config) -> Llama:
    """Build a Llama from config keys ``layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rms_norm, rope``."""
    return Llama(LlamaConfig(**config))
