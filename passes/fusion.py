"""What Inductor fuses when the blocks of the stack are compiled (``PassContext.compile``).

torchtitan's ``apply_compile`` (and autopar's runtime, ``autopar.runtime.parallelize.apply_compile``) runs
``torch.compile`` on each block.  AOTAutograd traces the block's forward and backward into two graphs and
Inductor lowers each: matrix products stay library calls (cuBLAS), attention stays its flash kernel, and the
element-wise and reduction work between them is generated as fused Triton kernels.  A chain of such ops
(a norm, rotary embedding, SwiGLU, a residual add) reads its inputs from memory once and writes only what
leaves it; its intermediates live in registers (Ansel et al., "PyTorch 2", ASPLOS 2024, sec. 5: Inductor's
scheduler fuses pointwise and reduction nodes that share iteration space, which is why "the most
significant speedups come from fusion"; torchtitan's Llama 3.1 8B on 8 H100s measures 5,762 tokens/s per
GPU eager and 6,667 compiled, benchmarks/llama3_h100_202412_torchtitan.md).

The model of it, per block (``annotations["fusion"]`` = ``FusedIO`` on each op a fused kernel absorbs, and
``annotations["fused_neighbours"]`` on each product, ``fused_neighbours``'s answer):

- an op is fusible if it has no FLOPs by the flops pass (not a product, a convolution or attention), is not a
  view (views cost nothing either way), is not the loss (outside the blocks) and is an aten op (a custom op
  such as ``autopar::selective_scan`` is a kernel of its own);
- fusible ops of the same block connected through their tensors (views followed), with no other kernel between
  them on any path, form one group (``fused_groups``);
- the group's kernels read each tensor that comes from outside the group once and write each of its outputs
  that something outside the group reads; the backward reads the gradients of those outputs and the saved
  inputs, and writes the inputs' gradients (AOTAutograd's partitioner recomputes the cheap intermediates in
  backward instead of saving them: ``torch._functorch.partitioners.min_cut_rematerialization_partition``);
- a group launches one kernel per reduction it holds (a reduction ends a kernel whose consumers need its whole
  result), at least one; its backward as many again plus one per parameter it reads (a parameter's gradient
  sums over the tokens);
- compiled code issues its kernels from Inductor's generated wrapper: no per-op dispatch or autograd
  bookkeeping on the host (``Framework.host_op_s`` is not paid; each kernel's launch is).

The traffic pass reads the annotation.  Saved activations are counted as the eager ops save them (the
partitioner's recomputation saves less: the memory estimate stays on the safe side).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.context import PassContext
from autopar.passes.flops import NodeFlops
from autopar.passes.traffic import DROPOUT_OPS, LOSS_OPS, dropout_is_identity

from autopar.ir import Node, OpGraph, Ref, iter_refs, tensor_refs

#: Reductions whose output keeps its input's shape (a row-wise max and sum inside).
_ROW_REDUCTIONS = frozenset({"aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default",
                             "aten.log_softmax.int", "aten.cumsum.default"})


@dataclass(frozen=True, slots=True)
class FusedIO:
    """An op's part of its fused group: which of its tensor arguments (``tensor_refs`` indices) and outputs its
    group's kernels move, and the group's kernels (on the group's last op; 0 on the others)."""

    group: str
    """The name of the group's first op."""
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    fwd_kernels: int
    bwd_kernels: int


def _transparent(node: Node) -> bool:
    """A view, or a dropout that returns its input: no kernel, the same storage."""
    return node.alias_of is not None or (node.op in DROPOUT_OPS and dropout_is_identity(node))


def _root(graph: OpGraph, name: str) -> str:
    while _transparent(node := graph[name]):
        name = node.alias_of or node.inputs[0]
    return name


def fusible(node: Node, ctx: PassContext) -> bool:
    """Whether Inductor generates ``node``'s kernel inside a compiled block (see the module docstring)."""
    if not ctx.compile or node.kind != "op" or node.layer is None or _transparent(node):
        return False
    if not any(t is not None for t in node.outputs):  # a check on metadata: no kernel, eager or compiled
        return False
    if not node.op.startswith("aten."):  # a custom op (a fused kernel of its own): Inductor calls it as it is
        return False
    flops: NodeFlops | None = node.annotations.get("flops")
    return flops is not None and flops.fwd == 0 and node.op not in LOSS_OPS


def _is_reduction(graph: OpGraph, node: Node) -> bool:
    if node.op in _ROW_REDUCTIONS:
        return True
    widest = max((t.numel_at(1) for r in tensor_refs(node) if (t := graph.tensor(r)) is not None
                  and graph[r.name].kind not in ("param", "buffer", "constant")), default=0)
    return any(t is not None and t.numel_at(1) < widest for t in node.outputs)


def _barrier_depths(graph: OpGraph, ctx: PassContext) -> dict[str, int]:
    """Node -> the most kernels that are not Inductor's (products, attention, ops outside the blocks) on a path
    from the graph's inputs to it, that node's own excluded."""
    depth: dict[str, int] = {}
    for node in graph.nodes:
        d = 0
        for src in dict.fromkeys(node.inputs):
            s = graph[src]
            d = max(d, depth[src] + (s.kind == "op" and not _transparent(s) and not fusible(s, ctx)))
        depth[node.name] = d
    return depth


def fused_groups(graph: OpGraph, ctx: PassContext) -> dict[str, str]:
    """Fusible op -> the name of its group's first op: fusible ops of one block joined by a tensor (views
    followed) with no other kernel between them on any path (equal ``_barrier_depths``), so that a group never
    waits on a kernel that waits on it (Inductor's scheduler refuses such fusions)."""
    parent: dict[str, str] = {n.name: n.name for n in graph.ops() if fusible(n, ctx)}
    order = {n.name: i for i, n in enumerate(graph.nodes)}.__getitem__
    depth = _barrier_depths(graph, ctx)

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name in parent:
        node = graph[name]
        for src in dict.fromkeys(node.inputs):
            root = _root(graph, src)
            if root in parent and graph[root].layer == node.layer and depth[root] == depth[name]:
                a, b = find(name), find(root)
                if a != b:
                    parent[max(a, b, key=order)] = min(a, b, key=order)
    return {name: find(name) for name in parent}


def _escapes(graph: OpGraph, name: str, group: dict[str, str], gid: str) -> bool:
    """Whether the view ``name`` is read by anything outside group ``gid`` (views followed)."""
    for user in graph.users()[name]:
        u = graph[user]
        if _transparent(u):
            if _escapes(graph, user, group, gid):
                return True
        elif group.get(user) != gid:
            return True
    return False


def fused_neighbours(graph: OpGraph, node: Node) -> tuple[bool, bool]:
    """Of a product in a compiled block: whether its first input comes out of a fused kernel, and whether every
    reader of its output is one (so that the gradient of the output comes out of one, in backward): a
    reduction over the tensor (an FP8 cast's amax) then runs inside that kernel (``autopar.intra_op.fp8``)."""
    refs = tensor_refs(node)
    fused_in = bool(refs) and "fusion" in graph[_root(graph, refs[0].name)].annotations

    def readers(name: str) -> list[Node]:
        out: list[Node] = []
        for user in graph.users()[name]:
            u = graph[user]
            out.extend(readers(user) if _transparent(u) else [u])
        return out

    found = readers(node.name)
    return fused_in, bool(found) and all("fusion" in u.annotations for u in found)


def annotate_fusion_pass(graph: OpGraph, ctx: PassContext) -> OpGraph:
    """Set ``annotations["fusion"]`` on every op a compiled block fuses (nothing without ``ctx.compile``)."""
    for node in graph.ops():
        node.annotations.pop("fusion", None)
        node.annotations.pop("fused_neighbours", None)
    if not ctx.compile:
        return graph
    group = fused_groups(graph, ctx)
    members: dict[str, list[Node]] = {}
    for node in graph.ops():
        if node.name in group:
            members.setdefault(group[node.name], []).append(node)
    users = graph.users()
    for gid, nodes in members.items():
        read: set[Ref] = set()
        params: set[str] = set()
        reductions = 0
        io: list[tuple[Node, tuple[int, ...], tuple[int, ...]]] = []
        for node in nodes:
            reads = []
            for i, r in enumerate(tensor_refs(node)):
                src = graph[_root(graph, r.name)]
                if src.kind == "param":
                    params.add(src.name)
                if group.get(src.name) != gid and r not in read:
                    read.add(r)
                    reads.append(i)
            writes = set()
            for user in users[node.name]:
                u = graph[user]
                escapes = _escapes(graph, user, group, gid) if _transparent(u) else group.get(user) != gid
                if escapes:
                    writes.update(r.index for r in iter_refs((u.args, u.kwargs)) if r.name == node.name)
            reductions += _is_reduction(graph, node)
            io.append((node, tuple(reads), tuple(sorted(writes))))
        fwd = max(1, reductions)
        needs_bwd = any(t is not None and t.requires_grad for n in nodes for t in n.outputs)
        bwd = fwd + len(params) if needs_bwd else 0
        last = len(io) - 1
        for k, (node, reads, writes) in enumerate(io):
            node.annotations["fusion"] = FusedIO(gid, reads, writes, fwd if k == last else 0,
                                                 bwd if k == last else 0)
    for node in graph.ops():  # once here, not in the cost loops that price an FP8 cast per strategy
        if node.layer is not None and node.annotations["flops"].fwd > 0:
            node.annotations["fused_neighbours"] = fused_neighbours(graph, node)
    return graph


__all__ = ["FusedIO", "annotate_fusion_pass", "fused_groups", "fused_neighbours", "fusible"]
