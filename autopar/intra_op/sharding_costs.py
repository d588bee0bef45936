"""Costs of a sharding strategy: compute time, resharding (forward and backward), gradient sync, memory.

All costs are per device, in seconds or bytes, for one micro-batch unless stated otherwise.

- **Compute** (``compute_s``): roofline of the local shard, the longer of its compute time and the time to
  stream its bytes, plus a fixed overhead per kernel, forward and backward.  A linear or matmul is timed
  as the GEMMs of its local shapes (forward ``m x n x k``; backward ``dY W^T`` and ``X^T dY``) with the
  shape-dependent efficiency of ``autopar.kernels``; flash attention at its kernel's efficiency on the
  FLOPs it executes; unfused attention as its four-plus-two batched products and softmax passes.
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
  split (an all-reduce, once per iteration), bucketed, so each parameter pays its bytes and its share of a
  bucket's latency (``param_cost``).  Data parallelism and ZeRO are priced per layout, outside the ILP
  (``autopar.inter_op.data_parallel``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.cluster import Cluster, MeshSpec
from autopar.collectives import all_reduce_s, bucket_share_s, collective_s
from autopar.intra_op.fp8 import cast_cost, cast_kind, fp8_eligible, layer_linear_weight
from autopar.intra_op.strategies import PARTIAL, R, Strategy, shard_dim, tensor_refs
from autopar.ir import Node, OpGraph, TensorInfo
from autopar.kernels import FLASH_BACKWARD_FLOPS, flash_attention_s, gemm_s, gemm_store_s, memory_s
from autopar.passes.activations import SavedTensor, storage_key
from autopar.passes.context import PassContext
from autopar.passes.flops import NodeFlops, is_causal
from autopar.passes.traffic import LOSS_OPS, NodeTraffic, softmax_passes_bytes
from autopar.power import PowerMix, product_demand, tensor_demand

Placements = tuple[str | None, ...]

PRODUCT_OPS = frozenset({"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default",
                         "aten.einsum.default", "aten.addmm.default", "aten.baddbmm.default",
                         "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
                         "aten._grouped_mm.default"})
ATTENTION_OPS = frozenset({"aten.scaled_dot_product_attention.default"})


def shard_factor(placements: Placements, mesh: MeshSpec) -> int:
    """How many pieces ``placements`` cut a tensor into."""
    return math.prod(n for p, n in zip(placements, mesh.shape) if p and shard_dim(p) is not None)


def saved_bytes(graph: OpGraph, node: Node, strat: Strategy, mesh: MeshSpec, batch: int,
                saved: list[SavedTensor], produced: dict[str, Placements] | None = None) -> list[float]:
    """Per-device bytes of each of ``saved`` (tensors ``node`` keeps for backward) under ``strat``.

    A saved input counts as the op consumes it: autograd saves the tensor the op ran on, after any
    redistribution, so under DTensor sequence parallelism the all-gathered input of a column-parallel Linear
    is whole on every rank.  ``produced`` (storage key -> the producer's placements) counts the finer of
    the two for matrix products instead, as Megatron-LM's Linear saves its sequence-sharded input and
    all-gathers it again in backward (Korthikanti et al. 2022, sec. 4.2.2).  A saved output counts as
    produced; a kernel's own tensors (norm statistics, dropout masks, attention statistics) at the op's
    finest sharding.
    """
    if not saved:
        return []
    refs = tensor_refs(node)
    inputs: dict[str, int] = {}
    for k, r in enumerate(refs):
        inputs.setdefault(storage_key(graph, r), k)
    finest = max([shard_factor(tuple(ax.outputs[j] for ax in strat), mesh) for j in range(len(node.outputs))]
                 + [shard_factor(tuple(ax.inputs[j] for ax in strat), mesh) for j, r in enumerate(refs)
                    if graph[r.name].kind not in ("param", "buffer", "constant")])
    out = []
    for t in saved:
        name, _, index = t.key.rpartition(":")
        if t.key in inputs:
            factor = shard_factor(tuple(ax.inputs[inputs[t.key]] for ax in strat), mesh)
            if produced is not None and t.key in produced and node.op in PRODUCT_OPS:
                factor = max(factor, shard_factor(produced[t.key], mesh))
        elif name == node.name and index.isdigit() and int(index) < len(node.outputs):
            factor = shard_factor(tuple(ax.outputs[int(index)] for ax in strat), mesh)
        else:
            factor = finest
        out.append(t.nbytes.at(batch) / factor)
    return out


def local_tensor_bytes(graph: OpGraph, t: TensorInfo, placements: Placements, mesh: MeshSpec, batch: int,
                       ctx: PassContext) -> float:
    """Bytes of ``t`` on one device under ``placements`` at ``batch`` samples, at ``OpGraph.width`` (an explicit
    fp32 upcast of a 16-bit model keeps its 4 bytes): the one sizing of a local tensor that costs and memory use."""
    return t.numel_at(batch) * graph.width(t, ctx.precision.activation_bytes) / shard_factor(tuple(placements), mesh)


#: One collective of a resharding: (mesh axis, kind, bytes as ``autopar.collectives`` sizes that kind).
AxisCollective = tuple[int, str, float]


@lru_cache(maxsize=200_000)
def _reshard_collectives(nbytes: float, src: Placements, dst: Placements,
                         mesh: MeshSpec) -> tuple[AxisCollective, ...]:
    cur = list(src)
    out: list[AxisCollective] = []
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
            out.append((a, "all_reduce", group_bytes))
        elif s == PARTIAL and d_shard:
            out.append((a, "reduce_scatter", group_bytes))
        elif s_shard and d == R:
            out.append((a, "all_gather", group_bytes))
        elif s_shard and d_shard:
            out.append((a, "all_to_all", group_bytes / link.size))
        elif s_shard and d == PARTIAL:  # gather, then keep one copy: still a gather
            out.append((a, "all_gather", group_bytes))
        # R -> S, R -> P, P -> P: local
        cur[a] = d
    return tuple(out)


def collectives_s(collectives: tuple[AxisCollective, ...], mesh: MeshSpec) -> float:
    """Time of ``collectives`` (one after another) on ``mesh``'s links."""
    return sum(collective_s(kind, size, mesh.links[a]) for a, kind, size in collectives)


@lru_cache(maxsize=200_000)
def _redistribute_cached(nbytes: float, src: Placements, dst: Placements, mesh: MeshSpec) -> float:
    return collectives_s(_reshard_collectives(nbytes, src, dst, mesh), mesh)


def _reshard_bytes(t: TensorInfo, batch: int, ctx: PassContext) -> float:
    """A tensor's bytes as resharding moves it: floating tensors at the activation width, not
    ``OpGraph.width`` (an fp32 upcast resharded in fp32 is priced low)."""
    return t.numel_at(batch) * (ctx.precision.activation_bytes if t.is_floating else t.itemsize)


def redistribute_s(t: TensorInfo, src: Placements, dst: Placements, mesh: MeshSpec, batch: int,
                   ctx: PassContext) -> float:
    """Time to turn ``t`` from placements ``src`` into ``dst`` (one per mesh axis)."""
    if tuple(src) == tuple(dst):
        return 0.0
    return _redistribute_cached(float(_reshard_bytes(t, batch, ctx)), tuple(src), tuple(dst), mesh)


def redistribute_collectives(t: TensorInfo, src: Placements, dst: Placements, mesh: MeshSpec, batch: int,
                             ctx: PassContext) -> tuple[AxisCollective, ...]:
    """The collectives ``redistribute_s`` prices, one per mesh axis whose placement changes."""
    if tuple(src) == tuple(dst):
        return ()
    return _reshard_collectives(float(_reshard_bytes(t, batch, ctx)), tuple(src), tuple(dst), mesh)


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


def grad_placements(produced: Placements, required: Placements,
                     consumer: Strategy) -> tuple[Placements, Placements]:
    """(the gradient's placements as the consumer's backward makes it, as the producer wants it)."""
    return (tuple(consumer_grad(r or R, consumer, a) for a, r in enumerate(required)),
            tuple(producer_grad(p) for p in produced))


def edge_costs_s(t: TensorInfo, produced: Placements, required: Placements, consumer: Strategy,
                 mesh: MeshSpec, batch: int, ctx: PassContext) -> tuple[float, float]:
    """(forward resharding, backward resharding of the gradient) of one edge."""
    fwd = redistribute_s(t, produced, required, mesh, batch, ctx)
    if not (t.requires_grad and t.is_floating):
        return fwd, 0.0
    return fwd, redistribute_s(t, *grad_placements(produced, required, consumer), mesh, batch, ctx)


def edge_cost_s(t: TensorInfo, produced: Placements, required: Placements, consumer: Strategy,
                mesh: MeshSpec, batch: int, ctx: PassContext) -> float:
    """Forward resharding of one edge plus the backward resharding of its gradient."""
    return sum(edge_costs_s(t, produced, required, consumer, mesh, batch, ctx))


@dataclass(frozen=True, slots=True)
class ParamCost:
    per_iteration_s: float  # the gradient's synchronization on the mesh's axes
    state_bytes: float  # weights + grads + optimizer state held by one device
    sync: tuple[AxisCollective, ...] = ()  # the collectives of that synchronization (whole, not bucketed)


def param_cost(t: TensorInfo, required: Placements, consumer: Strategy, mesh: MeshSpec,
               ctx: PassContext) -> ParamCost:
    """One parameter consumed with ``required`` placements, as the intra-op ILP prices it: its state on one device,
    and the all-reduce of its gradient on each mesh axis where the consumer leaves that gradient partial (a weight
    replicated on tp whose consumer splits its input, such as a layer norm's under sequence parallelism).
    Data parallelism and ZeRO (the reduction of every gradient over the replicas, the sharded state, ZeRO-3's
    gathers) are priced per layout by one model, ``autopar.inter_op.data_parallel``; a ``dp`` axis here is one more
    axis of partial gradients."""
    numel = t.numel_at(1)
    local = numel / shard_factor(required, mesh)
    state = ctx.state_bytes(local, frozen=0.0 if t.requires_grad else local)
    per_iter = 0.0
    sync_collectives: list[AxisCollective] = []
    for a, link in enumerate(mesh.links if t.requires_grad else ()):  # a frozen parameter has no gradient
        if link.size == 1 or consumer_grad(required[a] or R, consumer, a) != PARTIAL:
            continue
        others = shard_factor(tuple(p if b != a else None for b, p in enumerate(required)), mesh)
        group_bytes = numel / others * ctx.framework.grad_reduce_bytes
        per_iter += bucket_share_s(all_reduce_s, group_bytes, link, ctx.grad_bucket_bytes)
        sync_collectives.append((a, "all_reduce", group_bytes))
    return ParamCost(per_iter, state, tuple(sync_collectives))


def local_bytes(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int,
                ctx: PassContext) -> tuple[float, float]:
    """(forward, backward) bytes moved by the local kernel, from local tensor sizes; of an op a compiled block
    fuses, its part of its group's (``NodeTraffic.reads`` / ``writes``, ``autopar.passes.fusion``)."""
    traffic: NodeTraffic | None = node.annotations.get("traffic")
    reads = traffic.reads if traffic is not None else None
    in_bytes = grad_in = 0.0
    for i, r in enumerate(tensor_refs(node)):
        if reads is not None and i not in reads:
            continue
        t = graph.tensor(r)
        b = local_tensor_bytes(graph, t, tuple(s.inputs[i] for s in strategy), mesh, batch, ctx)
        in_bytes += b
        if t.requires_grad:
            grad_in += b
    out_bytes = output_bytes(node, graph, strategy, mesh, batch, ctx,
                             traffic.writes if traffic is not None else None)
    fwd = in_bytes + out_bytes
    needs_bwd = any(t is not None and t.requires_grad for t in node.outputs)
    bwd = out_bytes + in_bytes + grad_in if needs_bwd else 0.0
    return fwd, bwd


def operand_bytes(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, ctx: PassContext,
                  k: int) -> float:
    """Local bytes of input ``k`` of ``node`` as the op reads it under ``strategy`` (0 for no such tensor)."""
    refs = tensor_refs(node)
    t = graph.tensor(refs[k]) if k < len(refs) else None
    return 0.0 if t is None else local_tensor_bytes(graph, t, tuple(s.inputs[k] for s in strategy), mesh, batch, ctx)


def output_bytes(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, ctx: PassContext,
                 only: tuple[int, ...] | None = None) -> float:
    """Local bytes of ``node``'s outputs under ``strategy`` (``only``: of those outputs)."""
    return sum(local_tensor_bytes(graph, t, tuple(s.outputs[j] for s in strategy), mesh, batch, ctx)
               for j, t in enumerate(node.outputs) if t is not None and (only is None or j in only))


@dataclass(frozen=True, slots=True)
class Gemm:
    """One local product: ``batch x (m x k) @ (k x n)``, and the bytes it reads and writes."""

    batch: float
    m: float
    n: float
    k: float

    def s(self, cluster: Cluster, width: int) -> float:
        """Roofline of the product: its compute time, or streaming its operands and result if longer (its result's
        store after it where the device's kernels store after their main loop, ``kernels.gemm_store_s``), and the
        fixed time of its kernel beyond the gap every kernel pays (``Cluster.gemm_latency_s``)."""
        reads = width * self.batch * (self.m * self.k + self.k * self.n)
        store = gemm_store_s(cluster, self.m, self.n, self.batch, width)
        io = reads if store else reads + width * self.batch * self.m * self.n
        return (max(gemm_s(cluster, self.m, self.n, self.k, self.batch), memory_s(cluster, io)) + store
                + cluster.gemm_latency_s - cluster.kernel_gap_s)


def _splits(placements: tuple[str | None, ...], mesh: MeshSpec, rank: int) -> dict[int, int]:
    """Tensor dim (non-negative) -> how many pieces the mesh cuts it into."""
    out: dict[int, int] = {}
    for p, n in zip(placements, mesh.shape):
        d = shard_dim(p or R)
        if d is not None:
            d = d % rank if rank else d
            out[d] = out.get(d, 1) * n
    return out


def product_gemms(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec,
                  batch: int) -> tuple[list[Gemm], list[Gemm]] | None:
    """The local products of a linear or (batched) matmul: forward, and backward (the input gradient
    ``dY W^T``, then the weight gradient ``X^T dY``, each when that operand needs a gradient)."""
    if node.op == "aten.einsum.default":
        return _einsum_gemms(node, graph, strategy, mesh, batch)
    if node.op not in ("aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default"):
        return None
    refs = tensor_refs(node)
    a, b = graph.tensor(refs[0]), graph.tensor(refs[1])
    if a is None or b is None:
        return None
    sa, sb = a.shape_at(batch), b.shape_at(batch)
    pa = _splits(tuple(ax.inputs[0] for ax in strategy), mesh, len(sa))
    pb = _splits(tuple(ax.inputs[1] for ax in strategy), mesh, len(sb))
    if node.op == "aten.linear.default":  # x [..., K] @ w[N, K]^T
        k = sa[-1] / pa.get(len(sa) - 1, 1)
        m = math.prod(sa[:-1]) / math.prod(v for d, v in pa.items() if d < len(sa) - 1)
        n = sb[0] / pb.get(0, 1)
        nb = 1.0
    else:  # a [..., M, K] @ b [..., K, N]
        if len(sa) < 2 or len(sb) < 2:
            return None
        m = sa[-2] / pa.get(len(sa) - 2, 1)
        k = sa[-1] / pa.get(len(sa) - 1, 1)
        n = sb[-1] / pb.get(len(sb) - 1, 1)
        batch_a = math.prod(sa[:-2]) / math.prod(v for d, v in pa.items() if d < len(sa) - 2)
        batch_b = math.prod(sb[:-2]) / math.prod(v for d, v in pb.items() if d < len(sb) - 2)
        nb = max(batch_a, batch_b)
    fwd = [Gemm(nb, m, n, k)]
    bwd = []
    if a.requires_grad:
        bwd.append(Gemm(nb, m, k, n))
    if b.requires_grad:
        bwd.append(Gemm(1.0, k, n, m * nb) if node.op == "aten.linear.default" else Gemm(nb, k, n, m))
    return fwd, bwd


def _einsum_gemms(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec,
                  batch: int) -> tuple[list[Gemm], list[Gemm]] | None:
    """The local products of a two-operand ``einsum`` without ellipsis, as a batched GEMM: the letters of
    both operands and the output are its batch, those of one operand and the output its ``m`` (the first)
    or ``n`` (the second), those summed its ``k``."""
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else ""
    refs = tensor_refs(node)
    if "..." in equation or "->" not in equation or len(refs) != 2:
        return None
    lhs, out = equation.replace(" ", "").split("->", 1)
    specs = lhs.split(",")
    if len(specs) != 2:
        return None
    a_spec, b_spec = specs
    tensors = [graph.tensor(r) for r in refs]
    if any(t is None for t in tensors) or any(len(spec) != len(t.shape) for spec, t in zip(specs, tensors)):
        return None
    local: dict[str, float] = {}
    for k, (spec, t) in enumerate(zip(specs, tensors)):
        shape = t.shape_at(batch)
        split = _splits(tuple(ax.inputs[k] for ax in strategy), mesh, len(shape))
        for d, letter in enumerate(spec):
            local.setdefault(letter, shape[d] / split.get(d, 1))
    if any(letter not in out for letter in set(a_spec) ^ set(b_spec)):
        return None  # a letter summed within one operand: not one GEMM

    def size(letters: set[str]) -> float:
        return math.prod(local[x] for x in letters)

    both = set(a_spec) & set(b_spec)
    nb, k = size(both & set(out)), size(both - set(out))
    m, n = size(set(a_spec) - both), size(set(b_spec) - both)
    fwd, bwd = [Gemm(nb, m, n, k)], []
    if tensors[0].requires_grad:
        bwd.append(Gemm(nb, m, k, n))
    if tensors[1].requires_grad:
        bwd.append(Gemm(nb, k, n, m))
    return fwd, bwd


def weight_grad_s(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int,
                  cluster: Cluster, ctx: PassContext) -> float:
    """Time of the products that make ``node``'s parameter gradients (``X^T dY`` of a linear): the part of its
    backward a split-backward pipeline schedule defers to its weight step.  Other ops' parameter gradients
    (norm scales, embedding rows) are memory-bound slivers of their backward and stay with it."""
    gemms = product_gemms(node, graph, strategy, mesh, batch)
    if gemms is None:
        return 0.0
    fp8 = fp8_linear(node, graph, strategy, mesh, batch, ctx)
    width, weights = weight_grad_store_bytes(ctx), _weight_gemms(node, graph)
    return sum(gemm_s(cluster, g.m, g.n, g.k, g.batch, fp8) + gemm_store_s(cluster, g.m, g.n, g.batch, width)
               for i, g in enumerate(gemms[1]) if i in weights)


def _weight_gemms(node: Node, graph: OpGraph) -> tuple[int, ...]:
    """The positions in ``product_gemms``' backward list of the products that make a parameter's gradient."""
    refs = tensor_refs(node)
    a, b = graph.tensor(refs[0]), graph.tensor(refs[1])
    out, i = [], 0
    if a.requires_grad:
        if graph[refs[0].name].kind == "param":
            out.append(i)
        i += 1
    if b.requires_grad and graph[refs[1].name].kind == "param":
        out.append(i)
    return tuple(out)


def weight_grad_store_bytes(ctx: PassContext) -> float:
    """Bytes a weight-gradient product moves per element of its result: the gradient it writes, or, where the
    framework fuses accumulation into it (``Framework.grad_accumulation_fused``: Megatron's
    ``wgrad_gemm_accum_fp32``, beta = 1), the main gradient it reads and writes again."""
    fw = ctx.framework
    return 2 * fw.main_grad_bytes if fw.grad_accumulation_fused else ctx.precision.activation_bytes


def _fp8_forward(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int,
                 ctx: PassContext) -> Gemm | None:
    """The local forward product of ``node`` if it trains in FP8 (``autopar.intra_op.fp8``: an ``fp8`` plan, a
    Linear of a transformer layer with a parameter weight, its local weight aligned to 16), else ``None``."""
    if ctx.precision.training != "fp8" or layer_linear_weight(node, graph) is None:
        return None
    gemms = product_gemms(node, graph, strategy, mesh, batch)
    g = gemms[0][0] if gemms is not None else None
    return g if g is not None and fp8_eligible(g.m, g.n, g.k) else None


def fp8_linear(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int,
               ctx: PassContext) -> bool:
    """Whether ``node`` trains in FP8 (see ``_fp8_forward``)."""
    return _fp8_forward(node, graph, strategy, mesh, batch, ctx) is not None


def _cast_s(node: Node, g: Gemm, cluster: Cluster, ctx: PassContext) -> tuple[float, float]:
    kind = cast_kind(ctx.framework.fp8_scaling, ctx.compile and node.layer is not None)
    fused = node.annotations.get("fused_neighbours", (False, False)) if kind == "compiled" else (False, False)
    c = cast_cost(g.batch * g.m, g.n, g.k, kind, *fused)
    return (memory_s(cluster, c.fwd_bytes) + c.fwd_kernels * cluster.kernel_gap_s,
            memory_s(cluster, c.bwd_bytes) + c.bwd_kernels * cluster.kernel_gap_s)


def fp8_cast_s(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, cluster: Cluster,
               ctx: PassContext) -> tuple[float, float]:
    """(forward, backward) time of the FP8 casts of ``node``'s operands; zero unless it trains in FP8."""
    g = _fp8_forward(node, graph, strategy, mesh, batch, ctx)
    return (0.0, 0.0) if g is None else _cast_s(node, g, cluster, ctx)


@dataclass(frozen=True, slots=True)
class OpTiming:
    """An op's forward and backward time at the boost clock, the tensor-core kernels' part of each (the rest is
    memory-bound, or the gaps between kernels) and their power draw (``autopar.power``)."""

    fwd_s: float
    bwd_s: float
    fwd_tensor_s: float = 0.0
    bwd_tensor_s: float = 0.0
    demand: float = 0.0

    def power(self) -> PowerMix:
        """Forward and backward together, as the power manager sees them."""
        tensor = self.fwd_tensor_s + self.bwd_tensor_s
        return PowerMix(tensor, tensor * self.demand, self.fwd_s + self.bwd_s - tensor)

    def at_clock(self, phi: float) -> tuple[float, float]:
        """(forward, backward) at ``phi`` of the boost clock: the tensor-core kernels slow, the rest keeps its time."""
        slow = 1.0 / phi - 1.0
        return self.fwd_s + self.fwd_tensor_s * slow, self.bwd_s + self.bwd_tensor_s * slow


def _attention_s(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, cluster: Cluster,
                 ctx: PassContext, split: int, fwd_bytes: float, bwd_bytes: float) -> OpTiming:
    """Attention: a flash kernel at its published throughput for its head dimension, sequence length and mask
    (``autopar.kernels``), or unfused products and passes."""
    flops: NodeFlops = node.annotations["flops"]
    traffic: NodeTraffic = node.annotations["traffic"]
    scale = graph.scale(node, batch)
    gap_f = traffic.fwd_kernels * cluster.kernel_gap_s
    gap_b = traffic.bwd_kernels * cluster.kernel_gap_s
    q, k, v = (graph.tensor(r) for r in tensor_refs(node)[:3])
    if ctx.flash:
        causal = is_causal(node)
        # the kernels' own count: every score of the local shard, half of them under a causal mask
        nominal = flops.fwd * scale / split * (0.5 if causal else 1.0)
        shape = (ctx.flash_version, q.shape[-1], k.shape[-2], causal)
        kern_f = flash_attention_s(cluster, nominal, shape[0], "fwd", *shape[1:])
        kern_b = flash_attention_s(cluster, FLASH_BACKWARD_FLOPS * nominal, shape[0], "bwd", *shape[1:])
        mem_f, mem_b = memory_s(cluster, fwd_bytes), memory_s(cluster, bwd_bytes)
        tensor_f, tensor_b = (kern_f if kern_f >= mem_f else 0.0), (kern_b if kern_b >= mem_b else 0.0)
        rate = (1 + FLASH_BACKWARD_FLOPS) * nominal / max(1e-30, kern_f + kern_b)  # FLOP/s as the tables count
        return OpTiming(max(kern_f, mem_f) + gap_f, max(kern_b, mem_b) + gap_b, tensor_f, tensor_b,
                        tensor_demand(cluster, rate / cluster.peak_flops))
    sq, sk = q.shape_at(batch), k.shape_at(batch)
    heads = math.prod(sq[:-2]) / split  # batch x heads of the local shard
    s_q, s_k, d, dv = sq[-2], sk[-2], sq[-1], v.shape[-1]
    e = ctx.precision.activation_bytes
    prod_f = (Gemm(heads, s_q, s_k, d), Gemm(heads, s_q, dv, s_k))
    prod_b = (Gemm(heads, s_k, dv, s_q), Gemm(heads, s_q, s_k, dv), Gemm(heads, s_q, d, s_k), Gemm(heads, s_k, d, s_q))
    fwd, bwd = sum(g.s(cluster, e) for g in prod_f), sum(g.s(cluster, e) for g in prod_b)
    tensor_f = sum(gemm_s(cluster, g.m, g.n, g.k, g.batch) for g in prod_f)
    tensor_b = sum(gemm_s(cluster, g.m, g.n, g.k, g.batch) for g in prod_b)
    passes_f, passes_b = softmax_passes_bytes(graph, node, ctx)
    fwd += memory_s(cluster, passes_f.at(batch) / split)
    bwd += memory_s(cluster, passes_b.at(batch) / split)
    return OpTiming(fwd + gap_f, bwd + gap_b, min(tensor_f, fwd), min(tensor_b, bwd), product_demand(cluster))


def host_s(node: Node, ctx: PassContext) -> tuple[float, float]:
    """(forward, backward) CPU time of issuing ``node``: the framework's per-op dispatch (``Framework.host_op_s``)
    and one driver call per kernel it launches (``Cluster.kernel_launch_s``).  A view dispatches on the host and
    launches nothing; a backward costs the host only where the op launches backward kernels; compiled code
    (``NodeTraffic.dispatched`` false) pays the launches only."""
    traffic: NodeTraffic = node.annotations["traffic"]
    fw, cluster = ctx.framework, ctx.cluster
    dispatch = fw.host_op_s if traffic.dispatched else 0.0
    fwd = dispatch + traffic.fwd_kernels * cluster.kernel_launch_s
    bwd = (dispatch + traffic.bwd_kernels * cluster.kernel_launch_s) if traffic.bwd_kernels else 0.0
    return fwd, bwd


def compute_s(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, cluster: Cluster,
              ctx: PassContext) -> tuple[float, float]:
    """(forward, backward) time of ``node``'s local shard under ``strategy`` at the boost clock (``op_timing``)."""
    t = op_timing(node, graph, strategy, mesh, batch, cluster, ctx)
    return t.fwd_s, t.bwd_s


def op_timing(node: Node, graph: OpGraph, strategy: Strategy, mesh: MeshSpec, batch: int, cluster: Cluster,
              ctx: PassContext) -> OpTiming:
    """Time of ``node``'s local shard under ``strategy`` at the boost clock, and its tensor-core part.

    Products are timed as GEMMs of their local shapes (``autopar.kernels``), attention by its kernel, and
    everything else by the bytes it moves; each kernel also pays the gap between back-to-back kernels (its
    launch runs on the host's timeline: ``host_s``).  What the power cap does to the clock is the unit's
    (``autopar.power``)."""
    flops: NodeFlops = node.annotations["flops"]
    traffic: NodeTraffic = node.annotations["traffic"]
    if node.alias_of is not None or (traffic.fwd_kernels == traffic.bwd_kernels == 0 and traffic.reads is None):
        return OpTiming(0.0, 0.0)  # a view, or an op that launches nothing (dropout with p = 0)
    scale = graph.scale(node, batch)
    split = math.prod(n for a, n in enumerate(mesh.shape)
                      if any(shard_dim(p or R) is not None for p in strategy[a].inputs))
    fwd_bytes, bwd_bytes = local_bytes(node, graph, strategy, mesh, batch, ctx)
    if node.op in LOSS_OPS:
        # the loss's passes over its (fp32-upcast) logits, which its operands' sizes do not show (``loss_traffic``)
        fwd_bytes, bwd_bytes = traffic.fwd_bytes.at(batch) / split, traffic.bwd_bytes.at(batch) / split
    if node.op in ATTENTION_OPS:
        return _attention_s(node, graph, strategy, mesh, batch, cluster, ctx, split, fwd_bytes, bwd_bytes)
    launch_f = traffic.fwd_kernels * cluster.kernel_gap_s
    launch_b = traffic.bwd_kernels * cluster.kernel_gap_s
    gemms = product_gemms(node, graph, strategy, mesh, batch) if flops.fwd > 0 else None
    fp8_g = _fp8_forward(node, graph, strategy, mesh, batch, ctx) if gemms is not None else None
    fp8 = fp8_g is not None
    if gemms is not None:
        fwd_c = sum(gemm_s(cluster, g.m, g.n, g.k, g.batch, fp8) for g in gemms[0])
        bwd_c = sum(gemm_s(cluster, g.m, g.n, g.k, g.batch, fp8) for g in gemms[1])
    else:
        peak = cluster.peak_flops * cluster.gemm_efficiency
        fwd_c, bwd_c = flops.fwd * scale / split / peak, flops.bwd * scale / split / peak
    mem_f, mem_b = memory_s(cluster, fwd_bytes), memory_s(cluster, bwd_bytes)
    if gemms is not None:  # a product kernel's fixed time, beyond the gap every kernel pays
        launch_f += len(gemms[0]) * (cluster.gemm_latency_s - cluster.kernel_gap_s)
        launch_b += len(gemms[1]) * (cluster.gemm_latency_s - cluster.kernel_gap_s)
    store_f = store_b = 0.0
    if gemms is not None and cluster.gemm_stores_after_main_loop:
        # each product's result is written after its main loop (``kernels.gemm_store_s``), not under it
        e, weights = ctx.precision.activation_bytes, _weight_gemms(node, graph)
        store_f = sum(gemm_store_s(cluster, g.m, g.n, g.batch, e) for g in gemms[0])
        store_b = sum(gemm_store_s(cluster, g.m, g.n, g.batch, weight_grad_store_bytes(ctx) if i in weights else e)
                      for i, g in enumerate(gemms[1]))
        mem_f, mem_b = max(0.0, mem_f - store_f), max(0.0, mem_b - store_b)
    fwd = max(fwd_c, mem_f) + launch_f + store_f
    bwd = max(bwd_c, mem_b) + launch_b + store_b
    tensor_f = fwd_c if flops.fwd > 0 and fwd_c >= mem_f else 0.0
    tensor_b = bwd_c if flops.fwd > 0 and bwd_c >= mem_b else 0.0
    if fp8_g is not None:
        cast_f, cast_b = _cast_s(node, fp8_g, cluster, ctx)
        fwd, bwd = fwd + cast_f, bwd + cast_b
    return OpTiming(fwd, bwd, tensor_f, tensor_b, product_demand(cluster, fp8))
