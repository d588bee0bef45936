"""Data parallelism and ZeRO: the state a device holds at each level, the gradient reduction and weight gathers that
compute does not hide, gradient accumulation and the optimizer step.

Levels 0-2 reduce gradients once per iteration in buckets (every micro-batch at level 2 without pipelining),
overlapped with the last micro-batch's backward where the framework does that (``overlap_grad_reduce``), else
after it; levels 1-2 then all-gather the updated weights, under the next forward if ``overlap_param_gather``.
Level 3 all-gathers each unit's weights in forward (and again in backward when it reshards) and reduce-scatters
its gradients every micro-batch, as one collective per block, per module or per parameter (``zero3_unit``);
that part is priced with each unit (``zero3_unit_s``, this module's unit step).
"""

from __future__ import annotations

from collections.abc import Iterator

from autopar.cluster import AxisLink, Cluster
from autopar.collectives import all_gather_s, all_reduce_s, bucketed_s, reduce_scatter_s
from autopar.errors import AutoparError
from autopar.framework import Framework
from autopar.inter_op.fp8 import fp8_gathered_params
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.links import Links
from autopar.inter_op.technique import Partial, SearchSpace, Technique, UnitLoadDraft, UnitTotals, divisors
from autopar.inter_op.unit_costs import UnitCost
from autopar.interference import compute_rate, overlapped_s
from autopar.ir import OpGraph
from autopar.kernels import memory_s
from autopar.passes.context import PassContext
from autopar.power import NO_POWER, PowerMix


def zero_options(dp: int, pp: int, fw: Framework) -> list[int]:
    """The ZeRO levels the search offers: those the framework implements (with or without pipeline stages), and
    only level 0 without data parallelism (nothing to shard over)."""
    return [z for z in (0, 1, 2, 3) if fw.zero_allowed(z, pp)] if dp > 1 else [0]


def zero3_collectives(u: UnitCost, ctx: PassContext) -> tuple[int, float]:
    """How many all-gathers (and reduce-scatters) ZeRO-3 issues per pass over the unit, and the elements
    one device holds gathered at once (the whole unit for a block, else its largest module)."""
    unit = ctx.framework.zero3_unit
    if unit == "block":
        return 1, u.params_local
    count = u.param_modules if unit == "module" else u.param_tensors
    return max(1, count), u.largest_module_params


def state_and_held_bytes(params: float, replicas: int, layout: Layout, ctx: PassContext, frozen: float = 0.0) -> float:
    """State and step-time copies of ``params`` elements (``frozen`` of them frozen) sharded (by ZeRO) over
    ``replicas`` ranks."""
    return ctx.state_bytes(params, replicas, layout.zero, frozen) + ctx.held_bytes(
        params, replicas, layout.zero, layout.pp, layout.num_microbatches, frozen)


def gathered_weight_bytes(u: UnitCost, ctx: PassContext) -> float:
    """Bytes of ``u``'s weights one ZeRO-3 all-gather moves: 16-bit, or one byte for the FP8 Linears' weights
    where the framework gathers them cast (``Framework.fp8_param_gather``)."""
    fp8 = fp8_gathered_params(u, ctx)
    return (u.params_local - fp8) * ctx.precision.weight_bytes + fp8


def dp_sync_exposed(groups: list[tuple[float, AxisLink]], bwd_window_s: float, fwd_window_s: float,
                     layout: Layout, cluster: Cluster, ctx: PassContext, mix: PowerMix = NO_POWER) -> float:
    """ZeRO 0-2: the gradient reduction (and weight gather) that compute does not hide, and what it costs the
    compute it runs beside.  ``groups``: the local parameters whose gradients are reduced, those whose weights
    levels 1-2 gather again (``dp_groups``), and the link of the ranks holding them (the dense weights over
    dp x cp, expert-parallel experts over dp / ep), reduced one after the other on one stream;
    ``bwd_window_s`` and ``fwd_window_s``: one micro-batch's backward and forward, whose kernels ``mix`` holds
    (``autopar.power``)."""
    if layout.zero >= 3:
        return 0.0
    fw = ctx.framework
    reduce = all_reduce_s if layout.zero == 0 or fw.sharded_grad_reduce == "all_reduce" else reduce_scatter_s
    total = last = gather = 0.0
    link_used = None
    for local_params, gathered, link in groups:
        if link.size <= 1 or local_params <= 0:
            continue
        t, one = bucketed_s(reduce, local_params * fw.grad_reduce_bytes, link, fw.grad_bucket_bytes)
        total, last = total + t, one  # the last bucket reduced is the last group's
        link_used = link_used or link
        if layout.zero >= 1:
            gather += bucketed_s(all_gather_s, gathered * ctx.precision.weight_bytes, link, fw.grad_bucket_bytes)[0]
    if total <= 0:
        return 0.0

    def beside(comm: float, window: float) -> float:
        return overlapped_s(comm, window, compute_rate(cluster, link_used, mix))

    exposed = max(beside(total, bwd_window_s), last) if fw.overlap_grad_reduce else total
    exposed *= reductions_per_step(layout)
    if layout.zero >= 1:
        exposed += beside(gather, fwd_window_s) if fw.overlap_param_gather else gather
    return exposed


def dp_groups(dense: float, experts: float, frozen: float, frozen_experts: float, links: Links,
              ctx: PassContext) -> list[tuple[float, float, AxisLink]]:
    """``dp_sync_exposed``'s groups for a stage holding ``dense`` and ``experts`` local parameters, ``frozen`` and
    ``frozen_experts`` of them frozen: the trainable ones reduce their gradients; levels 1-2 gather the updated
    weights again, and under FSDP2 the frozen ones too (they are stored sharded, and the first forward of a
    step gathers every weight), while a working copy keeps them whole."""
    every = ctx.framework.state_layout == "fsdp2"
    return [(dense - frozen, dense if every else dense - frozen, links.dp),
            (experts - frozen_experts, experts if every else experts - frozen_experts, links.expert_dp)]


def dp_sync_floor_s(dense_params: float, expert_params: float, layout: Layout, links: Links,
                    ctx: PassContext) -> float:
    """A lower bound of the most ``dp_sync_exposed`` takes on any stage, where the busiest stage holds at least
    ``dense_params`` and ``expert_params`` local parameters: the reductions and gathers the framework runs after
    the compute (an overlapped one may hide whole).  Each group's part grows with its parameters, so the larger
    of the two is below the stage's whole."""
    if layout.zero >= 3:
        return 0.0
    fw = ctx.framework
    reduce = all_reduce_s if layout.zero == 0 or fw.sharded_grad_reduce == "all_reduce" else reduce_scatter_s
    floor = 0.0
    for params, link in ((dense_params, links.dp), (expert_params, links.expert_dp)):
        if link.size <= 1 or params <= 0:
            continue
        t = 0.0
        if not fw.overlap_grad_reduce:
            t += bucketed_s(reduce, params * fw.grad_reduce_bytes, link, fw.grad_bucket_bytes)[0] \
                * reductions_per_step(layout)
        if layout.zero >= 1 and not fw.overlap_param_gather:
            t += bucketed_s(all_gather_s, params * ctx.precision.weight_bytes, link, fw.grad_bucket_bytes)[0]
        floor = max(floor, t)
    return floor


def reductions_per_step(layout: Layout) -> int:
    """How often ZeRO 0-2 reduce the gradients in one step.  ZeRO-2 keeps only its shard of the gradients
    between micro-batches, so every micro-batch reduce-scatters what its backward made (DeepSpeed stage 2
    reduces every micro-step; FSDP2 at ``set_requires_gradient_sync(True)``).  Each of them waits out its
    own tail: FSDP2's post-backward callback makes the compute stream wait for the last reduce-scatter
    (``_fsdp_state._root_post_backward_final_callback``), so nothing of it hides under the next forward.
    Under pipelining torch's ``PipelineStage`` defers the sync to the last micro-batch (the gradients
    accumulate whole, as ``PassContext.held_bytes`` counts), and levels 0-1 reduce once by definition."""
    return layout.num_microbatches if layout.zero == 2 and layout.pp == 1 else 1


def grad_accumulation_s(local_params: float, layout: Layout, cluster: Cluster, ctx: PassContext,
                         replicas: int) -> float:
    """Adding every micro-batch's gradients after the first into the gradient buffer: autograd's
    ``AccumulateGrad`` reads the buffer and the new gradient and writes the sum (3 passes over the gradient
    bytes one device holds; ZeRO-2/3 accumulate their shard, except under pipelining in FSDP2, whose
    ``PipelineStage`` defers the reduction and accumulates the gradients whole, as ``held_bytes`` counts).
    Megatron fuses it into the weight-gradient GEMM (``Framework.grad_accumulation_fused``)."""
    fw = ctx.framework
    if layout.num_microbatches <= 1 or fw.grad_accumulation_fused:
        return 0.0
    whole = layout.pp > 1 and fw.state_layout == "fsdp2"
    shard = replicas if layout.zero >= 2 and replicas > 1 and not whole else 1
    return (layout.num_microbatches - 1) * memory_s(cluster, 3 * local_params * fw.main_grad_bytes / shard)

def optimizer_params(local_params: float, expert_params: float, layout: Layout) -> float:
    """Parameters whose optimizer state one device updates, of ``local_params`` of which ``expert_params`` are
    expert-parallel experts: its ZeRO shard (the dense ones over dp x cp, the experts over dp / ep)."""
    if layout.zero < 1:
        return local_params
    return (local_params - expert_params) / layout.replicas + expert_params / layout.expert_replicas


def iteration_floor_s(dense_params: float, expert_params: float, layout: Layout, links: Links, cluster: Cluster,
                      ctx: PassContext) -> float:
    """ZeRO's bound term: the optimizer step, the gradient accumulation and the unhidden dp traffic of a stage
    holding ``dense_params`` and ``expert_params`` local parameters (the mean stage's: each grows with them)."""
    updated = (dense_params / layout.replicas + expert_params / layout.expert_replicas if layout.zero >= 1
               else dense_params + expert_params)  # ``optimizer_params``, without rounding dense + experts - experts
    return (memory_s(cluster, updated * ctx.framework.optimizer_bytes_per_param)
            + grad_accumulation_s(dense_params, layout, cluster, ctx, layout.replicas)
            + grad_accumulation_s(expert_params, layout, cluster, ctx, layout.expert_replicas)
            + dp_sync_floor_s(dense_params, expert_params, layout, links, ctx))

def unit_state_bytes(u: UnitCost, layout: Layout, ctx: PassContext) -> float:
    """The state and step-time copies of ``u``'s parameters one device holds: the dense ones sharded over the dp x cp
    replicas, the expert-parallel experts over the dp / ep ranks holding the same ones."""
    dense, experts, frozen, frozen_experts = u.parameter_split(layout.ep)
    return (state_and_held_bytes(dense, layout.replicas, layout, ctx, frozen)
            + state_and_held_bytes(experts, layout.expert_replicas, layout, ctx, frozen_experts))


def zero3_unit_s(u: UnitCost, is_layer: bool, layout: Layout, links: Links, cluster: Cluster, ctx: PassContext,
                 window_s: float) -> tuple[float, float]:
    """ZeRO-3 on unit ``u`` per micro-batch: the time its gathers and gradient reduce-scatters add beside
    ``window_s`` of its compute (all of it where the framework waits for each gather), and the bytes of gathered
    weights (this unit's and the prefetched next one's) and one unsharded gradient alive while it runs."""
    fw, dp = ctx.framework, layout.replicas
    if layout.zero < 3 or dp <= 1 or u.params_local <= 0:
        return 0.0, 0.0
    dense, experts, frozen, frozen_experts = u.parameter_split(layout.ep)
    count, gathered = zero3_collectives(u, ctx)
    copies = fw.list_collectives
    gather = scatter = 0.0
    expert_share = experts / u.params_local
    for share, group, still, link in ((1 - expert_share, dense, frozen, links.dp),
                                      (expert_share, experts, frozen_experts, links.expert_dp)):
        if share > 0:  # the experts (wrapped on their own) over the ranks holding the same ones
            gather += count * all_gather_s(share * gathered_weight_bytes(u, ctx) / count, link, copies)
            trained = 1 - still / group  # frozen parameters have no gradient to reduce-scatter
            if trained > 0:
                scatter += count * reduce_scatter_s(share * u.params_local * trained * fw.grad_reduce_bytes / count,
                                                    link, copies)
    gathers = 1 + (1 if fw.zero3_reshard_after_forward else 0)
    if is_layer and layout.recompute == "full" and fw.zero3_unit != "block":
        gathers += 1  # per-module runtimes release after every forward, the recomputed one too
    comm = gathers * gather + scatter
    zero3 = (overlapped_s(comm, window_s, compute_rate(cluster, links.dp, u.power)) if fw.zero3_prefetch
             else comm)
    zero3 += memory_s(cluster, u.params_local * fw.zero3_copy_bytes_per_param)
    trained_share = 1 - u.frozen_local / u.params_local  # of the gathered weights, those with a gradient
    return zero3, 2 * gathered * ctx.precision.weight_bytes + gathered * trained_share * fw.grad_reduce_bytes


#: The largest micro-batch the search offers (samples per data-parallel rank per micro-batch).
MAX_MBS = 16


def _expand_micro_batches(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    dp, batch = p["dp"], space.global_batch
    sizes = [batch // dp] if space.one_microbatch else [d for d in divisors(batch // dp) if d <= MAX_MBS]
    for mbs in space.allowed("mbs", sizes):
        if batch % (dp * mbs) == 0 and not (space.one_microbatch and dp * mbs != batch):
            yield {**p, "mbs": mbs, "num_microbatches": batch // (dp * mbs)}


def _check_fixed_micro_batches(space: SearchSpace, graph: OpGraph) -> None:
    fixed, batch = space.fixed, space.global_batch
    if "dp" in fixed and batch % fixed["dp"]:
        raise AutoparError(f"global batch {batch} is not divisible by dp={fixed['dp']}")
    if "dp" in fixed and "mbs" in fixed and batch % (fixed["dp"] * fixed["mbs"]):
        raise AutoparError(f"global batch {batch} is not divisible by dp*mbs = {fixed['dp'] * fixed['mbs']}")
    if graph.loss_gathers_batch and "dp" in fixed and "mbs" in fixed and fixed["dp"] * fixed["mbs"] != batch:
        raise AutoparError(f"the loss gathers the batch (autopar.gather_batch), so each step runs one micro-batch: "
                           f"mbs must be global batch / dp = {batch // fixed['dp']}, not {fixed['mbs']}")


def _expand_zero(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    for zero in space.allowed("zero", zero_options(p["dp"], p["pp"], space.fw)):
        yield {**p, "zero": zero}


def _unit_step(d: UnitLoadDraft) -> None:
    d.state_bytes = unit_state_bytes(d.u, d.layout, d.ctx)
    d.zero3_exposed_s, d.gathered_bytes = zero3_unit_s(d.u, d.is_layer, d.layout, d.links, d.cluster, d.ctx,
                                                       d.compute_s + d.recompute_s)
    d.extra_bytes += d.gathered_bytes


def _time_bound_s(t: UnitTotals, layout: Layout, links: Links, cluster: Cluster, ctx: PassContext) -> float:
    p = layout.pp  # at the mean stage's trainable parameters (one stage updates tied ones once)
    once = t.tied_params - t.tied_frozen if p == 1 else 0.0
    return iteration_floor_s((t.dense_params - t.dense_frozen - once) / p, (t.expert_params - t.expert_frozen) / p,
                             layout, links, cluster, ctx)


def _bound_reads(layout: Layout) -> tuple:
    """What ``_time_bound_s`` reads of a layout (``iteration_floor_s``: the stages, micro-batches, ZeRO level and
    the ranks holding the same weights)."""
    return layout.pp, layout.num_microbatches, layout.zero, layout.replicas, layout.expert_replicas


def _memory_bound_bytes(t: UnitTotals, layout: Layout, ctx: PassContext) -> float:
    """The mean stage's state at the ZeRO level; one stage holds the tied parameters once (``estimate_layout``
    adds them back to the budget)."""
    state = (state_and_held_bytes(t.dense_params, layout.replicas, layout, ctx, t.dense_frozen)
             + state_and_held_bytes(t.expert_params, layout.expert_replicas, layout, ctx, t.expert_frozen))
    if layout.pp == 1:
        return state - state_and_held_bytes(t.tied_params, layout.replicas, layout, ctx, t.tied_frozen)
    return state / layout.pp


#: Micro-batching: ``mbs`` samples per data-parallel rank and micro-batch, so ``B / (dp * mbs)`` micro-batches.
MICRO_BATCHES = Technique("micro_batches", (Knob("mbs"), Knob("num_microbatches", "derived")),
                          expand=_expand_micro_batches, check_fixed=_check_fixed_micro_batches)
#: Data parallelism's ZeRO level, its state, ZeRO-3's per-unit traffic and the per-iteration floor.
TECHNIQUE = Technique("data_parallel", (Knob("zero", low=0, high=3),), expand=_expand_zero, unit_step=_unit_step,
                      time_bound_s=_time_bound_s, memory_bound_bytes=_memory_bound_bytes, bound_reads=_bound_reads)

__all__ = [
    "MAX_MBS",
    "MICRO_BATCHES",
    "TECHNIQUE",
    "dp_groups",
    "dp_sync_exposed",
    "dp_sync_floor_s",
    "gathered_weight_bytes",
    "grad_accumulation_s",
    "reductions_per_step",
    "state_and_held_bytes",
    "zero3_collectives",
    "zero_options",
]
