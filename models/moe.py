"""A GPT-style transformer whose MLPs are top-k routed mixtures of experts (Switch/GShard style).

A model file for ``autopar plan``.  Config keys: those of ``models/gpt.py`` plus ``experts``, ``top_k``,
``routing``, ``capacity_factor`` and ``shared_experts`` (0 by default: DeepSeek-MoE's and Qwen-MoE's
always-on experts, one dense MLP ``shared_experts`` times ``ffn`` wide beside the routed ones, which every
token passes).

``routing="capacity"`` (the default) routes per sequence with a fixed expert capacity
``C = ceil(top_k * seq * capacity_factor / experts)``; tokens over capacity are dropped (their residual
passes through).  Dispatch and combine use gather/scatter on index tensors, so every shape is static and
``torch.export`` can trace it.  The experts are one module (``Experts``) whose weights are stacked
``[experts, ...]`` and whose input and output are every expert's slots, ``[batch, experts, capacity,
hidden]``: expert parallelism shards the expert dimension and dispatches the slots with one all-to-all
each way (``autopar.runtime.expert_parallel``).

``routing="dropless"`` drops nothing (MegaBlocks, Gale et al. 2023; DeepSeek-V3; torchtitan): the token
assignments are sorted by expert and every expert multiplies exactly its own tokens, one grouped product
per weight (``torch.nn.functional.grouped_mm``, ``GroupedExperts``); ``capacity_factor`` is unused.  Its
shapes are static too (``top_k`` rows per token), but how many rows each expert gets is known only at run
time, so it is planned without expert parallelism.  Defaults: 12 layers, hidden 1024, 8 experts, top-2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from autopar.models import gpt
from autopar.models.config_checks import require_positive_ints
from torch import nn


@dataclass(kw_only=True)
class MoEConfig(gpt.GPTConfig):
    layers: int = 12
    hidden: int = 1024
    heads: int = 16
    vocab: int = 50304
    seq_len: int = 1024
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    shared_experts: int = 0
    routing: str = "capacity"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_ints(self, "experts", "top_k")
        if not isinstance(self.shared_experts, int) or isinstance(self.shared_experts, bool) or self.shared_experts < 0:
            raise ValueError(f"shared_experts must be a non-negative integer, got {self.shared_experts!r}")
        if not isinstance(self.capacity_factor, (int, float)) or self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be a positive number, got {self.capacity_factor!r}")
        if self.routing not in ("capacity", "dropless"):
            raise ValueError(f"routing must be capacity or dropless, got {self.routing!r}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and experts ({self.experts})")


class Experts(nn.Module):
    """``experts`` two-layer GELU MLPs with stacked weights, run on every expert's slots at once."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn))
        self.w_out = nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.hidden))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` [batch, experts, capacity, hidden] -> the experts' outputs, the same shape."""
        hidden = F.gelu(torch.einsum("bech,ehf->becf", slots, self.w_in), approximate="tanh")
        return torch.einsum("becf,efh->bech", hidden, self.w_out)


class GroupedExperts(Experts):
    """The experts of dropless routing: their tokens sorted by expert, each expert's rows multiplied by its
    own weights (``offsets``: where each expert's rows end, int32)."""

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``tokens`` [rows, hidden] sorted by expert -> their outputs, [rows, hidden]."""
        hidden = F.gelu(F.grouped_mm(tokens, self.w_in, offs=offsets), approximate="tanh")
        return F.grouped_mm(hidden, self.w_out, offs=offsets)


class MoEMLP(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = cfg.experts, cfg.top_k, cfg.capacity_factor
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.dropless = cfg.routing == "dropless"
        self.experts = GroupedExperts(cfg) if self.dropless else Experts(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        # always-on experts: one dense MLP as wide as all of them (DeepSeek-MoE's fused shared experts)
        self.shared = (gpt.MLP(dataclasses.replace(cfg, ffn=cfg.ffn * cfg.shared_experts))
                       if cfg.shared_experts else None)

    def capacity(self, seq: int) -> int:
        return max(1, math.ceil(self.top_k * seq * self.capacity_factor / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._dropless(x) if self.dropless else self._capacity(x)
        return out if self.shared is None else out + self.shared(x)

    def _dropless(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        e, k = self.num_experts, self.top_k
        probs = F.softmax(self.router(x), dim=-1).reshape(b * t, e)
        gate, expert = probs.topk(k, dim=-1)  # [b*t, k]
        gate = gate / gate.sum(dim=-1, keepdim=True)
        expert = expert.reshape(b * t * k)
        order = expert.argsort(stable=True)  # the assignments sorted by expert
        offsets = F.one_hot(expert, e).sum(dim=0).cumsum(dim=0).to(torch.int32)  # where each expert's rows end
        token = order.div(k, rounding_mode="floor")
        out = self.experts(x.reshape(b * t, h)[token], offsets)  # [b*t*k, h]
        # under autocast the products are 16-bit and the residual stream is not: combine in the stream's dtype
        weighted = (out * gate.reshape(b * t * k)[order].unsqueeze(-1)).to(x.dtype)
        combined = x.new_zeros(b * t, h).index_add(0, token, weighted)
        return self.dropout(combined.view(b, t, h))

    def _capacity(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        e, k, cap = self.num_experts, self.top_k, self.capacity(t)
        probs = F.softmax(self.router(x), dim=-1)  # [b, t, e]
        gate, expert = probs.topk(k, dim=-1)  # [b, t, k]
        gate = gate / gate.sum(dim=-1, keepdim=True)
        expert = expert.reshape(b, t * k)  # assignments in token order
        onehot = F.one_hot(expert, e)  # [b, t*k, e]
        position = ((onehot.cumsum(dim=1) - 1) * onehot).sum(dim=-1)  # slot inside the expert
        keep = position < cap
        # Flat slot in [0, e*cap); dropped assignments go to the spare slot e*cap.
        slot = torch.where(keep, expert * cap + position, torch.full_like(position, e * cap))
        token = torch.arange(t * k, device=x.device).div(k, rounding_mode="floor").expand(b, -1)
        slot_token = torch.full((b, e * cap + 1), t, dtype=torch.long, device=x.device)
        slot_token = slot_token.scatter(1, slot, token)[:, : e * cap]  # token of each slot (t = empty)
        slot_gate = torch.zeros(b, e * cap + 1, dtype=gate.dtype, device=x.device)
        slot_gate = slot_gate.scatter(1, slot, gate.reshape(b, t * k) * keep)[:, : e * cap]
        padded = torch.cat([x, x.new_zeros(b, 1, h)], dim=1)  # row t is the empty slot
        index = slot_token.unsqueeze(-1).expand(-1, -1, h)
        expert_out = self.experts(padded.gather(1, index).view(b, e, cap, h)).reshape(b, e * cap, h)
        # under autocast the products are 16-bit and the residual stream is not: combine in the stream's dtype
        weighted = (expert_out * slot_gate.unsqueeze(-1)).to(padded.dtype)
        combined = padded.new_zeros(b, t + 1, h).scatter_add(1, index, weighted)
        return self.dropout(combined[:, :t])


class Block(gpt.Block):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.mlp = MoEMLP(cfg)


class MoETransformer(gpt.GPT):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg, block=Block)


def build_model(**config) -> MoETransformer:
    """Build the MoE transformer from the gpt keys plus ``experts, top_k, routing, capacity_factor,
    shared_experts``."""
    return MoETransformer(MoEConfig(**config))
