"""The operator-graph IR: the one graph type every pass reads and annotates.

An ``OpGraph`` is a topologically ordered list of ``Node``s taken from a ``torch.export`` graph (forward
pass of the model plus its loss).  Shapes are stored *per sample*: a tensor whose size scales with the
batch keeps the index of that dimension in ``TensorInfo.batch_dim`` and the per-sample extent in
``shape`` (``[b, s, h]`` is stored as ``(1, s, h)`` with ``batch_dim=0``; a flattened ``[b*s, h]`` as
``(s, h)``).  ``shape_at(batch)`` gives concrete shapes, so one trace serves every micro-batch size.

Each pass owns one annotation key on ``Node.annotations`` (and ``OpGraph.annotations`` for graph-wide
results); passes never pass results through globals.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import re
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

NodeKind = Literal["input", "param", "buffer", "constant", "op", "output"]

#: Bytes per element of the dtypes that appear in traced graphs.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}


#: Ops whose output is always a view of their first tensor input (``Node.alias_of``).
VIEW_OPS = frozenset({
    "aten.view.default", "aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.expand.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default", "aten.squeeze.dims", "aten.slice.Tensor",
    "aten.select.int", "aten.alias.default", "aten.split.Tensor", "aten.split_with_sizes.default",
    "aten.chunk.default", "aten.unflatten.int", "aten.narrow.default", "aten.unbind.int", "aten.view_as.default",
    "aten.expand_as.default", "aten.detach.default", "aten.as_strided.default", "aten.diagonal.default",
    "aten.movedim.int", "aten.swapaxes.default", "aten.tensor_split.sections", "aten.numpy_T.default",
    "aten.mT.default",
})
#: Views that move dimensions: after one, a contiguous tensor is no longer contiguous.
PERMUTING_VIEW_OPS = frozenset({"aten.transpose.int", "aten.permute.default", "aten.movedim.int",
                                "aten.swapaxes.default"})
#: Ops that return a view when their input is contiguous and a copy otherwise.
VIEW_IF_CONTIGUOUS_OPS = frozenset({
    "aten.reshape.default", "aten.flatten.using_ints", "aten.contiguous.default", "aten.view_as.default",
})


def is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Metadata of one tensor value: per-sample shape, dtype, which dim carries the batch."""

    shape: tuple[int, ...]
    dtype: str
    batch_dim: int | None = None
    requires_grad: bool = False

    def shape_at(self, batch: int) -> tuple[int, ...]:
        if self.batch_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.batch_dim] *= batch
        return tuple(s)

    def numel_at(self, batch: int) -> int:
        return math.prod(self.shape_at(batch))

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_floating(self) -> bool:
        return is_floating(self.dtype)


@dataclass(frozen=True, slots=True)
class BatchLinear:
    """A quantity linear in the batch size: ``per_sample * batch + fixed`` (bytes, FLOPs, seconds)."""

    per_sample: float = 0.0
    fixed: float = 0.0

    def at(self, batch: float) -> float:
        return self.per_sample * batch + self.fixed

    def __add__(self, other: BatchLinear) -> BatchLinear:
        return BatchLinear(self.per_sample + other.per_sample, self.fixed + other.fixed)

    def __mul__(self, k: float) -> BatchLinear:
        return BatchLinear(self.per_sample * k, self.fixed * k)

    __rmul__ = __mul__


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference, inside ``Node.args``, to output ``index`` of node ``name``."""

    name: str
    index: int = 0


@dataclass(frozen=True, slots=True)
class BatchScaled:
    """An integer argument that scales with the batch (a ``view`` size such as ``b*s``): ``factor * batch``."""

    factor: int

    def at(self, batch: int) -> int:
        return self.factor * batch


@dataclass(slots=True)
class Node:
    """One operation (or graph input/output) of the traced forward graph."""

    name: str
    kind: NodeKind
    op: str  # "aten.linear.default", "getitem", or the kind for placeholders
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[TensorInfo | None, ...] = ()
    module: str = ""  # FQN of the innermost module that produced this node ("" = the root)
    module_type: str = ""
    params: tuple[str, ...] = ()  # canonical FQNs of the parameters this node reads directly
    layer: int | None = None  # index in the repeated block stack, None outside it
    target: str = ""  # for param/buffer/input placeholders: the FQN or input name
    alias_of: str | None = None  # the input node whose storage this op's output views (view ops)
    batch_scaled: bool = False  # its work scales with the batch (it reads or writes batch-sized tensors)
    annotations: dict[str, Any] = field(default_factory=dict)
    _tensor_refs: list[Ref] | None = field(default=None, init=False, repr=False, compare=False)
    """``tensor_refs``' answer, kept: the planner asks it of each op for every intra-op problem."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """Names of the nodes this node reads, in argument order (duplicates kept)."""
        return tuple(r.name for r in iter_refs((self.args, self.kwargs)))

    @property
    def out(self) -> TensorInfo | None:
        """The first output (most ops have exactly one)."""
        return self.outputs[0] if self.outputs else None


def iter_refs(obj: Any) -> Iterator[Ref]:
    """All ``Ref``s inside a nested args structure, in order."""
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_refs(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_refs(x)


def tensor_refs(node: Node) -> list[Ref]:
    """The node's tensor arguments in the order strategies list them (positional, lists flattened).  Kept on the
    node (its ``args`` are set once: a pass that changes them makes a new node), so the caller must not modify it."""
    if node._tensor_refs is not None:
        return node._tensor_refs
    refs: list[Ref] = []
    for a in node.args:
        if isinstance(a, Ref):
            refs.append(a)
        elif isinstance(a, (list, tuple)):
            refs.extend(x for x in a if isinstance(x, Ref))
    node._tensor_refs = refs
    return refs


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter (tied parameters appear once, under their first FQN, with the others as aliases)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...] = ()
    layer: int | None = None
    trainable: bool = True  # ``requires_grad``: a frozen parameter (fine-tuning) has no gradient, no optimizer state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def structural_hash(members: list[Node], prefix: str, by_name: dict[str, Node]) -> str:
    """A hash of one block's structure: its ops in order, their modules relative to ``prefix`` (the block's
    FQN), their output shapes and their wiring (inputs from inside the block by position, from outside by kind
    and shape, parameters by their FQN relative to ``prefix``, and whether they train).  Identical blocks of a
    stack hash alike whatever their index."""
    local = {n.name: i for i, n in enumerate(members)}

    def relative(path: str) -> str:
        return path[len(prefix):] if path.startswith(prefix) else path

    def rel(a: Any) -> Any:
        if isinstance(a, Ref):
            if a.name in local:
                return ("local", local[a.name], a.index)
            src = by_name[a.name]
            if src.kind == "param":  # a frozen block (fine-tuning) differs from a trainable one
                frozen = () if src.out.requires_grad else ("frozen",)
                return ("param", relative(src.target), src.out.shape, *frozen)
            t = src.outputs[a.index] if a.index < len(src.outputs) else None
            return ("ext", src.kind, t.shape if t else None)
        if isinstance(a, (list, tuple)):
            return tuple(rel(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, rel(v)) for k, v in a.items()))
        return a

    h = hashlib.sha1()
    for n in members:
        sig = (n.op, relative(n.module), rel(n.args), rel(n.kwargs),
               tuple((o.shape, o.dtype, o.batch_dim) if o else None for o in n.outputs))
        h.update(repr(sig).encode())
    return h.hexdigest()[:12]


#: A module path inside a stack of blocks: ``decoder.block.3.layer.0`` is block 3 of ``decoder.block``.
STACKED_MODULE = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.|$)")


def stack_prefixes(module_paths: Iterable[str]) -> frozenset[str]:
    """The stacks of blocks among these module FQNs: what comes before a path's first numeric component
    (``encoder.layers`` of ``encoder.layers.3.fc``)."""
    return frozenset(m["stack"] for path in module_paths if (m := STACKED_MODULE.match(path)))


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One element of the repeated block stack (``blocks.3``) and its structural hash."""

    index: int
    prefix: str
    structural_hash: str


@dataclass(slots=True)
class OpGraph:
    """The traced model: nodes in topological order plus parameter and layer tables."""

    nodes: list[Node]
    params: dict[str, ParamInfo]
    layers: list[LayerInfo]
    layer_container: str | None
    seq_len: int
    trace_time_s: float = 0.0
    #: "derived-per-op": the backward pass is not traced; passes derive it from each forward op.
    backward: str = "derived-per-op"
    #: the loss compares the samples of the batch (``autopar.gather_batch``): one micro-batch per step
    loss_gathers_batch: bool = False
    #: arguments the stack's own loop hands from one layer to the next, made by the layers (T5's relative position
    #: bias, which the first layer makes and every later one takes): the slots (a positional index, or a keyword)
    #: the first layer gets as ``None`` and the second as a tensor with a gradient
    layer_loop_args: tuple[str, ...] = ()
    #: the same, of the other stacks of blocks that have any (an encoder's, which an encoder-decoder's pipeline
    #: splits too: ``autopar.inter_op.units``), by the stack's module path
    stack_loop_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: the other stacks of blocks (module lists of two or more modules of one class, each with parameters), by module
    #: path: an encoder's beside the decoder's layers, a vision tower beside the text layers
    other_stacks: tuple[str, ...] = ()
    #: grouped-query attention's key/value heads repeated (``repeat_kv``) where the model, run without
    #: tensor-parallel regions, hands attention the fewer heads (HuggingFace's SDPA integration,
    #: ``autopar.hf_masks.kv_heads_as_run``)
    repeats_kv_heads: bool = False
    annotations: dict[str, Any] = field(default_factory=dict)
    _index: dict[str, Node] = field(default_factory=dict, repr=False)
    _compute_itemsize: int = field(default=0, repr=False)
    _users: dict[str, list[str]] | None = field(default=None, repr=False)
    _fingerprint: str = field(default="", repr=False, compare=False)
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index = {n.name: n for n in self.nodes}

    def copy(self) -> OpGraph:
        """A deep copy (the passes annotate a graph in place), through pickle: a third of ``copy.deepcopy``'s time
        on GPT-3 175B's graph (0.06 s against 0.14 s, at best of 7).  What ``derived`` kept is left behind."""
        derived, self._derived = self._derived, {}
        try:
            return pickle.loads(pickle.dumps(self, pickle.HIGHEST_PROTOCOL))
        finally:
            self._derived = derived

    def scale(self, node: Node, batch: int) -> int:
        """Multiplier turning a per-sample cost of ``node`` into the cost at ``batch``."""
        return batch if node.batch_scaled else 1

    def __getitem__(self, name: str) -> Node:
        return self._index[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def ops(self) -> Iterator[Node]:
        """The operator nodes (no placeholders, no output)."""
        return (n for n in self.nodes if n.kind == "op")

    def tensor(self, ref: Ref) -> TensorInfo | None:
        outs = self._index[ref.name].outputs
        return outs[ref.index] if ref.index < len(outs) else None

    def structure(self) -> Iterator[bytes]:
        """The graph's structure, node by node (ops, per-sample shapes, modules, parameters): what a fingerprint
        hashes.  The passes' annotations are not part of it."""
        for n in self.nodes:
            if n.kind == "output":
                continue
            outs = tuple((o.shape, o.dtype, o.batch_dim) if o else None for o in n.outputs)
            line = (n.kind, n.op, n.module, n.params, n.target if n.kind == "param" else "", outs)
            if n.kind == "param" and not n.out.requires_grad:
                line += ("frozen",)  # only then: the fingerprints of models that train every parameter stay
            yield repr(line).encode()

    def fingerprint(self) -> str:
        """A hash of ``structure`` and the sequence length, computed once: equal for the same model traced in
        another process (what caches shared across processes key on)."""
        if not self._fingerprint:
            h = hashlib.sha256(str(self.seq_len).encode())
            for line in self.structure():
                h.update(line)
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``key`` for this graph: for what the planner derives from the graph's
        structure alone (its nodes, arguments and modules do not change after tracing; the passes only annotate)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def users(self) -> dict[str, list[str]]:
        """Map node name -> names of the nodes that read it (in graph order).  Built once: the nodes of a traced
        graph do not change (passes annotate them); callers must not modify the lists."""
        if self._users is None:
            users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
            for n in self.nodes:
                for src in dict.fromkeys(n.inputs):
                    users[src].append(n.name)
            self._users = users
        return self._users

    @property
    def num_parameters(self) -> int:
        return sum(p.numel for p in self.params.values())

    @property
    def num_trainable_parameters(self) -> int:
        """Parameters that train (``requires_grad``); the others are frozen (a fine-tuned model's base)."""
        return sum(p.numel for p in self.params.values() if p.trainable)

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element of the floating parameters: the precision the model computes in.  A floating
        tensor wider than that is an explicit upcast in the model's code (``x.float()``)."""
        if not self._compute_itemsize:
            sizes = [DTYPE_BYTES.get(p.dtype, 4) for p in self.params.values() if is_floating(p.dtype)]
            self._compute_itemsize = min(sizes) if sizes else 4
        return self._compute_itemsize

    def width(self, t: TensorInfo, activation_bytes: int) -> int:
        """Bytes per element a tensor moves: integers their own size; floating tensors the precision policy's
        activation width, unless the model upcasts them beyond its compute precision."""
        if not t.is_floating:
            return t.itemsize
        return t.itemsize if t.itemsize > self.compute_itemsize else activation_bytes

    def layer_types(self) -> dict[str, list[int]]:
        """Structural hash -> indices of the layers with that structure (identical layers share a hash)."""
        types: dict[str, list[int]] = {}
        for layer in self.layers:
            types.setdefault(layer.structural_hash, []).append(layer.index)
        return types
