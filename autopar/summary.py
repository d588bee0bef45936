"""The model summary: what ``autopar plan`` reports about a traced model before any layout is chosen."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from autopar.inter_op.units import unit_chain
from autopar.ir import OpGraph
from autopar.passes.activations import ActivationSummary
from autopar.passes.flops import total_flops
from autopar.passes.state_memory import StateMemory


@dataclass(frozen=True, slots=True)
class LayerType:
    structural_hash: str
    count: int
    first_layer: int
    parameters_per_layer: int
    ops_per_layer: int
    module_type: str


def layer_types(graph: OpGraph) -> list[LayerType]:
    """The structurally distinct layers of the block stack, in order of first appearance."""
    state: StateMemory = graph.annotations["state_memory"]
    ops_per_layer = Counter(n.layer for n in graph.ops() if n.layer is not None)
    types = []
    for h, indices in graph.layer_types().items():
        first = indices[0]
        module_type = next((n.module_type for n in graph.ops() if n.layer == first), "")
        prefix = f"{graph.layer_container}.{first}" if graph.layer_container else str(first)
        module_type = next((n.module_type for n in graph.ops() if n.module == prefix), module_type)
        types.append(LayerType(h, len(indices), first, state.per_layer_parameters.get(first, 0),
                               ops_per_layer[first], module_type))
    return types


def model_summary(graph: OpGraph, global_batch: int | None = None) -> dict[str, Any]:
    """The ``model`` section of ``autopar plan --json``.

    Memory is for one replica of the whole model on one device; activations for one sample (sequence).
    """
    state: StateMemory = graph.annotations["state_memory"]
    acts: ActivationSummary = graph.annotations["activations"]
    per_sample_model = total_flops(graph, 1, "model")
    tokens = max(1, graph.seq_len)
    summary: dict[str, Any] = {
        "parameters": state.parameters,
        "trainable_parameters": state.trainable_parameters,
        "layers": len(graph.layers),
        "layer_container": graph.layer_container,
        "layer_types": [
            {"hash": t.structural_hash, "count": t.count, "first_layer": t.first_layer,
             "parameters_per_layer": t.parameters_per_layer, "ops_per_layer": t.ops_per_layer,
             "module_type": t.module_type}
            for t in layer_types(graph)
        ],
        "pipeline_stacks": [{"container": s.container, "blocks": s.blocks} for s in unit_chain(graph).stacks],
        "seq_len": graph.seq_len,
        "flops_per_token": per_sample_model / tokens,
        "hardware_flops_per_token": total_flops(graph, 1, "hardware") / tokens,
        "memory_bytes": {
            "weights": state.total.weights,
            "grads": state.total.grads,
            "optimizer": state.total.optimizer,
            "activations_per_sample": acts.total.at(1),
        },
        "activation_bytes_per_layer_per_sample": (
            acts.per_layer[graph.layers[0].index].at(1) if graph.layers and acts.per_layer else 0.0),
        "ops": sum(1 for _ in graph.ops()),
        "backward": graph.backward,
        "trace_time_s": graph.trace_time_s,
    }
    if global_batch is not None:
        summary["global_batch"] = global_batch
        summary["flops_per_iteration"] = total_flops(graph, global_batch, "model")
    return summary
