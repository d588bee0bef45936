"""GPT-2/3 style decoder: learned positions, pre-LayerNorm blocks, GeLU MLP, tied embeddings.

A model file for ``autopar plan``: ``build_model(**config)`` returns the module; the defaults are a
GPT-3 XL sized model (1.3B parameters).  Blocks live in a ``ModuleDict`` keyed by layer index so that
module FQNs survive a pipeline split, and ``forward`` tolerates a missing embedding or head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from autopar.models.config_checks import require_fraction, require_positive_ints
from torch import nn


@dataclass(kw_only=True)
class GPTConfig:
    layers: int = 24
    hidden: int = 2048
    heads: int = 16
    ffn: int | None = None  # default 4 * hidden
    vocab: int = 50304
    seq_len: int = 2048
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require_positive_ints(self, "layers", "hidden", "heads", "vocab", "seq_len")
        require_fraction(self, "dropout")
        if self.ffn is None:
            self.ffn = 4 * self.hidden
        require_positive_ints(self, "ffn")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.o = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 instead of the head count: the same code runs when q/k/v are column-sharded.
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [b, heads, t, head_dim]
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)  # [b, t, hidden]
        return self.resid_dropout(self.o(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.proj = nn.Linear(cfg.ffn, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    #: Position tables the model slices from the start, by sequence dim: context parallelism gives each rank
    #: its rows (``autopar.runtime.context_parallel``).
    cp_sequence_buffers: ClassVar[dict[str, int]] = {"positions": 0}

    def __init__(self, cfg: GPTConfig, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.register_buffer("positions", torch.arange(cfg.seq_len), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): block(cfg) for i in range(cfg.layers)})
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialisation of every parameter (``init_parameter``)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """Initialize parameter ``name`` in place: normal(0, 0.02), residual projections scaled by
        1/sqrt(2 * layers); zero biases, unit norm weights.  (autopar's runtime calls this per parameter.)"""
        if p.dim() == 1:
            nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("o.weight", "proj.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: token ids [b, t] when the embedding is present, else hidden states [b, t, hidden]."""
        if self.tok is not None:
            x = self.drop(self.tok(x) + self.pos(self.positions[:x.shape[1]]))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)  # [b, t, vocab]
        return x


def build_model(**config) -> GPT:
    """Build a GPT from config keys ``layers, hidden, heads, ffn, vocab, seq_len, tie_embeddings, dropout``."""
    return GPT(GPTConfig(**config))
