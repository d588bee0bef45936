"""Unfused attention's output is contiguous (batch, heads, seq, head_dim): putting the heads back together copies it.

The trace lays a fused kernel's output out as PyTorch's flash and cuDNN kernels do, like the query, so a model's
``transpose(1, 2).reshape(batch, seq, hidden)`` of it is a view where the query came in as a ``transpose(1, 2)`` of
(batch, seq, heads, head_dim) (``autopar.tracing._fused_attention_view``).  Unfused attention's last product
(``probs @ v``, Megatron-LM's ``torch.bmm``) writes a contiguous (batch, heads, seq, head_dim) tensor whatever the
query, which the same reshape (or Megatron-LM's ``permute(2, 0, 1, 3).contiguous()``) copies, and its gradient with
it in backward.  With ``math`` or ``eager`` attention this pass makes those reshapes copies.  It owns
``Node.alias_of`` of the ops that reshape a permuted attention output.
"""

from __future__ import annotations

from autopar.passes.context import PassContext

from autopar.ir import PERMUTING_VIEW_OPS, VIEW_IF_CONTIGUOUS_OPS, Node, OpGraph, Ref

ATTENTION = "aten.scaled_dot_product_attention.default"


def _reshapes_permuted_attention(graph: OpGraph, node: Node) -> bool:
    """Whether ``node`` reshapes an attention output through a view that moved its dimensions."""
    src = node.args[0] if node.args and isinstance(node.args[0], Ref) else None
    if node.op not in VIEW_IF_CONTIGUOUS_OPS or src is None:
        return False
    permuted = False
    view = graph[src.name]
    while view.alias_of is not None:
        permuted = permuted or view.op in PERMUTING_VIEW_OPS
        view = graph[view.alias_of]
    return permuted and view.op == ATTENTION


def attention_output_layout_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Under unfused attention, make each reshape of a permuted attention output a copy (the module docstring)."""
    if not ctx.flash:
        for node in graph.ops():
            if node.alias_of is not None and _reshapes_permuted_attention(graph, node):
                node.alias_of = None
    return graph
