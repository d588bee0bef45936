"""Lower bounds of a layout's iteration time and memory, in O(p) per layout, that the search prunes with.

``estimate_layout`` prices a layout as ``m * t_max + bubble + optimizer + accumulation + tp sync + exposed dp``,
where ``t_max`` is the slowest stage's time per micro-batch and the stages come from the stage DP under the
memory limit.  Every term here is a value that term can never go below, whatever the split:

- **stages**: the stages' times add up to at least the units' work ``W`` (compute at the longer of the GPU's and
  the host's timeline, the tp communication a framework does not hide, the recomputation), so
  ``t_max >= W / p``;
- **bubble**: the closed form ``m t_max + (T - t_max) / v`` of GPipe, 1F1B and interleaving is at least
  ``(W / p) (m + (p - 1) / v)``; a simulated schedule (zero-bubble, or interleaving with few micro-batches or
  Llama 3's groups) takes at least ``m t_max``, as every rank runs its ``m`` micro-batches one after another, and
  one that does not split the backward at least ``W``: the first micro-batch's forward and backward pass every
  chunk in turn;
- **optimizer step, gradient accumulation, tp gradient sync**: linear in a stage's parameters, so at least their
  value at the mean stage;
- **dp / ZeRO 0-2**: the reductions and gathers the framework runs after the compute
  (``data_parallel.dp_sync_floor_s``), at the mean stage's parameters;
- **memory**: a stage holds its state and ``in_flight`` micro-batches of its activations, so the fullest stage
  holds at least the mean of the state plus the fewest in flight times the activations.

Each term comes from its technique's module (``Technique.time_bound_s`` and ``memory_bound_bytes``: tensor
parallelism's gradient sync, data parallelism's floor and state, the pipeline schedule's slots and activations in
flight); the bounds are their sums.  ``tests/test_bound.py`` checks on random layouts of several models that the
bounds never exceed the estimate.
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.inter_op import techniques
from autopar.inter_op.estimate import tied_params
from autopar.inter_op.layout import Layout
from autopar.inter_op.links import Links
from autopar.inter_op.recompute import layer_recompute
from autopar.inter_op.technique import Technique, UnitTotals
from autopar.inter_op.unit_costs import UnitCost
from autopar.inter_op.units import is_layer_unit
from autopar.passes.context import PassContext


def unit_totals(costs: dict[str, UnitCost], counts: dict[str, int], layout: Layout, ctx: PassContext) -> UnitTotals:
    """``UnitTotals`` of ``costs`` (already as one of ``cp`` / ``ep`` ranks runs them) under ``layout``'s
    recomputation, sequence parallelism and ep; ``counts``: how often each unit key occurs."""
    fw = ctx.framework
    hidden_tp = fw.tp_comm_overlap and layout.sp
    work = rerun = sync = dense = experts = dense_frozen = expert_frozen = act = 0.0
    for k, n in counts.items():
        u = costs[k]
        tp = 0.0 if hidden_tp else u.tp_fwd_s + u.tp_bwd_s
        work += n * (max(u.fwd_s, u.fwd_host_s) + max(u.bwd_s, u.bwd_host_s) + tp)
        sync += n * u.tp_sync_s
        d, e, fd, fe = u.parameter_split(layout.ep)
        dense += n * d
        experts += n * e
        dense_frozen += n * fd
        expert_frozen += n * fe
        if not is_layer_unit(k):
            act += n * u.activation_bytes
        else:
            rc = layer_recompute(u, layout.recompute, fw)
            rerun += n * rc.time_s
            act += n * rc.saved_bytes
    return UnitTotals(work, rerun, sync, dense, experts, act, tied_params(costs), dense_frozen, expert_frozen,
                      tied_params(costs, frozen=True))


def time_bound_s(t: UnitTotals, layout: Layout, cluster: Cluster, ctx: PassContext, links: Links,
                 memo: dict[tuple, float] | None = None, deferred: Technique | None = None) -> float:
    """A lower bound of ``estimate_layout``'s iteration time for ``layout`` on units totalling ``t``; ``links``: the
    layout's (``links.layout_links``).  The sum of the registered techniques' terms.  ``memo``: a search's terms of
    the techniques that say what they read (``Technique.bound_reads``), keyed on the identities of ``t`` and
    ``links`` (the caller keeps them alive) and those fields.  ``deferred``: a technique whose knobs may take any
    value (``layout``'s are one of them): its floor (``Technique.time_bound_floor_s``) stands for its term, and the
    sum bounds every layout that differs from ``layout`` only in those knobs."""
    total = 0.0
    for technique in techniques.TECHNIQUES:
        if technique is deferred and technique.time_bound_floor_s is not None:
            total += technique.time_bound_floor_s(t, layout, links, cluster, ctx)
            continue
        if technique.time_bound_s is None:
            continue
        if memo is None or technique.bound_reads is None:
            total += technique.time_bound_s(t, layout, links, cluster, ctx)
            continue
        key = (technique.name, id(t), id(links), *technique.bound_reads(layout))
        term = memo.get(key)
        if term is None:
            term = memo[key] = technique.time_bound_s(t, layout, links, cluster, ctx)
        total += term
    return total


def memory_bound_bytes(t: UnitTotals, layout: Layout, ctx: PassContext) -> float:
    """A lower bound of the fullest stage's memory for ``layout``, less what ``estimate_layout`` adds to the budget
    (the tied parameters one stage holding both ends counts once): the layout cannot fit where this exceeds the
    memory budget.  The sum of the registered techniques' terms."""
    return sum(technique.memory_bound_bytes(t, layout, ctx) for technique in techniques.TECHNIQUES
               if technique.memory_bound_bytes is not None)


__all__ = ["UnitTotals", "memory_bound_bytes", "time_bound_s", "unit_totals"]
