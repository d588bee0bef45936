"""Per-unit costs of the model on a tensor-parallel group: the inputs of the inter-op search.

The model is a chain of units: the ops before the block stack (``pre``: embeddings), every layer of the
stack, and the ops after it (``post``: final norm, head, loss).  For a tensor-parallel degree, a
micro-batch size and the sequence-parallel switch, one intra-op ILP over the whole graph on the 1-D
``tp`` mesh (identical layers tied, so its size does not depend on depth) chooses every op's strategy;
this module then reads off, per unit, what the pipeline and data-parallel models need: forward/backward
compute, tensor-parallel communication, parameters per device, saved activations, the unit's input
(what a pipeline boundary sends and full recomputation keeps) and the attention core (what selective
recomputation drops).  Data parallelism is applied analytically on top (``autopar.inter_op.estimate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster, MeshSpec
from autopar.intra_op.problem import IntraOpConfig, IntraOpSolution, solve_intra_op
from autopar.intra_op.sharding_costs import (
    ATTENTION_OPS,
    compute_s,
    edge_costs_s,
    param_cost,
    shard_factor,
)
from autopar.intra_op.strategies import AxisStrategy, R, Strategy, tensor_refs
from autopar.ir import OpGraph
from autopar.passes.context import PassContext
from autopar.solvers.ilp import Backend

PRE, POST = "pre", "post"
ATTENTION_CORE_KEYS = ("probs", "dropout_mask", "dropped_probs")


@dataclass(frozen=True, slots=True)
class UnitCost:
    """Costs of one unit for one micro-batch on one device of its tensor-parallel group."""

    fwd_s: float
    bwd_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    tp_sync_s: float  # per iteration: gradients of parameters replicated on tp but computed split (SP norms)
    params: int  # parameters of the unit (whole model view)
    param_local: dict[str, float]  # FQN -> elements one device holds (after tensor parallelism)
    activation_bytes: float  # saved for backward, per micro-batch
    input_bytes: float  # the unit's input activation on one device (pipeline send, full-recompute checkpoint)
    attention_fwd_s: float  # forward time of attention (recomputed by selective recomputation)
    attention_saved_bytes: float  # the s x s tensors math attention saves (dropped by selective recomputation)
    fwd_flops: float  # model FLOPs of the forward, whole tp group, one micro-batch
    attention_fwd_flops: float

    @property
    def params_local(self) -> float:
        return sum(self.param_local.values())


def unit_sequence(graph: OpGraph) -> list[str]:
    """Unit keys in model order: ``pre``, one structural hash per layer, ``post``."""
    return [PRE, *(layer.structural_hash for layer in graph.layers), POST]


def _unit_nodes(graph: OpGraph) -> dict[str, list[str]]:
    """Op nodes of one instance of every unit.

    A layer type is read off its second occurrence when there is one: its input then comes from a layer
    like itself, as for all but the first layer of the stack.
    """
    instances: dict[str, list[int]] = {}
    for layer in graph.layers:
        instances.setdefault(layer.structural_hash, []).append(layer.index)
    wanted = {idx[1] if len(idx) > 1 else idx[0]: h for h, idx in instances.items()}
    units: dict[str, list[str]] = {PRE: [], POST: [], **{h: [] for h in instances}}
    seen_layer = False
    for n in graph.ops():
        if n.layer is not None:
            seen_layer = True
            if n.layer in wanted:
                units[wanted[n.layer]].append(n.name)
        else:
            units[POST if seen_layer else PRE].append(n.name)
    return units


def _replicated(graph: OpGraph, names: list[str], axes: int) -> dict[str, Strategy]:
    return {name: tuple(AxisStrategy((R,) * len(graph[name].outputs), (R,) * len(tensor_refs(graph[name])))
                        for _ in range(axes)) for name in names}


def solve_tp(graph: OpGraph, cluster: Cluster, ctx: PassContext, tp: int, mbs: int, sp: bool,
             backend: Backend = "cbc", time_limit_s: float = 60.0, grad_sync_weight: float = 0.0,
             memory_slack: float | None = None) -> tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]:
    """Every op's strategy on the ``tp`` mesh at micro-batch ``mbs`` (all replicated when ``tp == 1``)."""
    mesh = MeshSpec.on_cluster(cluster, ("tp",), (tp,))
    ops = [n.name for n in graph.ops()]
    if tp == 1:
        return mesh, _replicated(graph, ops, 1), None
    cfg = IntraOpConfig(batch=mbs, sequence_parallel=sp, backend=backend, time_limit_s=time_limit_s,
                        grad_sync_weight=grad_sync_weight, memory_slack=memory_slack)
    sol = solve_intra_op(graph, ops, mesh, cfg, cluster, ctx)
    if not sol.node_strategies:
        raise RuntimeError(f"intra-op ILP returned no solution ({sol.result.status})")
    return mesh, sol.node_strategies, sol


def unit_costs(graph: OpGraph, strategies: dict[str, Strategy], mesh: MeshSpec, mbs: int, cluster: Cluster,
               ctx: PassContext) -> dict[str, UnitCost]:
    """Read per-unit costs off the chosen strategies."""
    out = {}
    for key, names in _unit_nodes(graph).items():
        out[key] = _unit_cost(graph, names, strategies, mesh, mbs, cluster, ctx)
    return out


def _unit_cost(graph: OpGraph, names: list[str], strategies: dict[str, Strategy], mesh: MeshSpec, mbs: int,
               cluster: Cluster, ctx: PassContext) -> UnitCost:
    members = set(names)
    fwd = bwd = tp_fwd = tp_bwd = tp_sync = attn_s = attn_bytes = 0.0
    act = 0.0
    input_bytes = 0.0
    params: dict[str, float] = {}
    params_global: dict[str, int] = {}
    fwd_flops = attn_flops = 0.0
    seen: set[str] = set()
    for name in names:
        node = graph[name]
        strat = strategies[name]
        f, b = compute_s(node, graph, strat, mesh, mbs, cluster, ctx)
        fwd, bwd = fwd + f, bwd + b
        flops = node.annotations["flops"].fwd * graph.scale(node, mbs)
        fwd_flops += flops
        if node.op in ATTENTION_OPS:
            attn_s += f
            attn_flops += flops
        refs = tensor_refs(node)
        for k, r in enumerate(refs):
            src = graph[r.name]
            required = tuple(ax.inputs[k] for ax in strat)
            if src.kind == "param":
                pc = param_cost(src.out, required, strat, mesh, 0, ctx)
                tp_sync += pc.per_iteration_s
                params.setdefault(src.target, src.out.numel_at(1) / shard_factor(required, mesh))
                params_global.setdefault(src.target, src.out.numel_at(1))
                continue
            if r.name not in strategies:  # inputs, buffers, constants: produced replicated, no gradient
                continue
            t = graph.tensor(r)
            produced = tuple(ax.outputs[r.index] if r.index < len(ax.outputs) else R for ax in strategies[r.name])
            ef, eb = edge_costs_s(t, produced, required, strat, mesh, mbs, ctx)
            tp_fwd, tp_bwd = tp_fwd + ef, tp_bwd + eb
            if r.name not in members and graph[r.name].kind == "op" and t.is_floating:
                input_bytes = max(input_bytes, t.numel_at(mbs) * ctx.precision.activation_bytes
                                  / shard_factor(produced, mesh))
        saved = [t for t in node.annotations.get("saved", ()) if t.key not in seen]
        seen.update(t.key for t in saved)
        if saved:
            factor = max([shard_factor(tuple(ax.outputs[j] for ax in strat), mesh) for j in range(len(node.outputs))]
                         + [shard_factor(tuple(ax.inputs[j] for ax in strat), mesh) for j, r in enumerate(refs)
                            if graph[r.name].kind not in ("param", "buffer", "constant")])
            for t in saved:
                b_ = t.nbytes.at(mbs) / factor
                act += b_
                if t.key.rsplit(":", 1)[-1] in ATTENTION_CORE_KEYS:
                    attn_bytes += b_
    return UnitCost(fwd, bwd, tp_fwd, tp_bwd, tp_sync, sum(params_global.values()), params, act,
                    input_bytes, attn_s, attn_bytes, fwd_flops, attn_flops)


__all__ = ["POST", "PRE", "UnitCost", "solve_tp", "unit_costs", "unit_sequence"]
