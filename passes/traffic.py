"""Bytes read and written per node (forward and backward) and kernel counts.

Annotation ``traffic`` = ``NodeTraffic``.  Floating-point tensors are costed at the precision policy's
activation width (16-bit); integer and boolean tensors at their own width.  View ops, and ops that return
no tensor (``_assert_tensor_metadata``, a check on metadata), launch no kernel and move no bytes.  Backward
of an op reads the output gradient and the inputs it saved and writes the gradients of the inputs that need
one: ``out + in + in_needing_grad``.  Math attention adds the
``s x s`` score, softmax and dropout tensors its separate kernels write and read (see ``math_attention_bytes``).
Dropout with ``p = 0`` is free; the loss moves what its fp32 passes move (``loss_traffic``).  Inside a
compiled block, a fused op moves its part of its group's traffic (``fused_traffic``, ``autopar.passes.fusion``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.passes.context import PassContext

from autopar.ir import BatchLinear, Node, OpGraph, TensorInfo, iter_refs, tensor_refs

if TYPE_CHECKING:
    from autopar.passes.fusion import FusedIO

ZERO = BatchLinear()


@dataclass(frozen=True, slots=True)
class NodeTraffic:
    fwd_bytes: BatchLinear
    bwd_bytes: BatchLinear
    fwd_kernels: int
    bwd_kernels: int
    reads: tuple[int, ...] | None = None
    """Of a fused op (``autopar.passes.fusion``): the tensor arguments (``tensor_refs`` indices) its group's
    kernels read from memory; ``None``: all of them."""
    writes: tuple[int, ...] | None = None
    """... and the outputs they write; ``None``: all of them."""
    dispatched: bool = True
    """Whether the host dispatches the op itself (eager: ``Framework.host_op_s``); compiled code does not."""


NO_TRAFFIC = NodeTraffic(ZERO, ZERO, 0, 0)


def tensor_bytes(t: TensorInfo | None, ctx: PassContext, graph: OpGraph | None = None) -> BatchLinear:
    """Bytes of a tensor under the precision policy (``OpGraph.width``: explicit fp32 upcasts of a
    16-bit model keep their 4 bytes), per sample when it carries the batch."""
    if t is None:
        return ZERO
    if graph is not None:
        width = graph.width(t, ctx.precision.activation_bytes)
    else:
        width = ctx.precision.activation_bytes if t.is_floating else t.itemsize
    n = t.numel_at(1) * width
    return BatchLinear(n, 0.0) if t.batch_dim is not None else BatchLinear(0.0, n)


def attention_dropout(node: Node) -> float:
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return float(p or 0.0)


def score_elements(graph: OpGraph, node: Node) -> int:
    """``heads x s_q x s_k`` of an attention node, per sample."""
    q, k = graph.tensor(node.args[0]), graph.tensor(node.args[1])
    return q.numel_at(1) // q.shape_at(1)[-1] * k.shape_at(1)[-2]


def softmax_passes_bytes(graph: OpGraph, node: Node, ctx: PassContext) -> tuple[BatchLinear, BatchLinear]:
    """Traffic of unfused attention's element-wise kernels on the ``heads x s_q x s_k`` scores, per sample.

    ``math`` (Megatron-LM's fused scale-mask-softmax): forward reads the scores and writes the
    probabilities; backward reads P and dP and writes dS.  ``eager`` (plain PyTorch ops): the causal mask is
    a kernel of its own (reads the scores and a 1-byte mask, writes), then the softmax; backward adds the
    mask's backward.  Dropout on the probabilities adds a read, a write and a 1-byte mask each way.
    """
    scores = score_elements(graph, node)
    e = ctx.precision.activation_bytes
    drop = 2 * e + 1 if attention_dropout(node) > 0 else 0
    fwd, bwd = 2 * e + drop, 3 * e + drop
    if ctx.attention == "eager":
        fwd, bwd = fwd + 2 * e + 1, bwd + 2 * e + 1
    return BatchLinear(scores * fwd, 0.0), BatchLinear(scores * bwd, 0.0)


def softmax_passes_kernels(node: Node, ctx: PassContext) -> tuple[int, int]:
    """Element-wise kernels of unfused attention: (forward, backward)."""
    drop = 1 if attention_dropout(node) > 0 else 0
    extra = 1 if ctx.attention == "eager" else 0
    return 1 + drop + extra, 1 + drop + extra


def math_attention_bytes(graph: OpGraph, node: Node, ctx: PassContext) -> tuple[BatchLinear, BatchLinear]:
    """All extra traffic of unfused attention on the scores, per sample: the element-wise passes plus the
    products writing the scores and reading the probabilities (forward 2 passes; backward: write dP, dV
    reads P, dQ and dK read dS: 4)."""
    e = ctx.precision.activation_bytes
    scores = score_elements(graph, node)
    fwd, bwd = softmax_passes_bytes(graph, node, ctx)
    return fwd + BatchLinear(2 * e * scores, 0.0), bwd + BatchLinear(4 * e * scores, 0.0)


DROPOUT_OPS = frozenset({"aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default"})
LOSS_OPS = frozenset({"aten.cross_entropy_loss.default"})
FP32_BYTES = 4


def dropout_is_identity(node: Node) -> bool:
    """``dropout(x, p=0)`` (or in eval) returns its input: no kernel runs."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return not p or not train


def loss_traffic(graph: OpGraph, node: Node, ctx: PassContext) -> NodeTraffic:
    """Bytes per logit of the cross-entropy over ``[tokens, vocab]`` 16-bit logits, by ``Framework.cross_entropy``.

    ``autocast`` (PyTorch's cross-entropy under autocast): the logits are upcast to fp32 (read 2, write 4),
    ``log_softmax`` reads them twice (max, then sum of exponentials) and writes the log-probabilities (8 + 4);
    backward writes the fp32 gradient of the log-probabilities (4), ``log_softmax``'s backward reads it and the
    output and writes its result (8 + 4), which is cast back to 16 bits (4 + 2).

    ``vocab_parallel`` (Megatron-LM's ``_VocabParallelCrossEntropy``): after the upcast (2 + 4), a max reads the
    copy (4), then in place a subtraction of it (4 + 4), an exponential (4 + 4), a sum (4) and a division by the
    sum (4 + 4); backward subtracts one at each target and multiplies by the incoming gradient in place (4 + 4),
    then the cast back (4 + 2).  Its per-token steps (the target masks, the gather of the target logits, the
    log) are small kernels of their own.  ``vocab_parallel_fused`` (Megatron-Core's ``--cross-entropy-loss-fusion``,
    ``megatron/core/fusions/fused_cross_entropy.py``: each step a function under ``jit_fuser``, ``torch.compile``
    since torch 2.2): the upcast writes the copy as the max reads the logits (2 + 4), the subtraction, exponential
    and sum are one pass (4 + 4), the division another (4 + 4); backward multiplies and casts back in one (4 + 2).

    Logits the model already upcast (``logits.float()``, priced as its own op) skip both casts.  ``fused``
    (FlashAttention's ``CrossEntropyLoss``): one online-softmax pass reads the logits; backward rewrites them in
    place (read and write).

    The framework's training metrics (``Framework.metric_cross_entropies``) add the forward of an ``autocast``
    cross-entropy each, after the backward.
    """
    logits = graph.tensor(node.args[0])
    w = graph.width(logits, ctx.precision.activation_bytes)
    n = logits.numel_at(1)
    scale = (lambda b: BatchLinear(b, 0.0)) if logits.batch_dim is not None else (lambda b: BatchLinear(0.0, b))
    upcast, cast_back = (w + FP32_BYTES, FP32_BYTES + w) if w < FP32_BYTES else (0, 0)
    casts = 1 if upcast else 0  # the casts are kernels of their own
    metrics = ctx.framework.metric_cross_entropies
    loss = _loss_traffic(ctx.framework.cross_entropy, n, w, upcast, cast_back, casts)
    metric = _loss_traffic("autocast", n, w, upcast, cast_back, casts)
    return NodeTraffic(scale(loss.fwd_bytes + metrics * metric.fwd_bytes), scale(loss.bwd_bytes),
                       loss.fwd_kernels + metrics * metric.fwd_kernels, loss.bwd_kernels)


@dataclass(frozen=True, slots=True)
class _LossPasses:
    """A cross-entropy's bytes and kernels per row of logits (``loss_traffic``)."""

    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int


def _loss_traffic(kind: str, n: float, w: float, upcast: float, cast_back: float, casts: int) -> _LossPasses:
    """``loss_traffic``'s passes of a ``kind`` cross-entropy over rows of ``n`` logits ``w`` bytes wide."""
    if kind == "fused":
        return _LossPasses(n * w, n * 2 * w, 1, 1)
    if kind == "vocab_parallel":
        fwd = n * (upcast + FP32_BYTES + 2 * FP32_BYTES + 2 * FP32_BYTES + FP32_BYTES + 2 * FP32_BYTES)
        bwd = n * (2 * FP32_BYTES + cast_back)
        # forward: max, subtract, exponential, sum, divide and 12 per-token kernels (the masks, the gather, the
        # log); backward: the multiply and 6 per-token ones (megatron/core/tensor_parallel/cross_entropy.py)
        return _LossPasses(fwd, bwd, 17 + casts, 7 + casts)
    if kind == "vocab_parallel_fused":
        max_pass = upcast or FP32_BYTES  # the max rides on the upcast's pass, else reads the fp32 logits once
        fwd = n * (max_pass + 2 * FP32_BYTES + 2 * FP32_BYTES)
        bwd = n * (FP32_BYTES + w if upcast else 2 * FP32_BYTES)
        # forward: the max (with the upcast), the exponential pass, the division and 5 per-token kernels;
        # backward: the multiply (with the cast back) and the scatter at the targets
        return _LossPasses(fwd, bwd, 8, 2)
    fwd = n * (upcast + 2 * FP32_BYTES + FP32_BYTES)
    bwd = n * (FP32_BYTES + 2 * FP32_BYTES + FP32_BYTES + cast_back)
    return _LossPasses(fwd, bwd, 2 + casts, 2 + casts)


def fused_traffic(graph: OpGraph, node: Node, fused: FusedIO, ctx: PassContext) -> NodeTraffic:
    """An op's part of its fused group's traffic (``autopar.passes.fusion``): the tensors it brings in from
    outside the group and the outputs it hands out, forward; their gradients and the saved inputs, backward."""
    refs = tensor_refs(node)
    ins = [graph.tensor(refs[i]) for i in fused.reads]
    outs = [node.outputs[j] for j in fused.writes if j < len(node.outputs)]
    in_bytes = sum((tensor_bytes(t, ctx, graph) for t in ins), ZERO)
    grad_in = sum((tensor_bytes(t, ctx, graph) for t in ins if t is not None and t.requires_grad), ZERO)
    out_bytes = sum((tensor_bytes(t, ctx, graph) for t in outs), ZERO)
    needs_backward = any(t is not None and t.requires_grad for t in node.outputs)
    bwd = out_bytes + in_bytes + grad_in if needs_backward else ZERO
    return NodeTraffic(in_bytes + out_bytes, bwd, fused.fwd_kernels, fused.bwd_kernels, fused.reads, fused.writes,
                       dispatched=False)


def node_traffic(graph: OpGraph, node: Node, ctx: PassContext) -> NodeTraffic:
    traffic = _eager_traffic(graph, node, ctx)
    if ctx.compile and node.layer is not None and traffic.dispatched:
        return dataclasses.replace(traffic, dispatched=False)  # issued by the compiled block's wrapper
    return traffic


def _eager_traffic(graph: OpGraph, node: Node, ctx: PassContext) -> NodeTraffic:
    if node.alias_of is not None:
        return NO_TRAFFIC
    if node.op in DROPOUT_OPS and dropout_is_identity(node):
        return NO_TRAFFIC
    if not any(t is not None for t in node.outputs):  # a check on metadata (_assert_tensor_metadata): no kernel
        return NO_TRAFFIC
    if node.op in LOSS_OPS:
        return loss_traffic(graph, node, ctx)
    if (fused := node.annotations.get("fusion")) is not None:
        return fused_traffic(graph, node, fused, ctx)
    inputs = [graph.tensor(r) for r in dict.fromkeys(iter_refs((node.args, node.kwargs)))]
    in_bytes = sum((tensor_bytes(t, ctx, graph) for t in inputs), ZERO)
    grad_in = sum((tensor_bytes(t, ctx, graph) for t in inputs if t is not None and t.requires_grad), ZERO)
    out_bytes = sum((tensor_bytes(t, ctx, graph) for t in node.outputs), ZERO)
    fwd = in_bytes + out_bytes
    needs_backward = any(t is not None and t.requires_grad for t in node.outputs)
    bwd = out_bytes + in_bytes + grad_in if needs_backward else ZERO
    fwd_kernels, bwd_kernels = 1, (2 if needs_backward else 0)
    if node.op == "aten.scaled_dot_product_attention.default" and not ctx.flash:
        extra_fwd, extra_bwd = math_attention_bytes(graph, node, ctx)
        fwd, bwd = fwd + extra_fwd, bwd + extra_bwd
        k_fwd, k_bwd = softmax_passes_kernels(node, ctx)
        fwd_kernels, bwd_kernels = 2 + k_fwd, 4 + k_bwd  # two products forward, four backward
    return NodeTraffic(fwd, bwd, fwd_kernels, bwd_kernels)


def annotate_traffic_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Set ``annotations["traffic"]`` on every op node."""
    for node in graph.ops():
        node.annotations["traffic"] = node_traffic(graph, node, ctx)
    return graph
