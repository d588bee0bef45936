"""Losses that compare the samples of a batch with each other (CLIP's and SigLIP's contrastive losses).

Most losses are a mean over samples, so data parallelism and micro-batches split them freely.  A contrastive
loss scores each image against every caption of the batch: computed on a data-parallel rank's share alone,
it has fewer negatives, and another value, than on the whole batch.  A model file's ``loss_fn`` calls
``gather_batch`` on the embeddings it compares, as OpenCLIP's ``gather_features`` does:

- in one process (tracing, ``autopar verify``'s reference) it returns its argument;
- on the ranks of a plan, it all-gathers the data-parallel replicas' rows, with gradients.  Every rank then
  computes the whole batch's loss; the all-gather's backward sums every rank's gradient into each rank's own
  rows (``dp`` times the whole loss's), and the data-parallel average of the weights' gradients divides that
  back: the single-process gradient.

The trace notes the call (``OpGraph.loss_gathers_batch``), and the planner then runs one micro-batch per step:
with gradient accumulation, each micro-batch's loss would see only its own samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from autopar.errors import AutoparError


@dataclass(frozen=True)
class _Gathering:
    group: object | None  # the data-parallel ranks' process group; None while tracing (one process)
    num_microbatches: int
    calls: list[int]


_CURRENT: ContextVar[_Gathering | None] = ContextVar("autopar_batch_gathering", default=None)


def gather_batch(t: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` (dim 0: this rank's samples) from every data-parallel rank, in rank order, with
    gradients; ``t`` itself in one process.  For losses that compare the samples of a batch (see the module
    docstring)."""
    state = _CURRENT.get()
    if state is None:
        return t
    state.calls.append(1)
    if state.num_microbatches > 1:
        raise AutoparError(f"the loss gathers the batch (autopar.gather_batch), which needs one micro-batch per "
                           f"step, and this plan runs {state.num_microbatches}: replan the model (its trace asks "
                           "for one) or pass --fix mbs=GLOBAL_BATCH/dp")
    if state.group is None:
        return t
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    return all_gather_tensor_autograd(t.contiguous(), gather_dim=0, group=state.group)


@contextlib.contextmanager
def gathering_over(group: object | None, num_microbatches: int = 1) -> Iterator[list[int]]:
    """Within: ``gather_batch`` gathers over ``group`` (a data-parallel process group of more than one rank),
    or with ``None`` (tracing, a single data-parallel rank) returns its argument; either way it counts its calls
    and refuses to run under ``num_microbatches > 1``.  Yields the list its calls append to."""
    calls: list[int] = []
    token = _CURRENT.set(_Gathering(group, num_microbatches, calls))
    try:
        yield calls
    finally:
        _CURRENT.reset(token)


__all__ = ["gather_batch", "gathering_over"]
