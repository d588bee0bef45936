"""Iteration time and memory of a layout: the pipeline, data-parallel and ZeRO models on top of unit costs.

Per micro-batch, a unit costs its forward and backward compute plus its tensor-parallel communication,
which only a framework with TP comm overlap (``Framework.tp_comm_overlap``) hides under the GEMMs.  On top:

- **recomputation**: ``full`` re-runs every layer's forward (compute and its tp communication) during
  backward and keeps only each layer's input; ``selective`` re-runs the attention core and frees what it
  saved (the ``s x s`` tensors of unfused attention, Korthikanti et al. 2022; under flash attention the
  core saves nothing its neighbours do not keep, so it frees little); ``op`` is per-op selective
  checkpointing (``autopar.inter_op.unit_costs``): it keeps the products' and attention's outputs and
  re-runs the rest; ``none`` keeps everything.  Recomputing a layer briefly needs all its activations.
- **ZeRO on dp**: level 1 shards optimizer state, 2 also gradients, 3 also weights (one state formula:
  ``PassContext.state_bytes``).  Levels 0-2 reduce gradients once per iteration in buckets, overlapped with
  the last micro-batch's backward when the framework does that (``overlap_grad_reduce``), else after it;
  levels 1-2 then all-gather the updated weights, under the next forward if ``overlap_param_gather``.
  Level 3 all-gathers each unit's weights in forward (and again in backward when it reshards), and
  reduce-scatters its gradients, every micro-batch, as one collective per block, per module or per
  parameter (``zero3_unit``); prefetched behind compute when the framework prefetches, else waited for.
  At hundreds of ranks the ring latency of each of those collectives is what costs (``autopar.collectives``).
- **pipeline**: stages from the stage DP (``autopar.solvers.stage_dp``) under the memory limit, each
  stage's activations times its in-flight micro-batches (``autopar.solvers.pipeline``); per micro-batch
  and stage boundary one transfer each way, on the critical path unless the framework overlaps it.
  Interleaving with ``v`` chunks divides the bubble by ``v``; the layers need not divide ``pp x v``.
  The zero-bubble schedules (``interleaved_zb``, ``zbv``, ``dualpipev``) split each backward into an input
  step and a weight step (the weight-gradient products, ``UnitCost.bwd_weight_s``) that fills the bubble;
  their time is the simulated schedule, their activations in flight are walked off its op order, and a
  chunk holds its weight-bearing ops' output gradients between the two steps.  Under recomputation the
  weight step runs the checkpointed forward again (its autograd pass is a new graph task, and
  ``torch.utils.checkpoint`` recomputes once per graph task; DualPipeV runs most backwards whole, once).
  In a V (``zbv``, ``dualpipev``) the first rank holds the embedding and the head; a rank's two chunks are
  priced as one run of units (exact for a stack of like layers, approximate for mixed ones).
- **context parallelism** (``autopar.inter_op.context_parallel``): a rank does ``1 / cp`` of every unit's
  token-wise work and attention, and waits for the key/value all-gather and its gradients' reduce-scatter
  over ``cp`` (``cp_comm_s``); the gradient reduction and ZeRO span ``dp x cp``.
- **expert parallelism** (``autopar.inter_op.expert_parallel``): a rank holds ``1 / ep`` of the stacked
  experts and runs them on its ``ep`` group's slots; each experts module waits for two all-to-alls in
  forward (dispatch, combine) and two in backward, with a permuting copy on each side (``ep_comm_s``,
  not overlapped, as torchtitan runs them).  The experts' state, gradient reduction and ZeRO sharding span
  the ``dp / ep`` ranks holding the same experts.
- **overlap costs**: overlapped communication slows the compute beside it: its SMs, its HBM traffic and the
  clock its power costs (``autopar.interference``).
- **host**: each pass of a unit costs the longer of its GPU time and the CPU time of issuing its ops
  (``UnitCost.fwd_host_s``): small layers in an eager runtime are host-bound.
- **optimizer step**: memory-bound, the framework's bytes per parameter it updates (Adam's 28 and the passes
  around it, ``Framework.optimizer_bytes_per_param``).

The iteration time is ``m * t_max + bubble + exposed dp communication + optimizer step``, and the
breakdown adds up to it.

Each technique's rules and terms live in its module, which this one folds together: ``pipelining`` (schedules,
bubble, transfers), ``data_parallel`` (ZeRO state, gradient reduction, accumulation, optimizer step),
``recompute``, ``context_parallel``, ``expert_parallel``; ``links`` gives every axis its link, and ``bound``
the search's lower bounds of what this module estimates.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import Cluster
from autopar.inter_op import techniques
from autopar.inter_op.data_parallel import (
    dp_groups,
    dp_sync_exposed,
    grad_accumulation_s,
    optimizer_params,
)
from autopar.inter_op.layout import Layout
from autopar.inter_op.links import Links, cached_axis_link, layout_links
from autopar.inter_op.pipelining import (
    bubble_bound_s,
    bubble_time_s,
    carried_bytes,
    p2p_s,
    recompute_passes,
    simulated_bubble,
)
from autopar.inter_op.recompute import layer_recompute
from autopar.inter_op.technique import UnitLoadDraft
from autopar.inter_op.unit_costs import POST, PRE, UnitCost, unit_sequence
from autopar.inter_op.units import is_layer_unit
from autopar.interference import compute_rate, overlapped_s
from autopar.ir import OpGraph
from autopar.kernels import memory_s
from autopar.passes.context import PassContext
from autopar.passes.flops import total_flops
from autopar.power import NO_POWER, PowerMix
from autopar.solvers.pipeline import (
    V_SHAPED,
    bubble_s,
    in_flight_microbatches,
    splits_backward,
)
from autopar.solvers.stage_dp import StageSplit, UnitLoad, split_stages, split_uniform_stages, stage_memory_bytes

FLOPS_CONVENTION = {
    "model": "every matrix product of forward and backward (backward = 2x forward), attention scores in full "
             "(no causal discount), no recomputation: the MFU convention of Korthikanti et al. 2022 and PaLM",
    "hardware": "what the kernels execute: causal flash attention skips masked blocks and recomputes scores in "
                "backward; recomputation included (HFU)",
}


@dataclass(frozen=True, slots=True)
class StageEstimate:
    index: int
    units: tuple[int, int]  # unit range [start, end) in unit_sequence order
    layers: tuple[int, int]  # layer range [start, end) of the block stack
    time_s: float  # per micro-batch, p2p included
    memory_bytes: float
    state_bytes: float  # parameters, gradients and optimizer state between steps (``PassContext.state_bytes``)
    activation_bytes: float  # saved activations of the micro-batches in flight and what forward and
    # recomputation hold only while a unit runs (the loss's fp32 logits, a recomputed layer): what torch's
    # MemTracker files as activations
    gathered_weight_bytes: float  # ZeRO-3's gathered weights (this unit's and the prefetched next) and an
    # unsharded gradient, at the unit that peaks; ``memory_bytes`` = held state + the two above, at most
    tp_bytes: dict[str, float]  # collective kind -> bytes of the tp collectives of one micro-batch (``tp_bytes``)
    tp_sync_bytes: dict[str, float]  # the same for the once-per-iteration gradient synchronization on tp
    ep_bytes: dict[str, float]  # the expert-parallel all-to-alls of one micro-batch (``ep_bytes``)
    state_parts_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)  # ``state_bytes`` as weights, gradients
    # and optimizer state (``PassContext.state_parts``)
    parts_s: dict[str, float] = field(default_factory=dict)
    """One micro-batch of ``time_s`` by what the stage does: ``forward_s``, ``recompute_s``, ``backward_s``
    (exposed tp and ZeRO-3 communication included) and ``p2p_s`` add up to it; ``tp_forward_s``,
    ``tp_backward_s`` and ``zero3_s`` are the exposed communication inside them, and ``weight_s`` (split-
    backward schedules) the weight step's share of ``recompute_s + backward_s``."""


@dataclass(frozen=True, slots=True)
class Estimate:
    layout: Layout
    iteration_time_s: float
    tokens_per_s: float
    model_flops_per_iter: float
    hardware_flops_per_iter: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_bytes: float
    fits: bool
    breakdown: dict[str, float]
    stages: tuple[StageEstimate, ...]
    framework: str
    compute_detail: dict[str, float] = field(default_factory=dict)
    """What ``compute_s`` spends on the matrix products, attention and FP8 casts (the slowest stage's
    micro-batches; recomputation is in ``recompute_s``): where an FP8 plan's speed-up goes."""
    precision: str = "bf16"

    def to_dict(self) -> dict[str, Any]:
        return {"compute_detail": dict(self.compute_detail), "precision": self.precision,
            "iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s,
            "model_flops_per_iter": self.model_flops_per_iter,
            "hardware_flops_per_iter": self.hardware_flops_per_iter, "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu, "hfu": self.hfu, "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
            "breakdown": dict(self.breakdown), "framework": self.framework, "flops_convention": FLOPS_CONVENTION,
        }


@dataclass(frozen=True, slots=True)
class _UnitLoad:
    time_s: float
    compute_s: float
    tp_s: float
    tp_fwd_s: float  # the forward's share of ``tp_s``
    cp_s: float  # context parallelism's gather of keys and values and reduce-scatter of their gradients
    cp_fwd_s: float  # the forward's share of ``cp_s``
    recompute_s: float
    zero3_exposed_s: float
    fwd_s: float
    bwd_s: float
    state_bytes: float
    activation_bytes: float
    extra_bytes: float  # alive only while the unit runs: activation transients and ``gathered_bytes``
    gathered_bytes: float  # ZeRO-3's gathered weights and unsharded gradient
    weight_s: float = 0.0  # split backward: the weight step (weight-gradient products, the recomputation again)
    rerun_s: float = 0.0  # split backward: the recomputation the weight step runs again
    residue_bytes: float = 0.0  # split backward: held from the input step to the weight step
    product_s: float = 0.0  # the matrix products' part of ``compute_s``
    attention_s: float = 0.0  # attention's part of ``compute_s``
    fp8_cast_s: float = 0.0  # the FP8 casts' part of ``compute_s``
    ep_s: float = 0.0  # expert parallelism's dispatch and combine all-to-alls, forward and backward
    ep_fwd_s: float = 0.0  # the forward's share of ``ep_s``
    power: PowerMix = NO_POWER  # its kernels at the boost clock (``autopar.power``)
    after_bytes: float = 0.0  # held after the micro-batch's backward (``UnitCost.after_backward_bytes``)

    def merged(self, other: _UnitLoad) -> _UnitLoad:
        """This unit and ``other`` on one rank (a V's first rank holds the embedding and the head)."""
        peak = ("extra_bytes", "gathered_bytes", "after_bytes")
        return _UnitLoad(**{f.name: (max if f.name in peak else operator.add)(getattr(self, f.name),
                                                                               getattr(other, f.name))
                            for f in dataclasses.fields(self)})


@dataclass(frozen=True, slots=True)
class _Span:
    """A run of units' loads summed (a stage's units, ``StageCost.span``)."""

    time_s: float
    compute_s: float
    tp_s: float
    tp_fwd_s: float
    cp_s: float
    cp_fwd_s: float
    ep_s: float
    ep_fwd_s: float
    recompute_s: float
    zero3_s: float
    fwd_s: float
    bwd_s: float
    weight_s: float
    rerun_s: float
    power: PowerMix

    @classmethod
    def of(cls, units: list[_UnitLoad]) -> _Span:
        return cls(sum(x.time_s for x in units), sum(x.compute_s for x in units), sum(x.tp_s for x in units),
                   sum(x.tp_fwd_s for x in units), sum(x.cp_s for x in units), sum(x.cp_fwd_s for x in units),
                   sum(x.ep_s for x in units), sum(x.ep_fwd_s for x in units), sum(x.recompute_s for x in units),
                   sum(x.zero3_exposed_s for x in units), sum(x.fwd_s for x in units), sum(x.bwd_s for x in units),
                   sum(x.weight_s for x in units), sum(x.rerun_s for x in units),
                   sum((x.power for x in units), PowerMix()))


@dataclass(slots=True)
class SharedWork:
    """What ``estimate_layout`` computes alike for many layouts of one search, kept across them: each set of unit
    costs as one of ``cp`` (or ``ep``) ranks runs it, and the units' loads per layout, which the schedule and ``v``
    change only where they split the backward.  Keyed on the identity of the unit-cost dicts, which every entry
    holds, so that a key is never reused while the entry lives.  One per search (or per caller that estimates
    many layouts of one graph, cluster and context)."""

    _shares: dict[tuple, tuple[dict[str, UnitCost], dict[str, UnitCost]]] = field(default_factory=dict)
    _loads: dict[tuple, tuple[dict[str, UnitCost], dict[str, _UnitLoad]]] = field(default_factory=dict)
    _links: dict[tuple, Links] = field(default_factory=dict)
    _members: dict[tuple, tuple[float, float, float, float, float]] = field(default_factory=dict)

    def member_sums(self, costs: dict[str, UnitCost], members: list[str], key: tuple, ep: int,
                    ) -> tuple[float, float, float, float, float]:
        """The local parameters, expert-parallel ones (``ep > 1``), the frozen ones of each, and the tp-synced
        gradients' time of a stage's units ``members``, once per ``key`` (naming ``costs``, kept here, and the
        members)."""
        out = self._members.get(key)
        if out is None:
            out = self._members[key] = (sum(costs[k].params_local for k in members),
                                        sum(costs[k].expert_params_local for k in members) if ep > 1 else 0.0,
                                        sum(costs[k].frozen_local for k in members),
                                        sum(costs[k].frozen_expert_local for k in members) if ep > 1 else 0.0,
                                        sum(costs[k].tp_sync_s for k in members))
        return out

    def links(self, cluster: Cluster, layout: Layout) -> Links:
        """``layout_links``, once per mesh shape (a search's layouts share one cluster)."""
        key = (cluster.gpus, layout.dp, layout.tp, layout.cp, layout.ep)
        if key not in self._links:
            self._links[key] = layout_links(cluster, layout)
        return self._links[key]

    def shares(self, costs: dict[str, UnitCost], layout: Layout, cluster: Cluster) -> dict[str, UnitCost]:
        """``costs`` as one of ``layout.cp`` context-parallel (``layout.ep`` expert-parallel) ranks runs them."""
        sharing = [t for t in techniques.TECHNIQUES if t.share is not None]
        degrees = tuple(t.shares_at(layout) for t in sharing)  # type: ignore[misc]
        if all(d <= 1 for d in degrees):
            return costs
        key = (id(costs), degrees)
        if key not in self._shares:
            out = costs
            for t, degree in zip(sharing, degrees, strict=True):
                if degree > 1:
                    out = {k: t.share(u, layout, cluster) for k, u in out.items()}  # type: ignore[misc]
            self._shares[key] = (costs, out)
        return self._shares[key][1]

    def unit_loads(self, costs: dict[str, UnitCost], keys: list[str], layout: Layout, links: Links,
                   cluster: Cluster, ctx: PassContext) -> dict[str, _UnitLoad]:
        """``_unit_load`` of every distinct unit of ``keys`` under ``layout`` (the caller must not modify it)."""
        split = (layout.schedule, layout.v) if splits_backward(layout.schedule, layout.pp) else None
        key = (id(costs), layout.dp, layout.tp, layout.cp, layout.ep, layout.pp, layout.num_microbatches,
               layout.recompute, layout.sp, layout.zero, split, layout.options)
        if key not in self._loads:
            loads = {k: _unit_load(costs[k], is_layer_unit(k), layout, links, cluster, ctx)
                     for k in dict.fromkeys(keys)}
            self._loads[key] = (costs, loads)
        return self._loads[key][1]


def _unit_load(u: UnitCost, is_layer: bool, layout: Layout, links: Links, cluster: Cluster,
               ctx: PassContext) -> _UnitLoad:
    """What one unit costs a stage per micro-batch under ``layout``: each technique's part of it, folded in the
    registry's order (``autopar.inter_op.techniques``)."""
    d = UnitLoadDraft.start(u, is_layer, layout, links, cluster, ctx)
    for technique in techniques.TECHNIQUES:
        if technique.unit_step is not None:
            technique.unit_step(d)
    time = d.compute_s + d.tp_s + d.cp_s + d.ep_s + d.recompute_s + d.zero3_exposed_s
    return _UnitLoad(time, d.compute_s, d.tp_s, d.tp_fwd_s, d.cp_s, d.cp_fwd_s, d.recompute_s, d.zero3_exposed_s,
                     d.fwd_s, d.bwd_s, d.state_bytes, d.activation_bytes, d.extra_bytes, d.gathered_bytes, d.weight_s,
                     d.rerun_s, d.residue_bytes, u.product_s, u.attention_s, u.fp8_cast_s, d.ep_s, d.ep_fwd_s,
                     u.power, u.after_backward_bytes)


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """FLOPs of one forward+backward pass per sample, computed once per model."""

    model_per_sample: float
    hardware_per_sample: float

    @classmethod
    def of(cls, graph: OpGraph) -> ModelFlops:
        # per-sample nodes scale with the batch; the rest (tiny) is counted once per sample here
        return cls(total_flops(graph, 1, "model"), total_flops(graph, 1, "hardware"))


@dataclass(frozen=True, slots=True)
class StageCost:
    """One pipeline stage per micro-batch: its units' loads summed (``span``), its transfers, and what it holds."""

    span: _Span  # the stage's units: compute, exposed tp / cp / ep / ZeRO-3 communication, recomputation
    p2p_s: float  # exposed pipeline transfers
    accumulate_s: float  # per iteration: adding the micro-batches' gradients
    tp_sync_s: float  # per iteration: tp gradient synchronization of split-computed replicated parameters
    local_params: float  # parameters one device of the stage holds
    expert_params: float  # of which expert-parallel experts
    frozen_params: float = 0.0  # of ``local_params``, frozen (no gradient, no optimizer state)
    frozen_expert_params: float = 0.0  # of ``expert_params``, frozen

    @property
    def time_s(self) -> float:
        """The stage's slot: its units' times and its exposed transfers."""
        return self.span.time_s + self.p2p_s

    @property
    def forward_s(self) -> float:
        """The forward with its exposed tp, cp and ep communication."""
        sp = self.span
        return sp.fwd_s + sp.tp_fwd_s + sp.cp_fwd_s + sp.ep_fwd_s

    def parts(self, layout: Layout) -> dict[str, float]:
        """``StageEstimate.parts_s``: one micro-batch of ``time_s`` by what the stage does."""
        sp = self.span
        tp_bwd, cp_bwd, ep_bwd = sp.tp_s - sp.tp_fwd_s, sp.cp_s - sp.cp_fwd_s, sp.ep_s - sp.ep_fwd_s
        parts = {"forward_s": self.forward_s, "recompute_s": sp.recompute_s,
                 "backward_s": sp.bwd_s + tp_bwd + cp_bwd + ep_bwd + sp.zero3_s, "p2p_s": self.p2p_s,
                 "tp_forward_s": sp.tp_fwd_s, "tp_backward_s": tp_bwd, "cp_forward_s": sp.cp_fwd_s,
                 "cp_backward_s": cp_bwd, "ep_forward_s": sp.ep_fwd_s, "ep_backward_s": ep_bwd,
                 "zero3_s": sp.zero3_s}
        if splits_backward(layout.schedule, layout.pp):
            parts["weight_s"], parts["rerun_s"] = sp.weight_s, sp.rerun_s
        return parts


def estimate_layout(graph: OpGraph, costs: dict[str, UnitCost], layout: Layout, global_batch: int,
                    cluster: Cluster, ctx: PassContext, memory_budget_bytes: float,
                    flops: ModelFlops | None = None, allow_spill: bool = True,
                    prune_above_s: float | None = None, exact_bubble: bool = False, keys: list[str] | None = None,
                    shared: SharedWork | None = None) -> Estimate | None:
    """Estimate ``layout``.  When no stage split fits ``memory_budget_bytes``: the best split ignoring
    memory, marked ``fits=False``, if ``allow_spill``, else ``None``.  ``prune_above_s``: return ``None`` as
    soon as a perfectly balanced pipeline of these units would already be slower (the search's cut-off).
    ``exact_bubble``: simulate every pipeline schedule op by op (what ``autopar.timeline`` draws) instead
    of the closed form, which is exact only for equal stages; the search ranks its last candidates so.
    ``keys``: ``unit_sequence(graph)``, and ``shared``: the work kept across the layouts of one search, where the
    caller has them."""
    keys = keys if keys is not None else unit_sequence(graph)
    shared = shared if shared is not None else SharedWork()
    p, m, v = layout.pp, layout.num_microbatches, layout.v
    costs = shared.shares(costs, layout, cluster)
    links = shared.links(cluster, layout)
    tp_link = links.tp
    pp_link = cached_axis_link(cluster, p, layout.replicas * layout.tp)
    by_key = shared.unit_loads(costs, keys, layout, links, cluster, ctx)
    v_shaped = layout.schedule in V_SHAPED and p > 1
    if v_shaped:  # the first rank holds both ends of the V
        by_key = {**by_key, PRE: by_key[PRE].merged(by_key[POST]), POST: _EMPTY_LOAD}
    loads = [by_key[k] for k in keys]
    if prune_above_s is not None and m * sum(x.time_s for x in loads) / p > prune_above_s:
        return None
    residue = sum(x.residue_bytes for x in loads) / max(1.0, sum(x.activation_bytes for x in loads))
    in_flight = [in_flight_microbatches(layout.schedule, i, p, m, v, residue, layout.group) for i in range(p)]
    tied = tied_params(costs) if p == 1 else 0.0  # one stage holds both ends: count the shared ones once
    tied_frozen = tied_params(costs, frozen=True) if p == 1 else 0.0
    tie_state = ctx.state_bytes(tied, layout.replicas, layout.zero, tied_frozen)
    tie_parts = ctx.state_parts(tied, layout.replicas, layout.zero, tied_frozen)
    tie_bytes = tie_state + ctx.held_bytes(tied, layout.replicas, layout.zero, p, m, tied_frozen)
    split_by = ctx.framework.pipeline_split
    split = _split(keys, by_key, loads, in_flight, memory_budget_bytes + tie_bytes, split_by)
    fits = split is not None
    if split is None and not allow_spill:
        return None
    if split is None:  # report the best split ignoring memory, marked as not fitting
        split = _split(keys, by_key, loads, in_flight, float("inf"), split_by)
        if split is None:
            return None
    if v > 1 and not _chunks_fit(split, p, v, len(keys), layout.schedule in V_SHAPED):
        return None
    spans = [_Span.of(loads[split.boundaries[k]:split.boundaries[k + 1]]) for k in range(p)]
    if prune_above_s is not None and p > 1:
        # the stages' units alone (no transfers yet) in the closed form's slots, or m of them: a floor of the
        # iteration, checked before each stage's transfers, power and dp traffic are priced
        floor = [span.time_s for span in spans]
        if simulated_bubble(layout):  # ``bubble_bound_s`` on these floors: the forwards ahead of each rank's first
            start, slots = 0.0, 0.0
            for k, span in enumerate(spans):
                slots = max(slots, start + m * floor[k])
                start += (span.fwd_s + span.tp_fwd_s + span.cp_fwd_s + span.ep_fwd_s) / v
        else:
            slots = m * max(floor) + bubble_s(floor, v, m)
        if slots > prune_above_s:
            return None
    fw = ctx.framework
    # beside the hidden state, each boundary hands on an encoder's output for the decoder's layers
    carried = carried_bytes(graph, layout.mbs) if p > 1 else 0.0
    stage_times, dp_exposed = [], 0.0
    per_stage: list[StageCost] = []
    members = _stage_members(keys, split, layout)
    for k in range(p):  # what the iteration time needs; the stages' details wait until it is not pruned
        a, b = split.boundaries[k], split.boundaries[k + 1]
        span = spans[k]
        neighbours = (1 if k > 0 else 0) + (1 if k < p - 1 else 0)
        boundary = max(costs[keys[a]].input_bytes if k > 0 else 0.0,
                       costs[keys[b]].input_bytes if b < len(keys) else 0.0) + carried
        # per micro-batch and chunk, an activation and a gradient cross each neighbour's link, one each way: batched,
        # a step's send and receive share the time of one transfer; one blocking call after the other, the stage
        # waits through both (``Framework.pp_p2p_batched``)
        calls = 1 if fw.pp_p2p_batched else 2
        p2p = calls * neighbours * p2p_s(boundary, layout, pp_link, tp_link, ctx) * v if p > 1 else 0.0
        busy, mix = span.compute_s, span.power
        p2p_cost = p2p
        if fw.pp_p2p_overlap and p2p > 0:  # sent under the next micro-batch's compute, which it slows
            p2p_cost = overlapped_s(p2p, busy, compute_rate(cluster, pp_link, mix))
        member_key = (id(costs), a, b, v_shaped and k == 0, v_shaped and k == p - 1, layout.ep > 1)
        local, expert_local, frozen, frozen_expert, tp_sync = shared.member_sums(costs, members[k], member_key,
                                                                                layout.ep)
        # the one stage holding both ends of a tie accumulates, reduces and updates the shared weights once
        dense, dense_frozen = local - expert_local - tied, frozen - frozen_expert - tied_frozen
        trained = dense - dense_frozen  # frozen ones: no gradient, no update
        trained_expert = expert_local - frozen_expert
        accumulate = grad_accumulation_s(trained, layout, cluster, ctx, layout.replicas) \
            + grad_accumulation_s(trained_expert, layout, cluster, ctx, layout.expert_replicas)
        stage = StageCost(span, p2p_cost, accumulate, tp_sync, local, expert_local, frozen, frozen_expert)
        stage_times.append(stage.time_s)
        groups = dp_groups(dense, expert_local, dense_frozen, frozen_expert, links, ctx)
        dp_exposed = max(dp_exposed, dp_sync_exposed(groups, span.bwd_s, span.fwd_s, layout, cluster, ctx, mix))
        per_stage.append(stage)
    bottleneck = max(range(p), key=lambda k: stage_times[k])
    bn = per_stage[bottleneck].span
    accumulation_s = max(s.accumulate_s for s in per_stage)
    local_opt = max(optimizer_params(s.local_params - s.frozen_params - (tied - tied_frozen),
                                     s.expert_params - s.frozen_expert_params, layout) for s in per_stage)
    optimizer_s = memory_s(cluster, local_opt * fw.optimizer_bytes_per_param)
    breakdown = {
        "compute_s": m * bn.compute_s + optimizer_s + accumulation_s,
        "tp_comm_s": m * bn.tp_s + max(s.tp_sync_s for s in per_stage),
        "cp_comm_s": m * bn.cp_s,
        "ep_comm_s": m * bn.ep_s,
        "recompute_s": m * bn.recompute_s,
        "pp_p2p_s": m * per_stage[bottleneck].p2p_s,
        "pp_bubble_s": 0.0,
        "dp_comm_exposed_s": m * bn.zero3_s + dp_exposed,
    }
    parts = [s.parts(layout) for s in per_stage]
    if prune_above_s is not None and sum(breakdown.values()) + bubble_bound_s(parts, stage_times, layout) \
            > prune_above_s:
        return None  # slower than the cut-off before its full bubble (which a simulated schedule makes costly)
    breakdown["pp_bubble_s"] = bubble_time_s(parts, stage_times, layout, exact_bubble)
    stages = []
    for k in range(p):
        a, b = split.boundaries[k], split.boundaries[k + 1]
        units = loads[a:b]
        layer_idx = [i - 1 for i in range(a, b) if 0 < i < len(keys) - 1]
        last = len(keys) - 2
        layers = (layer_idx[0], layer_idx[-1] + 1) if layer_idx else ((0, 0) if a == 0 else (last, last))
        sc = per_stage[k]
        dense = (sc.local_params - sc.expert_params, layout.replicas, layout.zero,
                 sc.frozen_params - sc.frozen_expert_params)
        experts = (sc.expert_params, layout.expert_replicas, layout.zero, sc.frozen_expert_params)
        state = ctx.state_bytes(*dense) + ctx.state_bytes(*experts) - tie_state
        state_parts = tuple(x + y - z for x, y, z in zip(ctx.state_parts(*dense), ctx.state_parts(*experts),
                                                         tie_parts, strict=True))
        memory = split.stage_memory_bytes[k] - tie_bytes
        held = sum(x.state_bytes for x in units) - tie_bytes  # the state and the copies held through the step
        gathered = max(x.gathered_bytes for x in units)
        stages.append(StageEstimate(k, (a, b), layers, stage_times[k], memory, state, memory - held - gathered,
                                    gathered, tp_bytes(costs, members[k], layout),
                                    _summed(costs[key].tp_sync_bytes for key in members[k]),
                                    ep_bytes(costs, members[k], layout), state_parts, parts[k]))
    iteration = sum(breakdown.values())
    flops = flops or ModelFlops.of(graph)
    model_flops = flops.model_per_sample * global_batch
    hw_flops = flops.hardware_per_sample * global_batch + _recompute_flops(costs, keys, layout, global_batch, ctx)
    n = layout.devices
    peak = max(s.memory_bytes for s in stages)
    return Estimate(
        layout=layout, iteration_time_s=iteration, tokens_per_s=global_batch * graph.seq_len / iteration,
        model_flops_per_iter=model_flops, hardware_flops_per_iter=hw_flops,
        tflops_per_gpu=model_flops / iteration / n / 1e12, mfu=model_flops / iteration / n / cluster.peak_flops,
        hfu=hw_flops / iteration / n / cluster.peak_flops, peak_memory_bytes=peak,
        fits=fits and peak <= memory_budget_bytes, breakdown=breakdown, stages=tuple(stages), framework=fw.name,
        compute_detail=_compute_detail(loads[split.boundaries[bottleneck]:split.boundaries[bottleneck + 1]], m),
        precision=ctx.precision.training)


def _compute_detail(units: list[_UnitLoad], m: int) -> dict[str, float]:
    """``Estimate.compute_detail`` from the slowest stage's units (summed only for the layout kept)."""
    return {"products_s": m * sum(x.product_s for x in units), "attention_s": m * sum(x.attention_s for x in units),
            "fp8_casts_s": m * sum(x.fp8_cast_s for x in units)}


_EMPTY_LOAD = _UnitLoad(**{f.name: 0.0 for f in dataclasses.fields(_UnitLoad) if f.name != "power"})


def _stage_members(keys: list[str], split: StageSplit, layout: Layout) -> list[list[str]]:
    """The units each pipeline rank holds: its range of the split, and in a V the head on the first rank."""
    members = [keys[split.boundaries[k]:split.boundaries[k + 1]] for k in range(layout.pp)]
    if layout.schedule in V_SHAPED and layout.pp > 1:
        members[-1] = [k for k in members[-1] if k != POST]
        members[0] = [*members[0], POST]
    return members


def _summed(parts) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for kind, nbytes in part.items():
            out[kind] = out.get(kind, 0.0) + nbytes
    return out


def tp_bytes(costs: dict[str, UnitCost], keys: list[str], layout: Layout) -> dict[str, float]:
    """Bytes the tensor-parallel collectives of one micro-batch move through the units ``keys``, by
    collective kind and sized as ``autopar.collectives`` prices them (all-gather: the gathered tensor;
    reduce-scatter: its input; all-reduce: the tensor; all-to-all: one rank's buffer).  Forward and
    backward, and the forward again for layers under full recomputation."""
    def unit(key: str) -> list[dict[str, float]]:
        u = costs[key]
        again = layout.recompute == "full" and is_layer_unit(key)
        return [u.tp_fwd_bytes, u.tp_bwd_bytes, *([u.tp_fwd_bytes] if again else [])]
    return _summed(part for key in keys for part in unit(key))


def ep_bytes(costs: dict[str, UnitCost], keys: list[str], layout: Layout) -> dict[str, float]:
    """Bytes the expert-parallel all-to-alls of one micro-batch move through the units ``keys`` (one rank's
    buffer each, as ``autopar.collectives.all_to_all_s`` prices them): dispatch and combine in forward, their
    gradients in backward, and the forward's again under full or per-op recomputation."""
    if layout.ep <= 1:
        return {}
    # the forward again under full or per-op recomputation, once more for a split backward's weight steps
    again = recompute_passes(layout)
    passes = 2 + (again if layout.recompute in ("full", "op") else 0)
    total = sum((passes if is_layer_unit(key) else 2) * (costs[key].expert_dispatch_bytes
                                                             + costs[key].expert_combine_bytes)
                for key in keys if costs[key].expert_fqns)
    return {"all_to_all": total} if total else {}


def _chunks_fit(split: StageSplit, p: int, v: int, num_units: int, v_shaped: bool = False) -> bool:
    """Interleaving cuts every stage into ``v`` chunks: a stage needs ``v`` layers, one fewer at either end
    of the pipeline, whose first (last) chunk may hold only the embedding (head), as in Llama 3.  In a V
    both ends are on the first rank."""
    for k in range(p):
        a, b = split.boundaries[k], split.boundaries[k + 1]
        layers = sum(1 for i in range(a, b) if 0 < i < num_units - 1)
        ends = 2 if v_shaped and k == 0 else 0 if v_shaped else (1 if k == 0 else 0) + (1 if k == p - 1 else 0)
        if layers < v - ends:
            return False
    return True


def _dealt(count: int, parts: int) -> list[int]:
    """Cumulative bounds of ``count`` items dealt into ``parts`` equal parts, the earlier parts one more."""
    base, extra = divmod(count, parts)
    return list(itertools.accumulate((base + (k < extra) for k in range(parts)), initial=0))


def _uniform_split(loads: list[_UnitLoad], in_flight: list[float], budget: float,
                   ends_are_units: bool = False) -> StageSplit | None:
    """Layers dealt out evenly (earlier stages one more), embedding on the first stage and head on the last,
    as Megatron-LM and DeepSpeed's ``type:transformer`` partition do; with ``ends_are_units`` the embedding,
    the final norm and the head are dealt out beside the layers (Aleph Alpha Scaling's
    ``pipe_partition_uniform`` over its layer specs: 40 layers on 2 stages give the embedding and 21 layers,
    then 19, the norm and the head).  ``None`` if a stage does not fit."""
    p, n = len(in_flight), len(loads) - 2
    if p > n:
        return None
    if ends_are_units:  # items: the embedding (load 0), the layers (1..n), the final norm and the head (n + 1)
        bounds = [min(b, n + 1) for b in _dealt(n + 3, p)[:-1]] + [n + 2]
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            return None  # the final norm on a stage of its own: these loads keep it with the head (not priced)
    else:  # the embedding joins the first stage, the head the last
        bounds = [0] + [b + 1 for b in _dealt(n, p)[1:]]
        bounds[-1] += 1
    times, mems = [], []
    for k in range(p):
        units = loads[bounds[k]:bounds[k + 1]]
        times.append(sum(u.time_s for u in units))
        mems.append(stage_memory_bytes([u.state_bytes for u in units], [u.activation_bytes for u in units],
                                       [u.extra_bytes for u in units], in_flight[k], [u.after_bytes for u in units]))
    if max(mems) > budget:
        return None
    return StageSplit(tuple(bounds), tuple(times), tuple(mems))


def _split(keys: list[str], by_key: dict[str, _UnitLoad], loads: list[_UnitLoad], in_flight: list[float],
           budget: float, pipeline_split: str = "balanced") -> StageSplit | None:
    """The stage DP (the closed form when every layer is alike, the common case), or the framework's own
    uniform split (``Framework.pipeline_split``)."""
    if pipeline_split != "balanced" and len(in_flight) > 1:
        return _uniform_split(loads, in_flight, budget, ends_are_units=pipeline_split == "uniform_units")
    layer_keys = set(keys[1:-1])
    if len(layer_keys) == 1:
        pre, layer, post = (_as_solver_load(by_key[k]) for k in (keys[0], keys[1], keys[-1]))
        return split_uniform_stages(pre, layer, post, len(keys) - 2, tuple(in_flight), budget)
    return split_stages([x.time_s for x in loads], [x.state_bytes for x in loads],
                        [x.activation_bytes for x in loads], in_flight, budget, [x.extra_bytes for x in loads],
                        [x.after_bytes for x in loads])


def _as_solver_load(x: _UnitLoad) -> UnitLoad:
    return UnitLoad(x.time_s, x.state_bytes, x.activation_bytes, x.extra_bytes, x.after_bytes)


def tied_params(costs: dict[str, UnitCost], frozen: bool = False) -> float:
    """Local parameters that several units read (tied embeddings: the embedding's, the head's, an encoder-decoder's
    second embedding), beyond one copy each: what one stage holding all those units counts twice; ``frozen``: of
    those, the frozen ones."""
    seen: dict[str, int] = {}
    for u in costs.values():
        for fqn in u.param_local:
            seen[fqn] = seen.get(fqn, 0) + 1
    tied = {fqn: copies - 1 for fqn, copies in seen.items() if copies > 1}
    if frozen:
        frozen_fqns = {f for u in costs.values() for f in u.frozen_fqns}
        tied = {f: extra for f, extra in tied.items() if f in frozen_fqns}
    local = {f: n for u in costs.values() for f, n in u.param_local.items()}
    return sum(extra * local[f] for f, extra in tied.items())


def _recompute_flops(costs: dict[str, UnitCost], keys: list[str], layout: Layout, global_batch: int,
                     ctx: PassContext) -> float:
    micro = global_batch / max(1, layout.mbs)  # micro-batches over all dp ranks
    again = recompute_passes(layout)  # weight steps too
    return again * micro * sum(layer_recompute(costs[k], layout.recompute, ctx.framework).flops
                               for k in keys if is_layer_unit(k))
