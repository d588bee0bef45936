"""Parameter, gradient and optimizer-state bytes (the model state), per layer and in total.

Byte counts per parameter come from ``PrecisionPolicy`` and the framework's state layout: 16-bit weights,
the gradient buffer and fp32 master weights plus Adam moments (Megatron, DeepSpeed: 2 + 2 + 12), or fp32
parameters that are the master weights, fp32 gradients and the moments (FSDP2, the default ``torch``
profile: 4 + 4 + 8).  Frozen parameters (``requires_grad=False``) are 16-bit weights only.  Tied parameters
count once.  Annotation
``state_memory`` on the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.context import PassContext

from autopar.ir import OpGraph


@dataclass(frozen=True, slots=True)
class StateBytes:
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True, slots=True)
class StateMemory:
    parameters: int
    trainable_parameters: int  # the others are frozen: held in 16 bits with no gradient and no optimizer state
    per_layer_parameters: dict[int, int]
    outside_layer_parameters: int
    total: StateBytes


def annotate_state_memory_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Set ``annotations["state_memory"]`` on the graph."""
    per_layer: dict[int, int] = {}
    outside = 0
    for p in graph.params.values():
        if p.layer is None:
            outside += p.numel
        else:
            per_layer[p.layer] = per_layer.get(p.layer, 0) + p.numel
    n, trained = graph.num_parameters, graph.num_trainable_parameters
    frozen = (n - trained) * ctx.precision.weight_bytes  # 16-bit, no gradient, no optimizer state
    pol, grads = ctx.precision, ctx.framework.main_grad_bytes
    if ctx.framework.state_layout == "fsdp2":  # the fp32 parameters are the master weights
        total = StateBytes(trained * pol.master_weight_bytes + frozen, trained * grads,
                           trained * (pol.optimizer_bytes - pol.master_weight_bytes))
    else:
        total = StateBytes(trained * pol.weight_bytes + frozen, trained * grads, trained * pol.optimizer_bytes)
    graph.annotations["state_memory"] = StateMemory(
        parameters=n,
        trainable_parameters=trained,
        per_layer_parameters=dict(sorted(per_layer.items())),
        outside_layer_parameters=outside,
        total=total,
    )
    return graph
