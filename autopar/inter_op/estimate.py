"""Iteration time and memory of a layout: the pipeline, data-parallel and ZeRO models on top of unit costs.

Per micro-batch, a unit costs its forward and backward compute plus its tensor-parallel communication
(which real runtimes do not overlap).  On top:

- **recomputation**: ``full`` re-runs every layer's forward (compute and its tp communication) during
  backward and keeps only each layer's input; ``selective`` re-runs attention and drops its ``s x s``
  tensors (Korthikanti et al. 2022); ``none`` keeps everything.
- **ZeRO on dp**: level 1 shards optimizer state, 2 also gradients, 3 also weights.  Levels 0-2 reduce
  gradients once per iteration, overlapped with the last micro-batch's backward except what does not fit
  in it and the last bucket; levels 1-2 then all-gather the updated weights.  Level 3 (FSDP) all-gathers
  each unit's weights in forward and backward and reduce-scatters its gradients every micro-batch,
  prefetched behind the unit's compute; what compute cannot hide is exposed.
- **pipeline**: stages from the stage DP (``autopar.solvers.stage_dp``) under the memory limit, each
  stage's activations times its in-flight micro-batches (``autopar.solvers.pipeline``), two
  point-to-point transfers of the boundary activation per micro-batch and stage boundary.
- **optimizer step**: Adam reads and writes 28 bytes per local parameter, memory-bound.

The iteration time is ``m * t_max + bubble + exposed dp communication + optimizer step``, and the
breakdown adds up to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster, axis_link
from autopar.collectives import all_gather_s, all_reduce_s, reduce_scatter_s, send_recv_s
from autopar.inter_op.layout import Layout
from autopar.inter_op.unit_costs import POST, PRE, UnitCost, unit_sequence
from autopar.ir import OpGraph
from autopar.passes.context import PassContext
from autopar.passes.flops import total_flops
from autopar.solvers.pipeline import bubble_s, in_flight_microbatches
from autopar.solvers.stage_dp import StageSplit, UnitLoad, split_stages, split_uniform_stages

ADAM_BYTES_PER_PARAM = 28  # read master, m, v (4 each), grad (2); write master, m, v (4 each), weights (2)


@dataclass(frozen=True, slots=True)
class StageEstimate:
    index: int
    units: tuple[int, int]  # unit range [start, end) in unit_sequence order
    layers: tuple[int, int]  # layer range [start, end) of the block stack
    time_s: float  # per micro-batch, p2p included
    memory_bytes: float


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s,
            "model_flops_per_iter": self.model_flops_per_iter,
            "hardware_flops_per_iter": self.hardware_flops_per_iter, "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu, "hfu": self.hfu, "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
            "breakdown": dict(self.breakdown),
        }


@dataclass(frozen=True, slots=True)
class _UnitLoad:
    time_s: float
    compute_s: float
    tp_s: float
    recompute_s: float
    zero3_exposed_s: float
    bwd_s: float
    state_bytes: float
    activation_bytes: float
    extra_bytes: float


def _unit_load(u: UnitCost, is_layer: bool, layout: Layout, cluster: Cluster, ctx: PassContext) -> _UnitLoad:
    pol = ctx.precision
    compute = u.fwd_s + u.bwd_s
    tp = u.tp_fwd_s + u.tp_bwd_s
    act, extra, recompute = u.activation_bytes, 0.0, 0.0
    if is_layer and layout.recompute == "full":
        recompute = u.fwd_s + u.tp_fwd_s
        act, extra = u.input_bytes, u.activation_bytes
    elif is_layer and layout.recompute == "selective":
        recompute = u.attention_fwd_s
        act = u.activation_bytes - u.attention_saved_bytes
    dp, z = layout.dp, layout.zero
    local = u.params_local
    state = local * (pol.weight_bytes / (dp if z >= 3 else 1) + pol.grad_bytes / (dp if z >= 2 else 1)
                     + pol.optimizer_bytes / (dp if z >= 1 else 1))
    zero3 = 0.0
    if z >= 3 and dp > 1:
        link = axis_link(cluster, dp, layout.tp)
        comm = 2 * all_gather_s(local * pol.weight_bytes, link) + reduce_scatter_s(local * pol.grad_bytes, link)
        zero3 = _exposed(comm, compute, cluster)
        extra += 2 * local * pol.weight_bytes  # the gathered unit and the prefetched next one
    return _UnitLoad(compute + tp + recompute + zero3, compute, tp, recompute, zero3, u.bwd_s, state, act, extra)


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """FLOPs of one forward+backward pass per sample, computed once per model."""

    model_per_sample: float
    hardware_per_sample: float

    @classmethod
    def of(cls, graph: OpGraph) -> ModelFlops:
        # per-sample nodes scale with the batch; the rest (tiny) is counted once per sample here
        return cls(total_flops(graph, 1, "model"), total_flops(graph, 1, "hardware"))


def estimate_layout(graph: OpGraph, costs: dict[str, UnitCost], layout: Layout, global_batch: int,
                    cluster: Cluster, ctx: PassContext, memory_budget_bytes: float,
                    flops: ModelFlops | None = None, allow_spill: bool = True) -> Estimate | None:
    """Estimate ``layout``.  When no stage split fits ``memory_budget_bytes``: the best split ignoring
    memory, marked ``fits=False``, if ``allow_spill``, else ``None``."""
    keys = unit_sequence(graph)
    by_key = {k: _unit_load(costs[k], k not in (PRE, POST), layout, cluster, ctx) for k in set(keys)}
    loads = [by_key[k] for k in keys]
    p, m, v = layout.pp, layout.num_microbatches, layout.v
    in_flight = [in_flight_microbatches(layout.schedule, i, p, m, v) for i in range(p)]
    tie_bytes = _tied_state_bytes(costs, layout, ctx) if p == 1 else 0.0
    split = _split(keys, by_key, loads, in_flight, memory_budget_bytes + tie_bytes)
    fits = split is not None
    if split is None and not allow_spill:
        return None
    if split is None:  # report the best split ignoring memory, marked as not fitting
        split = _split(keys, by_key, loads, in_flight, float("inf"))
        if split is None:
            return None
    across = layout.dp * layout.tp >= cluster.gpus_per_node
    pol = ctx.precision
    dp_link = axis_link(cluster, layout.dp, layout.tp)
    stage_times, stages, dp_exposed = [], [], 0.0
    per_stage: list[dict[str, float]] = []
    for k in range(p):
        a, b = split.boundaries[k], split.boundaries[k + 1]
        units = loads[a:b]
        boundary = costs[keys[b]].input_bytes if b < len(keys) else 0.0
        hops = (1 if k > 0 else 0) + (1 if k < p - 1 else 0)
        p2p = hops * send_recv_s(boundary if k < p - 1 else costs[keys[a]].input_bytes, cluster, across) * v
        t = sum(x.time_s for x in units) + p2p
        stage_times.append(t)
        local = sum(costs[key].params_local for key in keys[a:b])
        exposed = 0.0
        if layout.dp > 1 and layout.zero < 3:
            sync = (all_reduce_s if layout.zero == 0 else reduce_scatter_s)(local * pol.grad_bytes, dp_link)
            last_bucket = (all_reduce_s if layout.zero == 0 else reduce_scatter_s)(
                min(local * pol.grad_bytes, ctx.grad_bucket_bytes), dp_link)
            window = sum(x.bwd_s for x in units)
            exposed = max(_exposed(sync, window, cluster), last_bucket)
            if layout.zero >= 1:
                exposed += all_gather_s(local * pol.weight_bytes, dp_link)
        dp_exposed = max(dp_exposed, exposed)
        per_stage.append({"compute": sum(x.compute_s for x in units), "tp": sum(x.tp_s for x in units),
                          "recompute": sum(x.recompute_s for x in units), "p2p": p2p,
                          "zero3": sum(x.zero3_exposed_s for x in units), "local": local})
        layer_idx = [i - 1 for i in range(a, b) if 0 < i < len(keys) - 1]
        layers = (layer_idx[0], layer_idx[-1] + 1) if layer_idx else (0, 0)
        stages.append(StageEstimate(k, (a, b), layers, t, split.stage_memory_bytes[k] - tie_bytes))
    bottleneck = max(range(p), key=lambda k: stage_times[k])
    bn = per_stage[bottleneck]
    local_opt = max(s["local"] for s in per_stage) / (layout.dp if layout.zero >= 1 else 1)
    optimizer_s = local_opt * ADAM_BYTES_PER_PARAM / (cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency)
    tp_sync = max(sum(costs[key].tp_sync_s for key in keys[s.units[0]:s.units[1]]) for s in stages)
    bubble = bubble_s(stage_times, v)
    breakdown = {
        "compute_s": m * bn["compute"] + optimizer_s,
        "tp_comm_s": m * bn["tp"] + tp_sync,
        "recompute_s": m * bn["recompute"],
        "pp_p2p_s": m * bn["p2p"],
        "pp_bubble_s": bubble,
        "dp_comm_exposed_s": m * bn["zero3"] + dp_exposed,
    }
    iteration = sum(breakdown.values())
    flops = flops or ModelFlops.of(graph)
    model_flops = flops.model_per_sample * global_batch
    hw_flops = flops.hardware_per_sample * global_batch + _recompute_flops(costs, keys, layout, global_batch)
    n = layout.devices
    peak = max(s.memory_bytes for s in stages)
    return Estimate(
        layout=layout, iteration_time_s=iteration, tokens_per_s=global_batch * graph.seq_len / iteration,
        model_flops_per_iter=model_flops, hardware_flops_per_iter=hw_flops,
        tflops_per_gpu=model_flops / iteration / n / 1e12, mfu=model_flops / iteration / n / cluster.peak_flops,
        hfu=hw_flops / iteration / n / cluster.peak_flops, peak_memory_bytes=peak,
        fits=fits and peak <= memory_budget_bytes, breakdown=breakdown, stages=tuple(stages))


def _exposed(comm_s: float, compute_s: float, cluster: Cluster) -> float:
    """Time a collective adds when overlapped with ``compute_s`` of work: what does not fit beside the
    compute, plus the compute's slowdown while both run."""
    return max(0.0, comm_s - compute_s) + cluster.overlap_slowdown * min(comm_s, compute_s)


def _split(keys: list[str], by_key: dict[str, _UnitLoad], loads: list[_UnitLoad], in_flight: list[float],
           budget: float) -> StageSplit | None:
    """The stage DP; the closed form when every layer is alike (the common case)."""
    layer_keys = set(keys[1:-1])
    if len(layer_keys) == 1:
        pre, layer, post = (_as_solver_load(by_key[k]) for k in (keys[0], keys[1], keys[-1]))
        return split_uniform_stages(pre, layer, post, len(keys) - 2, in_flight, budget)
    return split_stages([x.time_s for x in loads], [x.state_bytes for x in loads],
                        [x.activation_bytes for x in loads], in_flight, budget, [x.extra_bytes for x in loads])


def _as_solver_load(x: _UnitLoad) -> UnitLoad:
    return UnitLoad(x.time_s, x.state_bytes, x.activation_bytes, x.extra_bytes)


def _tied_state_bytes(costs: dict[str, UnitCost], layout: Layout, ctx: PassContext) -> float:
    """State of parameters shared by ``pre`` and ``post`` (tied embeddings), counted twice by the units."""
    shared = set(costs[PRE].param_local) & set(costs[POST].param_local)
    if not shared:
        return 0.0
    pol, dp, z = ctx.precision, layout.dp, layout.zero
    per = (pol.weight_bytes / (dp if z >= 3 else 1) + pol.grad_bytes / (dp if z >= 2 else 1)
           + pol.optimizer_bytes / (dp if z >= 1 else 1))
    return sum(costs[POST].param_local[f] for f in shared) * per


def _recompute_flops(costs: dict[str, UnitCost], keys: list[str], layout: Layout, global_batch: int) -> float:
    micro = global_batch / max(1, layout.mbs)  # micro-batches over all dp ranks
    layers = [costs[k] for k in keys if k not in (PRE, POST)]
    if layout.recompute == "full":
        return micro * sum(u.fwd_flops for u in layers)
    if layout.recompute == "selective":
        return micro * sum(u.attention_fwd_flops for u in layers)
    return 0.0
