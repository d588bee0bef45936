"""The registry of the inter-op planner's techniques.

Their order is the order the search sets their knobs in (a technique's options may read the knobs set before it:
``cp`` what ``tp`` leaves, ``ep`` the ``dp`` the pipeline stages leave, the schedule the micro-batches) and the
order the estimate folds their parts of a unit's load in (recomputation before the exchanges that re-run under it,
ZeRO-3's gathers beside the compute and recomputation, the split backward last).  Adding a technique: its module
(with its ``Technique``), one line here, its tests.
"""

from __future__ import annotations

from autopar.inter_op import (
    context_parallel,
    data_parallel,
    expert_parallel,
    pipelining,
    recompute,
    sequence_parallel,
    tensor_parallel,
    tp_overlap,
)
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

__all__ = ["TECHNIQUES"]
