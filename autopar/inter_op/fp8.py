"""FP8 training (``--precision fp8``), as the inter-op planner sees it: which precisions a search tries, what an FP8
plan writes, and the one byte per element its ZeRO-3 gathers move where the framework gathers the weights cast.

FP8 is no layout knob: it changes the cost of every product, so the intra-op solves and unit costs run once per
training precision, and the planner searches the layouts under each (``autopar.api.plan_graph``) and keeps the
faster plan.  Which products run in FP8 and what their casts cost is per op, in ``autopar.intra_op.fp8``; the
runtime's swap of Linears is ``autopar.runtime.fp8``.  The framework's flags are its ``[fp8]`` table
(``fp8_scaling``, ``fp8_param_gather``).
"""

from __future__ import annotations

from typing import Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.framework import Framework
from autopar.inter_op.unit_costs import UnitCost
from autopar.intra_op.fp8 import fp8_eligible, layer_linear_weight
from autopar.intra_op.strategies import R, shard_dim
from autopar.ir import OpGraph
from autopar.passes.context import TRAINING_PRECISIONS, PassContext


def training_precisions(precision: str, cluster: Cluster, framework: Framework) -> tuple[str, ...]:
    """The training precisions a search over ``precision`` (``bf16``, ``fp8`` or ``auto``) tries: ``auto`` adds
    fp8 where the devices have FP8 tensor cores and the framework trains in it.  An fp8 the cluster or the
    framework cannot run is a one-line ``AutoparError``."""
    if precision not in (*TRAINING_PRECISIONS, "auto"):
        raise AutoparError(f"precision (--precision) must be one of {', '.join(TRAINING_PRECISIONS)} or auto, "
                           f"not {precision!r}")
    can = cluster.has_fp8 and framework.fp8_scaling != "none"
    if precision == "fp8" and not cluster.has_fp8:
        raise AutoparError(f"--precision fp8: {cluster.device} ({cluster.name}) has no FP8 tensor cores "
                           "(its peak_fp8_flops is 0); use --precision bf16")
    if precision == "fp8" and framework.fp8_scaling == "none":
        raise AutoparError(f"--precision fp8: framework {framework.name} does not train in FP8 in autopar's model "
                           "(fp8_scaling = none); use --precision bf16 or another --framework")
    if precision == "auto":
        return ("bf16", "fp8") if can else ("bf16",)
    return (precision,)


def fp8_gathered_params(u: UnitCost, ctx: PassContext) -> float:
    """Of ``u``'s local parameters, those a ZeRO-3 all-gather moves in FP8 (one byte each): its FP8 Linears'
    weights, where the plan trains in FP8 and the framework gathers them cast (``Framework.fp8_param_gather``)."""
    return u.fp8_params if ctx.precision.training == "fp8" and ctx.framework.fp8_param_gather else 0.0


def fp8_linears(graph: OpGraph, ctx: PassContext, tp_place: dict[str, str], tp: int) -> list[str]:
    """The Linears of an FP8 plan that train in FP8 (``autopar.intra_op.fp8``): those of the transformer
    layers whose weight, as one tp rank holds it, has both dimensions aligned to 16."""
    if ctx.precision.training != "fp8":
        return []
    out = set()
    for n in graph.ops():
        weight = layer_linear_weight(n, graph)
        if weight is None:
            continue
        shape = [float(d) for d in weight.out.shape]
        dim = shard_dim(tp_place.get(weight.target, R))
        if dim is not None:
            shape[dim] /= tp
        if fp8_eligible(1, shape[0], shape[1]):
            out.add(n.module)
    return sorted(out)


def plan_precision(graph: OpGraph, ctx: PassContext, tp_place: dict[str, str], tp: int) -> dict[str, Any]:
    """The plan file's ``precision``: ``training``, and for fp8 how it scales, whether ZeRO-3 gathers in FP8 and
    which Linears train in it."""
    if ctx.precision.training != "fp8":
        return {"training": "bf16"}
    return {"training": "fp8", "fp8_scaling": ctx.framework.fp8_scaling,
            "fp8_param_gather": ctx.framework.fp8_param_gather, "fp8_linears": fp8_linears(graph, ctx, tp_place, tp)}


__all__ = ["fp8_gathered_params", "fp8_linears", "plan_precision", "training_precisions"]
