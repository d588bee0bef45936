"""Find a mixture of experts' stacked expert weights in the graph.

An experts module holds its weights stacked, ``[experts, ...]`` (``models/moe.py``, HuggingFace's
Mixtral and Qwen-MoE experts in transformers 5), and runs them with batched products over the expert
dimension (``einsum``, ``bmm``, ``_grouped_mm``), on the weight itself, a view of it (a transpose) or the
rows of it each token picks (HuggingFace's batched-matmul experts), on tokens that were routed to them
(picked by index: a gather or an index).  So: a module whose products read a parameter of three or more
dimensions that way, one of them on routed tokens or picked rows, is an experts module, and those
parameters its expert weights, their first dimension the number of experts.  (A per-head weight
``[heads, ...]`` in an attention einsum reads no routed tokens: it is no expert.)

Expert parallelism (``layout.ep``) splits that dimension, for experts fed fixed-capacity slots: the first
expert product reads ``[batch, experts, capacity, hidden]`` (``models/moe.py``'s capacity routing), which
one all-to-all of equal splits dispatches.  Dropless experts (tokens sorted by expert, a grouped product
over a number of tokens per expert known only at run time) are found too, and planned without ep.

Experts kept in a ``ModuleList`` (HuggingFace 4.x, many research MoEs) are found by their name and
structure: sibling modules of a layer named by their index under a module whose name says expert
(``experts.0``, ``experts.1``, ...), with parameters of the same names and shapes.  Their Linears are
planned like any other (HuggingFace's token loop over ``nonzero()`` does not export; a dense mixture that
runs every expert does), without ep.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from autopar.ir import Node, OpGraph, Ref, iter_refs

#: The batched products that run stacked experts (a convolution's weight has three dimensions too).
EXPERT_PRODUCT_OPS = frozenset({"aten.einsum.default", "aten.bmm.default", "aten.matmul.default",
                                "aten.baddbmm.default", "aten._grouped_mm.default"})


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The stacked expert weights of one experts module."""

    module: str  # FQN of the module running them
    params: tuple[str, ...]  # canonical FQNs
    experts: int  # the size of their leading dimension
    capacity_slots: bool = True  # its first product reads [batch, experts, capacity, ...] (not dropless)
    stacked: bool = True  # one [experts, ...] weight each, rather than a ModuleList of experts


#: Ops between a stacked weight and the product reading it: views, and HuggingFace's per-token row pick.
_WEIGHT_PATH_OPS = frozenset({"aten.index.Tensor", "aten.index_select.default"})
#: Ops that route tokens: they pick rows by an index computed from the router.
_ROUTING_OPS = frozenset({"aten.gather.default", "aten.index.Tensor", "aten.index_select.default",
                          "aten.scatter.src", "aten.scatter_add.default", "aten.take_along_dim.default"})


def _upstream(graph: OpGraph, ref: Ref, limit: int = 8) -> Iterator[Node]:
    """The node of ``ref`` and those it was made from, following each op's first tensor argument."""
    node = graph[ref.name]
    for _ in range(limit):
        yield node
        first = next(iter_refs(node.args), None) if node.kind == "op" else None
        if first is None:
            return
        node = graph[first.name]


def stacked_weight(graph: OpGraph, ref: Ref) -> str | None:
    """The stacked weight (canonical FQN) a product's operand ``ref`` is, directly or through views or a row
    pick of it; ``None`` for anything else."""
    for node in _upstream(graph, ref):
        if node.kind == "param":
            info = graph.params.get(node.target)
            return node.target if info is not None and len(info.shape) >= 3 else None
        if node.kind != "op" or (node.alias_of is None and node.op not in _WEIGHT_PATH_OPS):
            return None
    return None


def _routed(graph: OpGraph, ref: Ref) -> bool:
    """Whether ``ref`` (through views) is made by a routing op, or is a stacked weight's picked rows."""
    for node in _upstream(graph, ref):
        if node.kind != "op":
            return False
        if node.op in _ROUTING_OPS:
            return True
        if node.alias_of is None:
            return False
    return False


def expert_weights(graph: OpGraph) -> list[ExpertWeights]:
    """Every experts module of ``graph`` (those of the layers that were traced), in graph order."""
    found: dict[str, tuple[dict[str, None], int, bool]] = {}
    routed: set[str] = set()
    for n in graph.ops():
        if n.op not in EXPERT_PRODUCT_OPS:
            continue
        refs = list(iter_refs((n.args, n.kwargs)))
        weights = [w for w in (stacked_weight(graph, r) for r in refs) if w is not None]
        if weights and any(_routed(graph, r) for r in refs):
            routed.add(n.module)
        for fqn in weights:
            experts = graph.params[fqn].shape[0]
            if n.module not in found:  # its first product: does it read fixed-capacity slots?
                acts = [graph.tensor(r) for r in refs if stacked_weight(graph, r) is None]
                slots = any(t is not None and len(t.shape) == 4 and t.shape[1] == experts for t in acts)
                found[n.module] = ({}, experts, slots)
            params, fewest, slots = found[n.module]
            params[fqn] = None
            found[n.module] = (params, min(fewest, experts), slots)
    stacked = [ExpertWeights(module, tuple(params), experts, slots)
               for module, (params, experts, slots) in found.items() if module in routed]
    return stacked + listed_experts(graph)


def listed_experts(graph: OpGraph) -> list[ExpertWeights]:
    """Experts kept in a ``ModuleList`` inside the layers: two or more sibling modules named by their index
    whose parameters have the same names and shapes."""
    prefixes = {layer.index: layer.prefix for layer in graph.layers}
    groups: dict[str, dict[str, dict[str, tuple[int, ...]]]] = {}  # parent -> index -> param name -> shape
    for fqn, info in graph.params.items():
        prefix = prefixes.get(info.layer) if info.layer is not None else None
        if prefix is None or not fqn.startswith(prefix + "."):
            continue
        parts = fqn[len(prefix) + 1:].split(".")
        digits = [i for i, part in enumerate(parts[:-1]) if part.isdigit()]
        if not digits or digits[-1] == 0:
            continue
        i = digits[-1]
        if "expert" not in ".".join(parts[:i]).lower():
            continue  # a ModuleList of anything else (per-head projections, cloned Linears)
        parent = ".".join([prefix, *parts[:i]])
        groups.setdefault(parent, {}).setdefault(parts[i], {})[".".join(parts[i + 1:])] = info.shape
    out = []
    for parent, members in groups.items():
        shapes = list(members.values())
        if len(members) >= 2 and all(m == shapes[0] for m in shapes):
            params = tuple(f"{parent}.{idx}.{name}" for idx in sorted(members, key=int) for name in sorted(shapes[0]))
            out.append(ExpertWeights(parent, params, len(members), capacity_slots=False, stacked=False))
    return sorted(out, key=lambda w: w.module)


def stacked_expert_params(graph: OpGraph) -> set[str]:
    """The FQNs of every stacked expert weight (what a ``PlacedParameters`` region takes with its MoE layer)."""
    return {f for w in expert_weights(graph) if w.stacked for f in w.params}


def expert_count(graph: OpGraph) -> int:
    """The number of experts of the model's experts modules (the fewest, if they differ); 0 without any."""
    return min((w.experts for w in expert_weights(graph)), default=0)


def expert_parallel_count(graph: OpGraph) -> int:
    """``expert_count`` where every experts module takes fixed-capacity slots (what expert parallelism
    dispatches), else 0."""
    weights = expert_weights(graph)
    return min((w.experts for w in weights), default=0) if all(w.capacity_slots for w in weights) else 0


__all__ = ["EXPERT_PRODUCT_OPS", "ExpertWeights", "expert_count", "expert_parallel_count", "expert_weights",
           "stacked_expert_params", "stacked_weight"]
