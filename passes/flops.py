"""Forward and backward FLOPs per node.

Formulas come from ``torch.utils.flop_counter`` (``mm_flop``, ``bmm_flop``, ``sdpa_flop_count``,
``sdpa_backward_flop_count``, ``conv_flop_count``).  The traced graph is the pre-dispatch training IR,
whose composite ops (``aten.linear``, ``aten.matmul``, ``aten.einsum``, ``aten.scaled_dot_product_attention``)
have no registry entry, so this module maps them onto those formulas; ``aten._grouped_mm`` (dropless
experts), which the flop counter does not count, is a product of its tokens by their group's matrix.  Like
the flop counter, only matrix products, convolutions and attention count; element-wise work is costed by
bytes (traffic pass).

Annotation ``flops`` = ``NodeFlops``: values are per sample for batch-scaled nodes (see ``OpGraph.scale``).

- ``fwd``: forward FLOPs by the model-FLOPs convention; attention scores are counted in full.
- ``bwd``: backward FLOPs the kernels execute (flash attention recomputes the scores: 2.5x forward).
- ``bwd_model``: backward FLOPs by the model-FLOPs convention (2x forward for every product; gradients of
  operands that need none are skipped), used for MFU.
- ``fwd_hw`` / ``bwd``: what the kernels execute.  Flash attention with a causal mask skips the key blocks
  above the diagonal: of ``n x n`` blocks of ``attention_block`` rows it runs ``n (n + 1) / 2`` (Dao 2023,
  sec. 3.1), so its forward and backward execute that fraction of the FLOPs; unfused attention computes
  every score and masks afterwards.

The model-FLOPs convention (the one MFU uses, as in Korthikanti et al. 2022 and PaLM) counts every product
of forward and backward and full, unmasked attention, and no recomputation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from autopar.passes.context import PassContext
from torch.utils.flop_counter import conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

from autopar.ir import Node, OpGraph, Ref, TensorInfo


@dataclass(frozen=True, slots=True)
class NodeFlops:
    fwd: float
    bwd: float
    bwd_model: float
    fwd_hw: float | None = None
    """Forward FLOPs the kernel executes when they differ from ``fwd`` (causal flash attention)."""

    @property
    def fwd_executed(self) -> float:
        return self.fwd if self.fwd_hw is None else self.fwd_hw


ZERO = NodeFlops(0.0, 0.0, 0.0)
DEFAULT_ATTENTION_BLOCK = 128  # FlashAttention-2's block size, when no cluster is given


def causal_block_fraction(s_q: int, s_k: int, block: int) -> float:
    """Share of the ``s_q x s_k`` score blocks a causal flash kernel computes (the rest lie above the
    diagonal, aligned to the last query as ``is_causal`` does for ``s_q <= s_k``)."""
    nq, nk = math.ceil(s_q / block), math.ceil(s_k / block)
    offset = s_k - s_q
    executed = sum(min(nk, math.ceil(((i + 1) * block + offset) / block)) for i in range(nq))
    return executed / (nq * nk)


def is_causal(node: Node) -> bool:
    flag = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    return bool(flag)


def attention_mask(node: Node) -> object:
    """An SDPA call's ``attn_mask`` argument (a ``Ref`` where it takes a mask tensor, else ``None``)."""
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def tensor_arg(graph: OpGraph, node: Node, i: int) -> TensorInfo | None:
    """The ``i``-th positional argument of ``node`` when it is a tensor, else ``None``."""
    if i >= len(node.args) or not isinstance(node.args[i], Ref):
        return None
    return graph.tensor(node.args[i])


def _needs_grad(t: TensorInfo | None) -> int:
    return int(t is not None and t.requires_grad)


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """2 * batch * m * k * n for ``torch.matmul`` semantics (broadcast batch dims, 1-D operands)."""
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    m, k = a[-2], a[-1]
    n = b[-1]
    batch_a, batch_b = a[:-2], b[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a = (1,) * (width - len(batch_a)) + batch_a
    batch_b = (1,) * (width - len(batch_b)) + batch_b
    batch = math.prod(max(x, y) for x, y in zip(batch_a, batch_b))
    return 2.0 * batch * m * k * n


def _product_flops(fwd: float, a: TensorInfo | None, b: TensorInfo | None) -> NodeFlops:
    """Backward of ``C = A @ B``: ``dA = dC B^T`` and ``dB = A^T dC``, each as costly as the forward."""
    bwd = fwd * (_needs_grad(a) + _needs_grad(b))
    return NodeFlops(fwd, bwd, bwd)


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> float:
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for spec, shape in zip(lhs, shapes):
        spec = re.sub(r"\.\.\.", "", spec)
        for letter, size in zip(spec[::-1], shape[::-1]):
            sizes[letter] = size
    return 2.0 * math.prod(sizes.values()) if len(shapes) == 2 else 0.0


def node_flops(graph: OpGraph, node: Node, ctx: PassContext) -> NodeFlops:
    """FLOPs of one node at batch 1 (per sample when the node is batch-scaled)."""
    op = node.op
    out = node.out
    if op == "aten.linear.default":
        x, w = tensor_arg(graph, node, 0), tensor_arg(graph, node, 1)
        x_shape = x.shape_at(1)
        fwd = 2.0 * math.prod(x_shape[:-1]) * x_shape[-1] * w.shape[0]
        return _product_flops(fwd, x, w)
    if op in ("aten.matmul.default", "aten.mm.default", "aten.bmm.default"):
        a, b = tensor_arg(graph, node, 0), tensor_arg(graph, node, 1)
        return _product_flops(_matmul_flops(a.shape_at(1), b.shape_at(1)), a, b)
    if op in ("aten.addmm.default", "aten.baddbmm.default"):
        a, b = tensor_arg(graph, node, 1), tensor_arg(graph, node, 2)
        return _product_flops(_matmul_flops(a.shape_at(1), b.shape_at(1)), a, b)
    if op == "aten._grouped_mm.default":  # dropless experts: every token by the matrix of its group (expert)
        a, b = tensor_arg(graph, node, 0), tensor_arg(graph, node, 1)
        sa, sb = a.shape_at(1), b.shape_at(1)
        fwd = 2.0 * sa[0] * sa[1] * sb[-1] if len(sa) == 2 and len(sb) == 3 else _matmul_flops(sa, sb)
        return _product_flops(fwd, a, b)
    if op == "aten.einsum.default":
        operands = [graph.tensor(r) for r in node.args[1] if isinstance(r, Ref)]
        fwd = _einsum_flops(node.args[0], [t.shape_at(1) for t in operands])
        bwd = fwd * sum(_needs_grad(t) for t in operands) if len(operands) == 2 else 0.0
        return NodeFlops(fwd, bwd, bwd)
    if op == "aten.scaled_dot_product_attention.default":
        q, k, v = (tensor_arg(graph, node, i) for i in range(3))
        shapes = [t.shape_at(1) for t in (q, k, v)]
        fwd = float(sdpa_flop_count(*shapes))
        model_bwd = 2.0 * fwd
        if not ctx.flash:  # unfused attention computes every score and saved the probabilities
            return NodeFlops(fwd, model_bwd, model_bwd)
        # Flash attention recomputes the scores in backward and skips the blocks a causal mask hides.
        hw_bwd = float(sdpa_backward_flop_count(out.shape_at(1), *shapes))
        frac = 1.0
        if is_causal(node):
            block = ctx.cluster.attention_block if ctx.cluster is not None else DEFAULT_ATTENTION_BLOCK
            frac = causal_block_fraction(shapes[0][-2], shapes[1][-2], block)
        return NodeFlops(fwd, hw_bwd * frac, model_bwd, fwd * frac)
    if op in ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default"):
        x, w = tensor_arg(graph, node, 0), tensor_arg(graph, node, 1)
        fwd = float(conv_flop_count(list(x.shape_at(1)), list(w.shape), list(out.shape_at(1)), transposed=False))
        return _product_flops(fwd, x, w)
    return ZERO


def annotate_flops_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Set ``annotations["flops"]`` on every op node."""
    for node in graph.ops():
        node.annotations["flops"] = node_flops(graph, node, ctx)
    return graph


def total_flops(graph: OpGraph, batch: int, kind: str = "model") -> float:
    """FLOPs of one forward+backward pass at ``batch``: ``model`` (MFU convention) or ``hardware``."""
    total = 0.0
    for node in graph.ops():
        f: NodeFlops = node.annotations["flops"]
        if kind == "model":
            total += (f.fwd + f.bwd_model) * graph.scale(node, batch)
        else:
            total += (f.fwd_executed + f.bwd) * graph.scale(node, batch)
    return total
