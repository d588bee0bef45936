"""Tensor parallelism's degrees and rules: which ``tp`` the search offers, and which a model's attention refuses.

``tp`` tiles an NVLink domain (a node, or a rack-scale domain such as GB200 NVL72's), across domains only where
the network is nearly as fast (``tensor_parallel_degrees``; a pinned ``tp`` may cross them anyway), and divides
the query heads and the key/value heads unless there is one (multi-query attention: replicated,
``heads_refuse_tp``).  The intra-op ILP (``autopar.intra_op``) chooses each op's split on the ``tp`` axis; the
gradients of parameters replicated on tp but computed split are synchronized once per iteration (its bound term).
"""

from __future__ import annotations

from collections.abc import Iterator

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.links import Links
from autopar.inter_op.technique import Partial, SearchSpace, Technique, UnitTotals, check_divides, divisors
from autopar.ir import OpGraph
from autopar.passes.context import PassContext

#: Tensor parallelism is searched across NVLink domains only where the network gives a rank at least this
#: share of the bus bandwidth NVLink gives it: every layer's activations cross the tp group several times
#: per micro-batch, and on a slower network the layouts that do so never win (a pinned tp may still cross).
TP_ACROSS_DOMAINS_BANDWIDTH_SHARE = 0.5


def attention_heads(graph: OpGraph) -> list[tuple[int, int]]:
    """(query heads, key/value heads) of every distinct attention op."""
    heads = set()
    for n in graph.ops():
        if n.op == "aten.scaled_dot_product_attention.default":
            q, k = graph.tensor(n.args[0]), graph.tensor(n.args[1])
            if q is not None and k is not None and len(q.shape) == len(k.shape) == 4:
                heads.add((q.shape[1], k.shape[1]))
    return sorted(heads)


def heads_refuse_tp(heads: list[tuple[int, int]] | tuple[tuple[int, int], ...], tp: int) -> str | None:
    """Why ``tp`` cannot split the attention, or ``None``: each rank takes ``1 / tp`` of the query heads and
    either its share of the key/value heads or, with a single one (multi-query attention), all of it,
    replicated as Megatron-LM does (grouped-query attention with fewer key/value heads than ``tp`` would need
    each rank to hold just the groups of its query heads, which no DTensor placement expresses)."""
    for q, kv in heads:
        counts = f"{q} query heads, {kv} kv head{'s' if kv > 1 else ''}"
        if q % tp:
            return f"tp={tp} does not divide the query heads ({counts})"
        if kv % tp and kv != 1:
            return f"tp={tp} does not divide the key/value heads, and only a single one can be replicated ({counts})"
    return None


def tensor_parallel_degrees(cluster: Cluster) -> list[int]:
    """The tp degrees the search offers: the divisors of an NVLink domain (a node, or a rack-scale domain),
    whose groups never straddle two domains, and whole domains where the network is nearly as fast as NVLink."""
    domain = cluster.nvlink_domain
    nvlink = cluster.intra_node_bandwidth_bytes_per_s * cluster.intra_node_collective_efficiency
    network = cluster.nic_bandwidth_per_gpu_bytes_per_s * cluster.inter_node_collective_efficiency
    across = network >= TP_ACROSS_DOMAINS_BANDWIDTH_SHARE * nvlink
    return [d for d in divisors(cluster.gpus) if domain % d == 0 or (across and d % domain == 0)]


def _expand(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    for tp in space.allowed("tp", tensor_parallel_degrees(space.cluster)):
        if not heads_refuse_tp(space.heads, tp):
            yield {**p, "tp": tp}


def _check_fixed(space: SearchSpace, graph: OpGraph) -> None:
    if "tp" in space.fixed and (why := heads_refuse_tp(space.heads, space.fixed["tp"])):
        raise AutoparError(f"--fix {why}")
    check_divides(space, "tp")


def _tp_sync_bound_s(t: UnitTotals, layout: Layout, links: Links, cluster: Cluster, ctx: PassContext) -> float:
    return t.tp_sync_s / layout.pp  # the mean stage's share


TECHNIQUE = Technique("tensor_parallel", (Knob("tp"),), expand=_expand, check_fixed=_check_fixed,
                      time_bound_s=_tp_sync_bound_s)

__all__ = ["TECHNIQUE", "TP_ACROSS_DOMAINS_BANDWIDTH_SHARE", "attention_heads", "heads_refuse_tp",
           "tensor_parallel_degrees"]
