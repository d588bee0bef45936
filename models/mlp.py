"""A deep MLP classifier: ``layers`` hidden blocks of Linear + GeLU (+ residual), a classifier head.

A model file for ``autopar plan``: inputs are float features ``[batch, in_dim]`` and integer labels
``[batch]``; the loss is cross-entropy on the class logits.  Defaults: 16 blocks of width 4096.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from autopar.models.config_checks import require_positive_ints
from torch import nn


@dataclass(kw_only=True)
class MLPConfig:
    layers: int = 16
    hidden: int = 4096
    in_dim: int = 1024
    classes: int = 1000

    def __post_init__(self) -> None:
        require_positive_ints(self, "layers", "hidden", "in_dim", "classes")


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.in_dim, cfg.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(cfg.hidden) for i in range(cfg.layers)})
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: features [b, in_dim] (or hidden states [b, hidden] without ``inp``); returns logits."""
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)  # [b, classes]
        return x


def build_model(**config) -> MLP:
    """Build the MLP from config keys ``layers, hidden, in_dim, classes``."""
    return MLP(MLPConfig(**config))


def example_inputs(batch_size: int, seq_len: int, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features ``[batch, in_dim]`` and labels ``[batch]`` (``seq_len`` is unused)."""
    cfg = MLPConfig(**config)
    return torch.randn(batch_size, cfg.in_dim), torch.randint(0, cfg.classes, (batch_size,))


def loss_fn(output: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, labels)
