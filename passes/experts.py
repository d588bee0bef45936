"""Find a mixture of experts' stacked expert weights in the graph.

An experts module holds its weights stacked, ``[experts, ...]`` (``models/moe.py``, HuggingFace's
Mixtral and Qwen-MoE experts in transformers 5), and runs them with batched products over the expert
dimension (``einsum``, ``bmm``, ``_grouped_mm``).  So: a parameter of three or more dimensions that a
product reads is an expert weight, its first dimension the number of experts, and the module of the ops
reading it the experts module.  Expert parallelism (``layout.ep``) splits that dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import OpGraph

#: The batched products that run stacked experts (a convolution's weight has three dimensions too).
EXPERT_PRODUCT_OPS = frozenset({"aten.einsum.default", "aten.bmm.default", "aten.matmul.default",
                                "aten.baddbmm.default", "aten._grouped_mm.default"})


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The stacked expert weights of one experts module."""

    module: str  # FQN of the module running them
    params: tuple[str, ...]  # canonical FQNs
    experts: int  # the size of their leading dimension


def expert_weights(graph: OpGraph) -> list[ExpertWeights]:
    """Every experts module of ``graph`` (those of the layers that were traced), in graph order."""
    found: dict[str, tuple[dict[str, None], int]] = {}
    for n in graph.ops():
        if n.op not in EXPERT_PRODUCT_OPS:
            continue
        for fqn in n.params:
            info = graph.params.get(fqn)
            if info is None or len(info.shape) < 3:
                continue
            params, experts = found.setdefault(n.module, ({}, info.shape[0]))
            params[fqn] = None
            found[n.module] = (params, min(experts, info.shape[0]))
    return [ExpertWeights(module, tuple(params), experts) for module, (params, experts) in found.items()]


def expert_count(graph: OpGraph) -> int:
    """The number of experts of the model's experts modules (the fewest, if they differ); 0 without any."""
    return min((w.experts for w in expert_weights(graph)), default=0)


__all__ = ["EXPERT_PRODUCT_OPS", "ExpertWeights", "expert_count", "expert_weights"]
