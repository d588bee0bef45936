"""Sequence parallelism (Korthikanti et al. 2022): with ``tp > 1``, the residual stream between the tensor-parallel
regions split on the sequence over the ``tp`` ranks, where the framework implements it
(``Framework.sequence_parallel``).  The intra-op ILP prices it (``IntraOpConfig.sequence_parallel``); the
framework's tp-communication overlap needs it (``autopar.inter_op.tp_overlap``), and expert parallelism refuses
it (``autopar.inter_op.expert_parallel``, whose ``expand`` applies that rule).
"""

from __future__ import annotations

from collections.abc import Iterator

from autopar.inter_op.layout import Knob
from autopar.inter_op.technique import Partial, SearchSpace, Technique


def sequence_parallel_options(tp: int, space: SearchSpace) -> list[bool]:
    """Off, and on where there is a tp axis to split the sequence over and the framework implements it."""
    return space.allowed("sp", [False, True] if tp > 1 and space.fw.sequence_parallel else [False])


def _expand(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    for sp in sequence_parallel_options(p["tp"], space):
        yield {**p, "sp": sp}


TECHNIQUE = Technique("sequence_parallel", (Knob("sp", "switch"),), expand=_expand)

__all__ = ["TECHNIQUE", "sequence_parallel_options"]
