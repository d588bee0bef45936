"""Distributed checkpoints (``torch.distributed.checkpoint``) that move between plans.

Each rank saves the model state it holds: FSDP and tensor-parallel shards as DTensors, pipeline stages
as their own layers.  Loading lays the saved tensors onto whatever the current plan shards, so a run can
stop under one layout and resume under another.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


def _modules(trainer: object) -> list[nn.Module]:
    return list(trainer.parts)


def save(trainer: object, path: str | Path) -> None:
    """Write this rank's part of the model state under ``path`` (a directory)."""
    state: dict = {}
    for m in _modules(trainer):
        state.update(get_model_state_dict(m))
    dcp.save(state, checkpoint_id=str(path))


def load(trainer: object, path: str | Path) -> None:
    """Read the state this rank holds from ``path``, resharded to the current plan."""
    for m in _modules(trainer):
        state = get_model_state_dict(m)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(m, state, options=StateDictOptions(strict=True))
