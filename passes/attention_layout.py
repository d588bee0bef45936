"""Where the attention kernel leaves its output, and so whether putting the heads back together copies it.

PyTorch's fused kernels return the output in the query's layout: the flash and cuDNN kernels allocate it like the
query (``torch.empty_like(query)``, ``alloc_with_matching_layout``; their meta functions say the same) and the
memory-efficient one as (batch, seq, heads, head_dim), transposed.  A model that hands attention a
``transpose(1, 2)`` of its (batch, seq, heads, head_dim) projections gets an output whose
``transpose(1, 2).reshape(batch, seq, hidden)`` is a view.  Unfused attention's last product (``probs @ v``,
Megatron-LM's ``torch.bmm``) writes a contiguous (batch, heads, seq, head_dim) tensor, which the same reshape (or
Megatron-LM's ``permute(2, 0, 1, 3).contiguous()``) copies, and its gradient with it in backward.

The trace cannot tell: its fake attention runs whichever CPU kernel supports the call (the math one under
dropout, say), whatever kernel the context names.  This pass decides each reshape of a permuted attention output
by the context's kernel and the query's layout, and owns ``Node.alias_of`` of those reshapes.
"""

from __future__ import annotations

from autopar.passes.context import PassContext

from autopar.ir import Node, OpGraph, Ref

ATTENTION = "aten.scaled_dot_product_attention.default"
#: Views that move dimensions: after one, a contiguous tensor is no longer contiguous.
PERMUTING_VIEWS = frozenset({"aten.transpose.int", "aten.permute.default", "aten.movedim.int",
                             "aten.swapaxes.default"})
#: Ops that are a view of a contiguous input and a copy of any other (``autopar.tracing.VIEW_IF_CONTIGUOUS_OPS``).
COPY_IF_STRIDED = frozenset({"aten.reshape.default", "aten.flatten.using_ints", "aten.contiguous.default"})


def _viewed_through_permutation(graph: OpGraph, name: str) -> tuple[Node, bool]:
    """The node whose storage ``name`` views, and whether a view on the way moved its dimensions."""
    permuted = False
    node = graph[name]
    while node.alias_of is not None:
        permuted = permuted or node.op in PERMUTING_VIEWS
        node = graph[node.alias_of]
    return node, permuted


def _heads_joined(graph: OpGraph, node: Node) -> Node | None:
    """The attention whose permuted output ``node`` reshapes, if it does."""
    src = node.args[0] if node.args and isinstance(node.args[0], Ref) else None
    if node.op not in COPY_IF_STRIDED or src is None:
        return None
    root, permuted = _viewed_through_permutation(graph, src.name)
    return root if permuted and root.op == ATTENTION else None


def attention_output_layout_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Make each reshape of a permuted attention output a view or a copy, as the context's kernel lays the output
    out (see the module docstring)."""
    for node in graph.ops():
        attention = _heads_joined(graph, node)
        if attention is None:
            continue
        query = attention.args[0] if attention.args and isinstance(attention.args[0], Ref) else None
        in_query_layout = ctx.flash and query is not None and _viewed_through_permutation(graph, query.name)[1]
        node.alias_of = node.args[0].name if in_query_layout else None
    return graph
