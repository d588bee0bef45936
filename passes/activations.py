"""Activation memory saved for backward, per node, per layer and for the whole graph.

Each op saves what its derivative needs (the rules below follow the autograd formulas in
``tools/autograd/derivatives.yaml``).  A saved view keeps its whole base storage alive, so saved tensors
are keyed by their storage root (through ``Node.alias_of``) and counted once per layer and once per graph.
Parameters and buffers are already resident and never count as activations.

Attention is the one op whose saved set depends on the kernel (``PassContext.attention``):

- ``flash``/``flash1`` (default): q, k, v, the output and the fp32 log-sum-exp; no ``s x s`` tensor.
- ``math``/``eager``: q, k, v and the softmax probabilities (``2 a s^2 b`` bytes); with dropout also the
  1-byte mask and the dropped probabilities (Korthikanti et al. 2022: ``5 a s^2 b`` per layer).

Annotations: ``saved`` on nodes (tuple of ``SavedTensor``), ``activations`` on the graph
(``ActivationSummary``: per-layer bytes, bytes outside the layers, and the whole-graph total).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from autopar.passes.context import PassContext
from autopar.passes.traffic import (
    DROPOUT_OPS,
    FP32_BYTES,
    LOSS_OPS,
    attention_dropout,
    dropout_is_identity,
    tensor_bytes,
)

from autopar.fused_kernels import SELECTIVE_SCAN
from autopar.ir import BatchLinear, Node, OpGraph, Ref, TensorInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SavedTensor:
    key: str  # storage root ("node:output") or a synthetic name for kernel-internal tensors
    nbytes: BatchLinear


@dataclass(frozen=True, slots=True)
class ActivationSummary:
    per_layer: dict[int, BatchLinear]
    outside_layers: BatchLinear
    total: BatchLinear
    unknown_ops: tuple[str, ...] = field(default=())


# Ops whose backward needs their input (or, same size, their output).
_SAVES_ONE = frozenset({
    "aten.gelu.default", "aten.silu.default", "aten.relu.default", "aten.sigmoid.default", "aten.tanh.default",
    "aten.exp.default", "aten.log.default", "aten.sin.default", "aten.cos.default", "aten.rsqrt.default",
    "aten.sqrt.default", "aten.pow.Tensor_Scalar", "aten.leaky_relu.default", "aten.elu.default",
    "aten.softplus.default", "aten.mish.default", "aten.hardswish.default", "aten.softmax.int",
    "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default", "aten.abs.default",
    "aten.reciprocal.default", "aten.erf.default", "aten.square.default", "aten.relu_.default",
    "aten.silu_.default", "aten.gelu_.default", "aten.amax.default", "aten.max.dim", "aten.norm.ScalarOpt_dim",
    "aten.linalg_vector_norm.default", "aten.clamp.default", "aten.hardtanh.default", "aten.clamp_min.default",
    "aten.clamp_max.default",
})
# Ops whose backward needs nothing but shapes (or is not differentiable in the activations).
_SAVES_NOTHING = frozenset({
    "aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.add.Scalar", "aten.sub.Scalar",
    "aten.add_.Tensor", "aten.sub_.Tensor",
    "aten.cat.default", "aten.stack.default", "aten.clone.default", "aten.contiguous.default",
    "aten.reshape.default", "aten.flatten.using_ints", "aten.sum.dim_IntList", "aten.sum.default",
    "aten.mean.dim", "aten.mean.default", "aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout",
    "aten.type_as.default", "aten.repeat.default", "aten.repeat_interleave.self_int", "aten.arange.default",
    "aten.arange.start", "aten.zeros.default", "aten.ones.default", "aten.full.default", "aten.zeros_like.default",
    "aten.ones_like.default", "aten.empty.memory_format", "aten.cumsum.default", "aten.one_hot.default",
    "aten.eq.Scalar", "aten.eq.Tensor", "aten.ne.Scalar", "aten.lt.Scalar", "aten.gt.Scalar", "aten.ge.Scalar",
    "aten.le.Scalar", "aten.argmax.default", "aten.triu.default", "aten.tril.default", "aten.pad.default",
    "aten.constant_pad_nd.default", "aten.scalar_tensor.default", "aten.lift_fresh_copy.default",
    "aten.new_zeros.default", "aten.new_ones.default", "aten.fill.Scalar", "aten.copy.default",
    "aten.mul.Scalar", "aten.div.Scalar", "aten.floor_divide.default", "aten.remainder.Scalar",
    "aten.bitwise_not.default", "aten.logical_not.default", "aten.sort.default", "aten.unsqueeze.default",
    "aten._assert_tensor_metadata.default", "aten.alias.default", "aten.detach.default", "aten.sym_size.int",
    "aten.full_like.default", "aten.rand.default", "aten.randn.default", "aten.new_empty.default",
    "aten.histc.default", "aten.rsub.Scalar", "aten.expand_as.default", "aten.expand.default",
})
#: Convolutions save their input for the weight's gradient, as a Linear does (the weight is resident).
CONVOLUTIONS = ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default")
_INDEX_SAVING = frozenset({
    "aten.embedding.default", "aten.index_select.default", "aten.gather.default", "aten.index.Tensor",
    "aten.scatter.src", "aten.scatter_add.default", "aten.index_add.default", "aten.topk.default",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.where.self", "aten.where.ScalarOther",
    "aten.where.ScalarSelf", "aten.where.Scalar",  # the condition alone: torch's backward of where
})
_NORMS = {
    "aten.layer_norm.default": 2,  # mean and rstd per row
    "aten.rms_norm.default": 1,  # rstd per row
    "aten.group_norm.default": 2,
    "aten.native_layer_norm.default": 2,
    "aten._fused_rms_norm.default": 1,
}


def _arg(graph: OpGraph, node: Node, i: int) -> tuple[Ref | None, TensorInfo | None]:
    if i < len(node.args) and isinstance(node.args[i], Ref):
        return node.args[i], graph.tensor(node.args[i])
    return None, None


def storage_key(graph: OpGraph, ref: Ref) -> str:
    """``"node:output"`` of the storage ``ref`` views (aliases followed to their base): the key a saved
    tensor has in ``annotations["saved"]``."""
    name, index = ref.name, ref.index
    while (src := graph[name]).alias_of is not None:
        name, index = src.alias_of, 0
    return f"{name}:{index}"


class _Saver:
    """Collects the saved tensors of one node, keyed by storage root."""

    def __init__(self, graph: OpGraph, node: Node, ctx: PassContext) -> None:
        self.graph, self.node, self.ctx = graph, node, ctx
        self.saved: dict[str, BatchLinear] = {}

    def ref(self, ref: Ref | None) -> None:
        if ref is None:
            return
        key = storage_key(self.graph, ref)
        name, index = key.rsplit(":", 1)
        root = self.graph[name]
        if root.kind in ("param", "buffer", "constant"):
            return
        t = root.outputs[int(index)] if int(index) < len(root.outputs) else None
        self.saved.setdefault(key, tensor_bytes(t, self.ctx, self.graph))

    def output(self, index: int = 0) -> None:
        self.ref(Ref(self.node.name, index))

    def synthetic(self, suffix: str, nbytes: BatchLinear) -> None:
        self.saved[f"{self.node.name}:{suffix}"] = nbytes


def _rows(t: TensorInfo, normalized_dims: int) -> BatchLinear:
    shape = t.shape_at(1)
    rows = 1
    for d in shape[: len(shape) - normalized_dims]:
        rows *= d
    return BatchLinear(rows, 0.0) if t.batch_dim is not None else BatchLinear(0.0, rows)


def saved_tensors(graph: OpGraph, node: Node, ctx: PassContext, unknown: set[str]) -> tuple[SavedTensor, ...]:
    """What ``node`` saves for its backward."""
    if node.alias_of is not None or not any(t is not None and t.requires_grad for t in node.outputs):
        return ()
    s = _Saver(graph, node, ctx)
    op = node.op
    if op in ("aten.linear.default", *CONVOLUTIONS):
        (x_ref, _), (_, w) = _arg(graph, node, 0), _arg(graph, node, 1)
        if w is not None and w.requires_grad:
            s.ref(x_ref)  # dW = dY^T X (a convolution's: the input correlated with dY)
    elif op == SELECTIVE_SCAN:  # the fused kernel saves its inputs and recomputes the states in backward
        for a in node.args:
            s.ref(a if isinstance(a, Ref) else None)
    elif op in ("aten.matmul.default", "aten.mm.default", "aten.bmm.default", "aten.mul.Tensor",
                "aten.div.Tensor", "aten.div_.Tensor", "aten.addmm.default", "aten.baddbmm.default",
                "aten._grouped_mm.default"):
        first = 1 if op in ("aten.addmm.default", "aten.baddbmm.default") else 0
        (a_ref, a), (b_ref, b) = _arg(graph, node, first), _arg(graph, node, first + 1)
        if b is not None and b.requires_grad:
            s.ref(a_ref)
        if (a is not None and a.requires_grad) or op in ("aten.div.Tensor", "aten.div_.Tensor"):
            s.ref(b_ref)
    elif op == "aten.einsum.default":
        for r in node.args[1]:
            s.ref(r if isinstance(r, Ref) else None)
    elif op == "aten.scaled_dot_product_attention.default":
        _save_attention(graph, node, ctx, s)
    elif op in _NORMS:
        x_ref, x = _arg(graph, node, 0)
        s.ref(x_ref)
        normalized = len(node.args[1]) if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else 1
        s.synthetic("stats", _rows(x, normalized) * (FP32_BYTES * _NORMS[op]))
    elif op in DROPOUT_OPS:
        if not dropout_is_identity(node):
            out = node.out
            per = out.numel_at(1)  # one byte (bool mask) per element
            s.synthetic("mask", BatchLinear(per, 0.0) if out.batch_dim is not None else BatchLinear(0.0, per))
    elif op in LOSS_OPS:
        # the fp32 log-probabilities (autocast runs cross-entropy in fp32) or softmax (Megatron's vocab-parallel
        # loss) plus the targets; a fused loss keeps the 16-bit logits (and one fp32 log-sum-exp per row) to
        # rewrite them in backward.
        (x_ref, x), (t_ref, _) = _arg(graph, node, 0), _arg(graph, node, 1)
        if ctx.framework.cross_entropy == "fused":
            s.ref(x_ref)  # the logits themselves
        else:
            per = x.numel_at(1) * FP32_BYTES
            s.synthetic("log_probs", BatchLinear(per, 0.0) if x.batch_dim is not None else BatchLinear(0.0, per))
        s.ref(t_ref)
    elif op in _SAVES_ONE:
        s.ref(_arg(graph, node, 0)[0])
    elif op in _INDEX_SAVING:
        for a in node.args:
            t = graph.tensor(a) if isinstance(a, Ref) else None
            if t is not None and not t.is_floating:
                s.ref(a)
    elif op in _SAVES_NOTHING:
        pass
    else:
        unknown.add(op)
        for a in node.args:
            t = graph.tensor(a) if isinstance(a, Ref) else None
            if t is not None and t.is_floating:
                s.ref(a)
    return tuple(SavedTensor(k, v) for k, v in s.saved.items())


def _save_attention(graph: OpGraph, node: Node, ctx: PassContext, s: _Saver) -> None:
    for i in range(3):
        s.ref(_arg(graph, node, i)[0])
    q = graph.tensor(node.args[0])
    k = graph.tensor(node.args[1])
    qs, ks = q.shape_at(1), k.shape_at(1)
    rows = q.numel_at(1) // qs[-1]  # heads * s_q per sample
    scale = (lambda n: BatchLinear(n, 0.0)) if q.batch_dim is not None else (lambda n: BatchLinear(0.0, n))
    if ctx.flash:
        s.output(0)
        s.synthetic("logsumexp", scale(rows * FP32_BYTES))
        return
    scores = rows * ks[-2]
    e = ctx.precision.activation_bytes
    s.synthetic("probs", scale(scores * e))
    if attention_dropout(node) > 0:
        s.synthetic("dropout_mask", scale(scores))
        s.synthetic("dropped_probs", scale(scores * e))


def annotate_activations_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Set ``annotations["saved"]`` on op nodes and ``annotations["activations"]`` on the graph."""
    unknown: set[str] = set()
    per_layer: dict[int, dict[str, BatchLinear]] = {}
    outside: dict[str, BatchLinear] = {}
    everything: dict[str, BatchLinear] = {}
    for node in graph.ops():
        saved = saved_tensors(graph, node, ctx, unknown)
        node.annotations["saved"] = saved
        bucket = per_layer.setdefault(node.layer, {}) if node.layer is not None else outside
        for t in saved:
            bucket.setdefault(t.key, t.nbytes)
            everything.setdefault(t.key, t.nbytes)
    if unknown:
        log.warning("no saved-tensor rule for %s; assumed they save all floating inputs", ", ".join(sorted(unknown)))

    def total(d: dict[str, BatchLinear]) -> BatchLinear:
        return sum(d.values(), BatchLinear())

    graph.annotations["activations"] = ActivationSummary(
        per_layer={i: total(d) for i, d in sorted(per_layer.items())},
        outside_layers=total(outside),
        total=total(everything),
        unknown_ops=tuple(sorted(unknown)),
    )
    return graph
