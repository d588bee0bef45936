"""Expert parallelism on top of unit costs: what one of ``ep`` ranks sharing its experts does and holds.

The runtime (``autopar.runtime.expert_parallel``) splits the stacked experts over ``ep`` neighbouring
data-parallel ranks.  Each rank routes its own tokens and fills every expert's slots as before; an
all-to-all then hands each rank the slots of its own experts from all ``ep`` ranks, and a second one hands
the outputs back.  With capacity routing every expert has the same number of slots, so a rank's experts
run ``ep`` times the sequences on ``1 / ep`` of the experts: the same products, FLOPs and saved bytes as
without expert parallelism (the capacity factor's padding is in the traced shapes already: that is its
load imbalance, the price of a static shape, GShard, Lepikhin et al. 2020, sec. 2.2), and ``1 / ep`` of
the expert weights.

Those products do change shape: ``1 / ep`` of the experts (the batched GEMM's batch) over ``ep`` times
the slots (its token dimension), so each is re-timed at the shapes a rank runs (``autopar.kernels``):
small experts fill the GPU better with more tokens each, and a product bound by reading its experts'
weights (few slots each) reads ``1 / ep`` of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from autopar.cluster import AxisLink, Cluster
from autopar.collectives import all_to_all_s
from autopar.errors import AutoparError
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.technique import Partial, SearchSpace, Technique, UnitLoadDraft, divisors
from autopar.inter_op.unit_costs import UnitCost
from autopar.intra_op.sharding_costs import Gemm
from autopar.ir import OpGraph
from autopar.kernels import gemm_s, memory_s
from autopar.passes.experts import expert_count, expert_weights

#: Passes over one rank's buffer that the permuting copy beside each all-to-all makes (read and write): the
#: dispatch lays its send buffer out by destination rank, the combine puts the received outputs back in
#: expert order (``autopar.runtime.expert_parallel``; torchtitan permutes its tokens the same way).
PERMUTE_PASSES = 2


def expert_parallel_share(u: UnitCost, ep: int, cluster: Cluster) -> UnitCost:
    """Unit ``u`` (costed with every expert on the rank) as one of ``ep`` expert-parallel ranks holds and
    runs it."""
    if ep <= 1 or not u.expert_fqns:
        return u
    experts = set(u.expert_fqns)
    param_local = {f: n / ep if f in experts else n for f, n in u.param_local.items()}
    dense = u.params_local - u.expert_params_local
    # the experts module is the largest of a MoE layer; whatever else is largest holds at most the rest
    largest = max(u.expert_params_local / ep, min(u.largest_module_params, dense))
    fwd = bwd = weight = 0.0  # how much longer (shorter) the expert products take at a rank's shapes
    for p in u.expert_products:
        w = p.weight_memory_s
        fwd += _retimed(p.fwd, ep, cluster, p.memory_fwd_s, w)
        bwd += _retimed(p.bwd, ep, cluster, p.memory_bwd_s, 2 * w)
        if p.weight >= 0:
            weight += _retimed(p.bwd[p.weight:p.weight + 1], ep, cluster, 0.0, 0.0)
    # at the clock the unit holds under the power cap, as its other times are (``autopar.power``)
    fwd, bwd, weight = fwd / u.clock, bwd / u.clock, weight / u.clock
    return dataclasses.replace(
        u, param_local=param_local, largest_module_params=largest, fwd_s=u.fwd_s + fwd, bwd_s=u.bwd_s + bwd,
        product_s=u.product_s + fwd + bwd, bwd_weight_s=max(0.0, u.bwd_weight_s + weight),
        full_recompute_s=u.full_recompute_s + fwd)


def _retimed(gemms: tuple[tuple[Gemm, str], ...], ep: int, cluster: Cluster, memory_s: float,
             weight_memory_s: float) -> float:
    """The change in time of ``gemms`` (each with its token field) at ``1 / ep`` of the batch and ``ep``
    times the tokens, run no faster than streaming their bytes (``memory_s``), of which the weights'
    (``weight_memory_s``) shrink to ``1 / ep``: small experts are bound by reading their weights."""
    def time(scale: int) -> float:
        total = 0.0
        for g, tokens in gemms:
            dims = {"m": g.m, "n": g.n, "k": g.k}
            dims[tokens] *= scale
            total += gemm_s(cluster, dims["m"], dims["n"], dims["k"], g.batch / scale)
        return max(total, memory_s - weight_memory_s * (1 - 1 / scale))
    return time(ep) - time(1)


def expert_exchange_s(nbytes: float, link: AxisLink, cluster: Cluster) -> float:
    """One all-to-all of ``nbytes`` of slots over the ep group, with its permuting copies."""
    if nbytes <= 0 or link.size <= 1:
        return 0.0
    return all_to_all_s(nbytes, link) + memory_s(cluster, PERMUTE_PASSES * nbytes)



def expert_parallel_refuses(ep: int, dp: int, cp: int = 1, tp: int = 1, sp: bool = False) -> str | None:
    """Why ``ep`` cannot run beside the other axes, or ``None``: the one rule the search, ``--fix`` and the runtime
    (``autopar.runtime.support``) share.  The expert-parallel ranks are data-parallel ranks, and the capacity
    routing fills each expert's slots from whole sequences, so neither context nor sequence parallelism may cut
    them."""
    if ep <= 1:
        return None
    if dp % ep:
        return f"ep={ep} must divide dp={dp} (the expert-parallel ranks are data-parallel ranks)"
    if cp > 1:
        return (f"expert parallelism runs without context parallelism (cp={cp}): capacity routing fills each "
                "expert's slots from whole sequences")
    if sp and tp > 1:
        return ("expert parallelism runs without sequence parallelism (sp=on): the routing would see a slice of "
                "each sequence")
    return None


def check_fixed_expert_parallel(graph: OpGraph, fixed: dict[str, Any]) -> None:
    """A one-line ``AutoparError`` for a pinned ``ep`` the model or the other pinned values refuse."""
    ep, experts = fixed["ep"], expert_count(graph)
    if not experts:
        raise AutoparError(f"--fix ep={ep}: the model has no stacked experts to split (a parameter [experts, ...] "
                           "that a batched product reads)")
    listed = [w for w in expert_weights(graph) if not w.stacked]
    if listed:
        raise AutoparError(f"--fix ep={ep}: {listed[0].module} keeps its {listed[0].experts} experts in a ModuleList; "
                           "autopar's expert parallelism splits stacked experts (one [experts, ...] weight, fed "
                           "fixed-capacity slots); plan with ep=1")
    dropless = [w.module for w in expert_weights(graph) if not w.capacity_slots]
    if dropless:
        raise AutoparError(f"--fix ep={ep}: {dropless[0]} routes without a capacity (dropless: a number of tokens per "
                           "expert known only at run time); autopar's expert parallelism dispatches fixed-capacity "
                           "slots; plan with ep=1")
    if experts % ep:
        raise AutoparError(f"--fix ep={ep} does not divide the {experts} experts")
    why = expert_parallel_refuses(ep, fixed.get("dp", ep), fixed.get("cp", 1), fixed.get("tp", 1),
                                  bool(fixed.get("sp")))
    if why:
        raise AutoparError(f"--fix {why}" if why.startswith("ep=") else f"--fix ep={ep}: {why}")

def expert_exchange(u: UnitCost, layout: Layout, ep_link: AxisLink, cluster: Cluster) -> tuple[float, float]:
    """``u``'s forward dispatch and combine over its ``ep`` group, and the memory they need while the unit runs
    (its forward transients and both buffers); zeros without expert parallelism or experts."""
    if layout.ep <= 1 or not u.expert_fqns:
        return 0.0, 0.0
    fwd = expert_exchange_s(u.expert_dispatch_bytes, ep_link, cluster) \
        + expert_exchange_s(u.expert_combine_bytes, ep_link, cluster)
    return fwd, u.forward_transient_bytes + 2 * max(u.expert_dispatch_bytes, u.expert_combine_bytes)


def _expand(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    dp, cp, tp, sp = p["dp"], p["cp"], p["tp"], p["sp"]
    experts = space.experts
    for ep in space.allowed("ep", [d for d in divisors(dp) if experts % d == 0] if experts and cp == 1 else [1]):
        if expert_parallel_refuses(ep, dp, cp, tp, sp) is None:
            yield {**p, "ep": ep}


def _check_fixed(space: SearchSpace, graph: OpGraph) -> None:
    if space.fixed.get("ep", 1) > 1:
        check_fixed_expert_parallel(graph, dict(space.fixed))


def _share(u: UnitCost, layout: Layout, cluster: Cluster) -> UnitCost:
    return expert_parallel_share(u, layout.ep, cluster)


def _unit_step(d: UnitLoadDraft) -> None:
    ep_fwd, ep_extra = expert_exchange(d.u, d.layout, d.links.ep, d.cluster)
    if ep_fwd or ep_extra:
        d.extra_bytes = max(d.extra_bytes, ep_extra)
        if d.mode in ("full", "op"):  # both re-run the forward's all-to-alls (they are no product or attention)
            d.recompute_s += ep_fwd
    d.ep_fwd_s, d.ep_s = ep_fwd, 2 * ep_fwd  # backward: the same exchanges of the gradients, in reverse


TECHNIQUE = Technique("expert_parallel", (Knob("ep"),), expand=_expand, check_fixed=_check_fixed, share=_share,
                      shares_at=lambda layout: layout.ep, unit_step=_unit_step)

__all__ = ["PERMUTE_PASSES", "TECHNIQUE", "check_fixed_expert_parallel", "expert_exchange", "expert_exchange_s",
           "expert_parallel_refuses", "expert_parallel_share"]
