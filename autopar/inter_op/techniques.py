"""The registry of the inter-op planner's techniques.

Their order is the order the search sets their knobs in (a technique's options may read the knobs set before it:
``cp`` what ``tp`` leaves, ``ep`` the ``dp`` the pipeline stages leave, the schedule the micro-batches) and the
order the estimate folds their parts of a unit's load in (recomputation before the exchanges that re-run under it,
ZeRO-3's gathers beside the compute and recomputation, the split backward last).  What ``--fix`` pins and what a
framework profile's technique tables hold are read from the registered techniques' ``knobs`` and ``flags`` here.
Adding a technique: its module (with its ``Technique``), one line here, its tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.inter_op import (
    context_parallel,
    data_parallel,
    expert_parallel,
    layout,
    pipelining,
    recompute,
    sequence_parallel,
    tensor_parallel,
    tp_overlap,
)
from autopar.inter_op.layout import Knob
from autopar.inter_op.technique import Technique

TECHNIQUES: tuple[Technique, ...] = (
    tensor_parallel.TECHNIQUE,
    tp_overlap.TECHNIQUE,
    sequence_parallel.TECHNIQUE,
    recompute.TECHNIQUE,
    context_parallel.TECHNIQUE,
    pipelining.STAGES,
    expert_parallel.TECHNIQUE,
    data_parallel.MICRO_BATCHES,
    data_parallel.TECHNIQUE,
    pipelining.TECHNIQUE,
)


def knobs() -> list[Knob]:
    """Every registered technique's layout knobs, in the registry's order."""
    return [k for t in TECHNIQUES for k in t.knobs]


def fix_keys() -> list[str]:
    """The layout keys ``--fix`` may pin."""
    return [k.name for k in knobs() if k.pinnable]


def parse_fix(text: str | None) -> dict[str, Any]:
    """``dp=4,tp=8,schedule=1f1b,sp=on`` -> typed values, as the registered techniques declare their knobs."""
    return layout.parse_fix(text, knobs())


def normalize_fix(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A dict of pinned layout keys (from ``--fix``, the API or a JSONL line), typed and checked."""
    return layout.normalize_fix(raw, knobs())


def framework_flags() -> dict[str, dict[str, bool | int | float | str]]:
    """The framework flags registered techniques read beyond ``Framework``'s fields, by technique (the TOML table
    that holds them), each with its default."""
    return {t.name: dict(t.flags) for t in TECHNIQUES if t.flags}


__all__ = ["TECHNIQUES", "fix_keys", "framework_flags", "knobs", "normalize_fix", "parse_fix"]
