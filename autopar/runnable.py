"""Which search results autopar's runtime can run: the filter the planner hands the layout search.

The runtime builds ``parallelize_module`` styles from a plan's placements and refuses what it cannot lay out
(``autopar.runtime.support.check_runnable``: sequence parallelism around a row-parallel projection, a
HuggingFace architecture it cannot split into stages, ...).  Such an intra-op solution must not be
chosen, so the search asks this filter before it keeps a candidate.  The answer depends only on the
intra-op solution (its placements and the tp degree and sequence parallelism they were solved for), on whether
there are pipeline stages, context and expert parallelism, and, for a plan that compiles its blocks, on whether
its schedule splits the backward and whether it recomputes selectively, so it is computed once per combination.
Solutions are told apart by their placements, not by which solve made them: the solves at several micro-batch
sizes and both variants often place every op alike (GPT-3 175B on 1024 GPUs: 18 combinations, 6 distinct).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.inter_op.estimate import Estimate
from autopar.inter_op.layout import Layout
from autopar.inter_op.to_plan import build_plan
from autopar.intra_op.strategies import Strategy
from autopar.ir import OpGraph, Ref
from autopar.passes.context import PassContext
from autopar.passes.flops import attention_mask
from autopar.runtime.support import check_runnable, model_on_meta
from autopar.solvers.pipeline import SPLIT_BACKWARD


class RuntimeFilter:
    """``accept(estimate, strategies)`` for ``autopar.inter_op.search.search``; ``reasons`` keeps why each
    refused solution was refused (the first one makes the error when nothing is left)."""

    def __init__(self, graph: OpGraph, model_ref: str, config: dict[str, Any], cluster: Cluster, ctx: PassContext,
                 global_batch: int, example_inputs: str | None = None) -> None:
        self._plan_args = {"graph": graph, "model_ref": model_ref, "config": config, "cluster": cluster, "ctx": ctx,
                           "global_batch": global_batch, "example_inputs": example_inputs}
        self._model = None
        self._verdicts: dict[tuple, str | None] = {}
        # each solution's placements, by its id (the solution is kept here too, so that its id is not reused)
        self._placements: dict[int, tuple[dict[str, Strategy], frozenset]] = {}
        self.reasons: list[str] = []

    def _key(self, lay: Layout, strategies: dict[str, Strategy]) -> tuple:
        if id(strategies) not in self._placements:
            self._placements[id(strategies)] = (strategies, frozenset(strategies.items()))
        return (self._placements[id(strategies)][1], lay.tp, lay.sp, lay.pp > 1, lay.cp > 1, lay.ep > 1,
                lay.schedule in SPLIT_BACKWARD, lay.recompute == "selective")

    def may_accept(self, layout: Layout, strategies: dict[str, Strategy]) -> bool:
        """False where ``accept`` already refused this combination (the search skips estimating it)."""
        return self._verdicts.get(self._key(layout, strategies)) is None

    def accept(self, estimate: Estimate, strategies: dict[str, Strategy]) -> bool:
        key = self._key(estimate.layout, strategies)
        if key not in self._verdicts:
            self._verdicts[key] = self._refusal(estimate, strategies)
            if self._verdicts[key] is not None:
                self.reasons.append(self._verdicts[key])
        return self._verdicts[key] is None

    def _refusal(self, estimate: Estimate, strategies: dict[str, Strategy]) -> str | None:
        plan = build_plan(**self._plan_args, estimate=estimate, strategies=strategies)
        if self._model is None:
            self._model = model_on_meta(plan)
        try:
            check_runnable(plan, self._model)
        except AutoparError as exc:
            return str(exc)
        if estimate.layout.cp > 1:
            return masked_attention_refusal(self._plan_args["graph"])
        return None


def masked_attention_refusal(graph: OpGraph) -> str | None:
    """Why context parallelism cannot run ``graph``'s attention, where an SDPA call takes a mask tensor (ALiBi, a
    sliding window shorter than the sequence, a padding mask): the runtime's attention over the whole sequence
    (``autopar.runtime.context_parallel``) masks by position alone and would drop it.  ``None`` when none does."""
    for node in graph.ops():
        if node.op != "aten.scaled_dot_product_attention.default":
            continue
        if isinstance(attention_mask(node), Ref):
            return (f"context parallelism runs attention masked by position alone; this model's attention "
                    f"({node.name}) takes a mask tensor: plan with --fix cp=1")
    return None


def runtime_filter(graph: OpGraph, model_ref: str, config: dict[str, Any], cluster: Cluster, ctx: PassContext,
                   global_batch: int, example_inputs: str | None = None) -> RuntimeFilter | None:
    """The filter for plans autopar's own runtime trains (the ``torch`` framework); ``None`` for plans that
    another framework runs."""
    if ctx.framework.name != "torch":
        return None
    return RuntimeFilter(graph, model_ref, config, cluster, ctx, global_batch, example_inputs)


Accept = Callable[[Estimate, dict[str, Strategy]], bool]
__all__ = ["Accept", "RuntimeFilter", "runtime_filter"]
