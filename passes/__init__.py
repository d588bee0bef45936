"""Graph passes over the ``OpGraph``, run by one visible pipeline.

Every pass is ``(graph, ctx) -> graph`` and owns one annotation key.  ``DEFAULT_PIPELINE`` lists them
in order; ``run_pipeline`` runs them, skips the ones ``ctx.disabled_passes`` names and, with
``ctx.verify_ir``, checks the IR after each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from autopar.passes.activations import annotate_activations_pass
from autopar.passes.attention_layout import attention_output_layout_pass
from autopar.passes.context import PassContext, PrecisionPolicy
from autopar.passes.flops import annotate_flops_pass
from autopar.passes.fusion import annotate_fusion_pass
from autopar.passes.state_memory import annotate_state_memory_pass
from autopar.passes.traffic import annotate_traffic_pass

from autopar.ir import OpGraph

log = logging.getLogger(__name__)

Pass = Callable[[OpGraph, PassContext], OpGraph]

DEFAULT_PIPELINE: tuple[Pass, ...] = (
    attention_output_layout_pass,  # which views of the attention's output copy it: before every pass that reads views
    annotate_flops_pass,  # needs only the traced shapes
    annotate_fusion_pass,  # what compiled blocks fuse: needs the FLOPs (products and attention are not fused)
    annotate_traffic_pass,  # needs the traced shapes, view aliasing and the fusion
    annotate_activations_pass,  # needs view aliasing; independent of the two above
    annotate_state_memory_pass,  # needs only the parameter table
)


def verify_ir(graph: OpGraph) -> None:
    """Invariants every pass must keep: names unique, inputs defined before use, outputs present."""
    seen: set[str] = set()
    for node in graph.nodes:
        if node.name in seen:
            raise AssertionError(f"duplicate node name {node.name}")
        for src in node.inputs:
            if src not in seen:
                raise AssertionError(f"{node.name} reads {src} before it is defined")
        if node.kind == "op" and not node.outputs:
            raise AssertionError(f"{node.name} has no outputs")
        seen.add(node.name)


def run_pipeline(graph: OpGraph, ctx: PassContext, pipeline: Sequence[Pass] = DEFAULT_PIPELINE) -> OpGraph:
    """Run the passes in order and record their timings in ``graph.annotations["pass_times_s"]``."""
    times: dict[str, float] = {}
    for i, p in enumerate(pipeline):
        name = p.__name__
        if name in ctx.disabled_passes:
            log.info("pass %d %s: disabled", i, name)
            continue
        t0 = time.perf_counter()
        result = p(graph, ctx)
        if not isinstance(result, OpGraph):
            raise TypeError(f"pass {name} returned {type(result).__name__}, not an OpGraph")
        graph = result
        times[name] = time.perf_counter() - t0
        log.info("pass %d %s: %.3f s", i, name, times[name])
        if ctx.verify_ir:
            verify_ir(graph)
    graph.annotations["pass_times_s"] = times
    return graph


__all__ = ["DEFAULT_PIPELINE", "PassContext", "PrecisionPolicy", "run_pipeline", "verify_ir"]
