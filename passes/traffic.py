"""Bytes read and written per node (forward and backward) and kernel counts.

Annotation ``traffic`` = ``NodeTraffic``.  Floating-point tensors are costed at the precision policy's
activation width (16-bit); integer and boolean tensors at their own width.  View ops launch no kernel
and move no bytes.  Backward of an op reads the output gradient and the inputs it saved and writes the
gradients of the inputs that need one: ``out + in + in_needing_grad``.  Math attention adds the
``s x s`` score, softmax and dropout tensors its separate kernels write and read (see ``math_attention_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.context import PassContext

from autopar.ir import BatchLinear, Node, OpGraph, TensorInfo, iter_refs

ZERO = BatchLinear()


@dataclass(frozen=True, slots=True)
class NodeTraffic:
    fwd_bytes: BatchLinear
    bwd_bytes: BatchLinear
    fwd_kernels: int
    bwd_kernels: int


NO_TRAFFIC = NodeTraffic(ZERO, ZERO, 0, 0)


def tensor_bytes(t: TensorInfo | None, ctx: PassContext) -> BatchLinear:
    """Bytes of a tensor under the precision policy, per sample when it carries the batch."""
    if t is None:
        return ZERO
    width = ctx.precision.activation_bytes if t.is_floating else t.itemsize
    n = t.numel_at(1) * width
    return BatchLinear(n, 0.0) if t.batch_dim is not None else BatchLinear(0.0, n)


def attention_dropout(node: Node) -> float:
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return float(p or 0.0)


def math_attention_bytes(graph: OpGraph, node: Node, ctx: PassContext) -> tuple[BatchLinear, BatchLinear]:
    """Extra traffic of unfused attention on the ``heads x s_q x s_k`` scores, per sample.

    Forward: write scores, fused scale/mask/softmax reads and writes them, the AV product reads the
    probabilities (4 passes); dropout adds a read, a write and a 1-byte mask.  Backward: write dP, softmax
    backward reads P and dP and writes dS, dV reads P, dQ and dK read dS (7 passes); dropout adds 2 + mask.
    """
    q, k = graph.tensor(node.args[0]), graph.tensor(node.args[1])
    scores = q.numel_at(1) // q.shape_at(1)[-1] * k.shape_at(1)[-2]  # heads * s_q * s_k per sample
    e = ctx.precision.activation_bytes
    drop = attention_dropout(node) > 0
    fwd = scores * (6 * e + 1 if drop else 4 * e)
    bwd = scores * (9 * e + 1 if drop else 7 * e)
    return BatchLinear(fwd, 0.0), BatchLinear(bwd, 0.0)


def node_traffic(graph: OpGraph, node: Node, ctx: PassContext) -> NodeTraffic:
    if node.alias_of is not None:
        return NO_TRAFFIC
    inputs = [graph.tensor(r) for r in dict.fromkeys(iter_refs((node.args, node.kwargs)))]
    in_bytes = sum((tensor_bytes(t, ctx) for t in inputs), ZERO)
    grad_in = sum((tensor_bytes(t, ctx) for t in inputs if t is not None and t.requires_grad), ZERO)
    out_bytes = sum((tensor_bytes(t, ctx) for t in node.outputs), ZERO)
    fwd = in_bytes + out_bytes
    needs_backward = any(t is not None and t.requires_grad for t in node.outputs)
    bwd = out_bytes + in_bytes + grad_in if needs_backward else ZERO
    fwd_kernels, bwd_kernels = 1, (2 if needs_backward else 0)
    if node.op == "aten.scaled_dot_product_attention.default" and ctx.attention == "math":
        extra_fwd, extra_bwd = math_attention_bytes(graph, node, ctx)
        fwd, bwd = fwd + extra_fwd, bwd + extra_bwd
        fwd_kernels, bwd_kernels = 4, 6
    return NodeTraffic(fwd, bwd, fwd_kernels, bwd_kernels)


def annotate_traffic_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Set ``annotations["traffic"]`` on every op node."""
    for node in graph.ops():
        node.annotations["traffic"] = node_traffic(graph, node, ctx)
    return graph
