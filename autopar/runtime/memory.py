"""Measured activation memory of one training step, to hold against the plan's estimate
(``autopar verify --memory``).

torch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2 modules, which files FSDP's gathered parameters and
its collective buffers under their own categories) sorts every allocation by what made it; the figure
taken is the peak of the ``Activation`` category over one step's forward and backward: what forward (and
recomputation in backward) allocates and holds, on the device that runs the step.  It works on CPU and
on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from unittest import mock

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.nn.modules.module import register_module_forward_pre_hook

T = TypeVar("T")


def _recomputing() -> bool:
    """Whether an activation checkpoint is re-running its forward now (inside backward): its saved-tensor
    hooks are the innermost ones."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass now."""
    return torch._C._current_graph_task_id() != -1


class _PeakActivations:
    """Records the largest ``Activation`` total seen after any op.  What is made in backward is filed as
    temporary unless an activation checkpoint is recomputing, by what autograd and torch's checkpoint are
    doing: the trackers infer both from module hooks, which miss a pipeline stage's backward (its
    gradients were filed as activations), an activation checkpoint inside an FSDP block (FSDPMemTracker
    watches FSDP modules only), and the end of a recomputation that stops early (its module's forward
    never returns)."""

    peak_activation_bytes = 0

    def _track(self, reftype, t: torch.Tensor) -> None:
        refs = self._ref_class
        if reftype in (refs.ACT, refs.TEMP):
            reftype = refs.TEMP if _in_backward() and not _recomputing() else refs.ACT
        super()._track(reftype, t)

    def _update_peak_stats(self, peak_state) -> None:  # called by MemTracker after every op
        super()._update_peak_stats(peak_state)
        act = self._ref_class.ACT
        for snap in self._curr_mem_snap.values():
            self.peak_activation_bytes = max(self.peak_activation_bytes, snap.get(act, 0))


class _Tracker(_PeakActivations, MemTracker):
    pass


class _FSDPTracker(_PeakActivations, FSDPMemTracker):
    """Files what FSDP2's all-gathers allocate as ``All Gather``, the unsharded parameters they are copied
    out to as ``Unsharded Param`` and its gradient reductions' buffers as ``Reduce Scatter``.  torch's
    tracker retags them only when it sees the collective between an FSDP pre-forward and its forward (or
    a post-backward and its reduction), so a gather issued earlier (a prefetch, or a block's gather during
    the root's pre-forward) stays filed as an activation: measured on gloo, whole bf16 blocks of weights;
    and ``replicate``, which gathers nothing, casts each parameter to bf16 outside any collective."""

    filing_as = None

    def _track(self, reftype, t: torch.Tensor) -> None:
        super()._track(self.filing_as or reftype, t)

    @contextlib.contextmanager
    def filing_fsdp_buffers(self) -> Iterator[None]:
        def filed(real: Callable, reftype: _FSDPRefType) -> Callable:
            def call(*args: object, **kwargs: object) -> object:
                self.filing_as = reftype
                try:
                    return real(*args, **kwargs)
                finally:
                    self.filing_as = None
            return call

        group, unshard = _fsdp_param_group, _fsdp_param_group.FSDPParamGroup.wait_for_unshard
        with (mock.patch.object(group, "foreach_all_gather", filed(group.foreach_all_gather, _FSDPRefType.ALL_GATHER)),
              # the copy out of the gather, or (replicate, one rank) the cast copy of each parameter
              mock.patch.object(group.FSDPParamGroup, "wait_for_unshard",
                                filed(unshard, _FSDPRefType.UNSHARDED_PARAM)),
              mock.patch.object(group, "foreach_reduce", filed(group.foreach_reduce, _FSDPRefType.REDUCE_SCATTER))):
            yield


def activation_peak_bytes(parts: Sequence[nn.Module], forward_backward: Callable[[], T]) -> tuple[T, int | None]:
    """Run ``forward_backward`` (every micro-batch's forward and backward through ``parts``, this rank's
    model chunks, as ``Trainer.forward_backward`` runs them) under torch's memory tracker; returns what it
    returned and the peak bytes of activations, ``None`` where the tracker cannot follow the parts
    (several FSDP roots on one rank, as interleaved pipelining has: then it runs untracked).  The
    optimizer step and gradient clipping stay outside: their temporaries are no activations."""
    if len(parts) != 1:
        return forward_backward(), None
    part = parts[0]
    if isinstance(part, FSDPModule):
        tracker = _FSDPTracker(part)
        filing = tracker.filing_fsdp_buffers()
    else:
        tracker = _Tracker()
        tracker.track_external(part)
        filing = contextlib.nullcontext()

    def pre_forward(module: nn.Module, _args: object) -> None:
        # the trackers take a second forward of their root for a second iteration and refuse it; here it is
        # the next micro-batch, and only the device totals are read, so the root's own statistics restart
        if module is part and module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            del tracker.memory_tracking[module]

    handle = register_module_forward_pre_hook(pre_forward)  # global: runs before the trackers' own hooks
    try:
        with filing, tracker:
            result = forward_backward()
    finally:
        handle.remove()
    return result, int(tracker.peak_activation_bytes)


__all__ = ["activation_peak_bytes"]
