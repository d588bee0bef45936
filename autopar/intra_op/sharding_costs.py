"""Costs of a sharding strategy: compute time, resharding (forward and backward), gradient sync, memory.

All costs are per device, in seconds or bytes, for one micro-batch unless stated otherwise.

- **Compute** (``compute_s``): roofline of the local shard, ``max(flops / (peak * eff), bytes / (hbm * eff))``
  plus a fixed overhead per kernel, forward and backward.  ``eff`` is the cluster's GEMM efficiency for
  products, attention efficiency for attention; memory-bound work uses the memory efficiency.  Local FLOPs
  are the node's FLOPs divided by the mesh axes on which some input is sharded (a product's m, k or n).
- **Resharding** (``redistribute_s``): one collective per mesh axis whose placement changes, sized by the
  tensor as the group on that axis sees it: ``S->R`` all-gather, ``P->R`` all-reduce, ``P->S``
  reduce-scatter, ``S(d)->S(e)`` all-to-all; ``R->S``, ``R->P`` and ``P->P`` are local and free.
- **Backward of an edge** (``grad_placements``): the gradient of a tensor flows back from its consumer in
  the placement the consumer's backward produces: a replicated input of an op whose work is split on the
  axis gets a partial gradient (``R -> P``), a sharded input a sharded one, a partial input a replicated one.
  The producer wants its gradient in its own output placement, partials as replicated.  The resharding
  between the two is the edge's backward cost (Megatron's f/g conjugates fall out: an all-reduce forward
  where a row-parallel output meets a replicated op, an all-reduce backward where a replicated tensor
  enters a column-parallel op).
- **Parameters** have no decision of their own: each takes the placement its consumer requires.  The
  same gradient rule gives their synchronization on every axis where they are replicated but the work is
  split (data parallelism: an all-reduce; ZeRO-2/3 on the ``dp`` axis: a reduce-scatter), once per
  iteration.  ZeRO-3 also all-gathers the parameter in forward and again in backward, per micro-batch.
  These collectives are bucketed, so each parameter pays its bytes and its share of a bucket's latency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from autopar.cluster import AxisLink, Cluster, MeshSpec
from autopar.collectives import all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s
from autopar.intra_op.strategies import PARTIAL, R, Strategy, shard_dim, tensor_refs
from autopar.ir import Node, OpGraph, TensorInfo
from autopar.passes.context import PassContext
from autopar.passes.flops import NodeFlops
from autopar.passes.traffic import NodeTraffic, math_attention_bytes

Placements = tuple[str | None, ...]

PRODUCT_OPS = frozenset({"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default",
                         "aten.einsum.default", "aten.addmm.default", "aten.baddbmm.default",
                         "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default"})
ATTENTION_OPS = frozenset({"aten.scaled_dot_product_attention.default"})


def shard_factor(placements: Placements, mesh: MeshSpec) -> int:
    """How many pieces ``placements`` cut a tensor into."""
    return math.prod(n for p, n in zip(placements, mesh.shape) if p and shard_dim(p) is not None)


def _tensor_bytes(t: TensorInfo, batch: int, ctx: PassContext) -> float:
    width = ctx.precision.activation_bytes if t.is_floating else t.itemsize
    return t.numel_at(batch) * width


@lru_cache(maxsize=200_000)
def _redistribute_cached(nbytes: float, src: Placements, dst: Placements, mesh: MeshSpec) -> float:
    cur = list(src)
    total = 0.0
    for a, link in enumerate(mesh.links):
        s, d = cur[a] or R, dst[a] or R
        if s == d or link.size == 1:
            cur[a] = d
            continue
        # The tensor as the group on axis ``a`` sees it: sharded by every other axis, whole on this one.
        others = math.prod(n for b, (p, n) in enumerate(zip(cur, mesh.shape))
                           if b != a and p and shard_dim(p) is not None)
        group_bytes = nbytes / others
        s_shard, d_shard = shard_dim(s) is not None, shard_dim(d) is not None
        if s == PARTIAL and d == R:
            total += all_reduce_s(group_bytes, link)
        elif s == PARTIAL and d_shard:
            total += reduce_scatter_s(group_bytes, link)
        elif s_shard and d == R:
            total += all_gather_s(group_bytes, link)
        elif s_shard and d_shard:
            total += all_to_all_s(group_bytes / link.size, link)
        elif s_shard and d == PARTIAL:  # gather, then keep one copy: still a gather
            total += all_gather_s(group_bytes, link)
        # R -> S, R -> P, P -> P: local
        cur[a] = d
    return total


def redistribute_s(t: TensorInfo, src: Placements, dst: Placements, mesh: MeshSpec, batch: int,
                   ctx: PassContext, width: int | None = None) -> float:
    """Time to turn ``t`` from placements ``src`` into ``dst`` (one per mesh axis)."""
    if tuple(src) == tuple(dst):
        return 0.0
    nbytes = t.numel_at(batch) * (width or (ctx.precision.activation_bytes if t.is_floating else t.itemsize))
    return _redistribute_cached(float(nbytes), tuple(src), tuple(dst), mesh)


def work_split(strategy: Strategy, axis: int) -> bool:
    """Whether the node's work is divided across ``axis`` (some input or output is not replicated on it)."""
    s = strategy[axis]
    return any(p not in (None, R) for p in (*s.inputs, *s.outputs))


def consumer_grad(required: str, strategy: Strategy, axis: int) -> str:
    """Placement of the gradient an op's backward produces for an input it required as ``required``."""
    if required == R:
        return PARTIAL if work_split(strategy, axis) else R
    if required == PARTIAL:
        return R
    return required


def producer_grad(placement: str | None) -> str:
    """Placement in which a producer's backward wants the gradient of its output."""
    return R if placement in (None, R, PARTIAL) else placement


def edge_costs_s(t: TensorInfo, produced: Placements, required: Placements, consumer: Strategy,
                 mesh: MeshSpec, batch: int, ctx: PassContext) -> tuple[float, float]:
    """(forward resharding, backward resharding of the gradient) of one edge."""
    fwd = redistribute_s(t, produced, required, mesh, batch, ctx)
    if not (t.requires_grad and t.is_floating):
        return fwd, 0.0
    g_c = tuple(consumer_grad(r or R, consumer, a) for a, r in enumerate(required))
    g_p = tuple(producer_grad(p) for p in produced)
    return fwd, redistribute_s(t, g_c, g_p, mesh, batch, ctx)


def edge_cost_s(t: TensorInfo, produced: Placements, required: Placements, consumer: Strategy,
                mesh: MeshSpec, batch: int, ctx: PassContext) -> float:
    """Forward resharding of one edge plus the backward resharding of its gradient."""
    return sum(edge_costs_s(t, produced, required, consumer, mesh, batch, ctx))


@dataclass(frozen=True, slots=True)
class ParamCost:
    per_microbatch_s: float  # ZeRO-3 all-gathers in forward and backward
    per_iteration_s: float  # gradient synchronization
    state_bytes: float  # weights + grads + optimizer state held by one device


def _bucketed_s(collective: Callable[[float, AxisLink], float], nbytes: float, link: AxisLink,
                bucket_bytes: float) -> float:
    """A parameter's share of a bucketed collective: its bytes, plus the bucket's latency pro rata."""
    latency = collective(1.0, link)
    return collective(nbytes, link) - latency + latency * min(1.0, nbytes / bucket_bytes)


def param_cost(t: TensorInfo, required: Placements, consumer: Strategy, mesh: MeshSpec, zero: int,
               ctx: PassContext) -> ParamCost:
    """Costs and memory of one parameter consumed with ``required`` placements."""
    pol = ctx.precision
    numel = t.numel_at(1)
    local = numel / shard_factor(required, mesh)
    dp = mesh.axis("dp")
    dp_size = mesh.shape[dp] if dp is not None else 1
    replicated_on_dp = dp is not None and (required[dp] or R) == R and dp_size > 1
    w, g, o = pol.weight_bytes * local, pol.grad_bytes * local, pol.optimizer_bytes * local
    if replicated_on_dp:
        o /= dp_size if zero >= 1 else 1
        g /= dp_size if zero >= 2 else 1
        w /= dp_size if zero >= 3 else 1
    per_mb = 0.0
    per_iter = 0.0
    for a, link in enumerate(mesh.links):
        if link.size == 1:
            continue
        r = required[a] or R
        grad = consumer_grad(r, consumer, a)
        if grad != PARTIAL:
            continue
        others = shard_factor(tuple(p if b != a else None for b, p in enumerate(required)), mesh)
        group_bytes = numel / others * pol.grad_bytes
        sync = reduce_scatter_s if a == dp and zero >= 3 else all_reduce_s  # ZeRO-1/2: RS + AG, AR's volume
        per_iter += _bucketed_s(sync, group_bytes, link, ctx.grad_bucket_bytes)
    if replicated_on_dp and zero >= 3:
        others = shard_factor(tuple(p if b != dp else None for b, p in enumerate(required)), mesh)
        gathered = numel / others * pol.weight_bytes
        per_mb += 2 * _bucketed_s(all_gather_s, gathered, mesh.links[dp], ctx.grad_bucket_bytes)
    return ParamCost(per_mb, per_iter, w + g + o)


def _local_bytes(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int,
                 ctx: PassContext) -> tuple[float, float]:
    """(forward, backward) bytes moved by the local kernel, from local tensor sizes."""
    refs = tensor_refs(node)
    fwd = bwd = 0.0
    in_bytes = grad_in = 0.0
    for i, r in enumerate(refs):
        t = graph.tensor(r)
        b = _tensor_bytes(t, batch, ctx) / shard_factor(tuple(s.inputs[i] for s in strategy), mesh)
        in_bytes += b
        if t.requires_grad:
            grad_in += b
    out_bytes = sum(_tensor_bytes(t, batch, ctx) / shard_factor(tuple(s.outputs[i] for s in strategy), mesh)
                    for i, t in enumerate(node.outputs) if t is not None)
    fwd = in_bytes + out_bytes
    needs_bwd = any(t is not None and t.requires_grad for t in node.outputs)
    bwd = out_bytes + in_bytes + grad_in if needs_bwd else 0.0
    return fwd, bwd


def compute_s(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, cluster: Cluster,
              ctx: PassContext) -> tuple[float, float]:
    """(forward, backward) time of ``node``'s local shard under ``strategy``."""
    flops: NodeFlops = node.annotations["flops"]
    traffic: NodeTraffic = node.annotations["traffic"]
    if node.alias_of is not None:
        return 0.0, 0.0
    scale = graph.scale(node, batch)
    split = math.prod(n for a, n in enumerate(mesh.shape)
                      if any(shard_dim(p or R) is not None for p in strategy[a].inputs))
    fwd_bytes, bwd_bytes = _local_bytes(node, graph, strategy, mesh, batch, ctx)
    eff = cluster.attention_efficiency if node.op in ATTENTION_OPS else cluster.gemm_efficiency
    peak = cluster.peak_flops * eff
    hbm = cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency
    fwd = max(flops.fwd * scale / split / peak, fwd_bytes / hbm) + traffic.fwd_kernels * cluster.kernel_overhead_s
    bwd = max(flops.bwd * scale / split / peak, bwd_bytes / hbm) + traffic.bwd_kernels * cluster.kernel_overhead_s
    if node.op in ATTENTION_OPS and ctx.attention == "math":
        # Unfused attention: the s x s softmax/dropout passes are kernels of their own, between the two
        # batched products, so their memory time adds to the products' time instead of hiding under it.
        extra_fwd, extra_bwd = math_attention_bytes(graph, node, ctx)
        fwd += extra_fwd.at(batch) / split / hbm
        bwd += extra_bwd.at(batch) / split / hbm
    return fwd, bwd

