"""Sharding strategies per op, from DTensor's own sharding rules, on meshes that need no processes.

For one mesh axis, an op's strategies come from DTensor's registries
(``DTensor._op_dispatcher.sharding_propagator``): ``op_strategy_funcs`` (called with every candidate
placement of every input) and ``op_single_dim_strategy_funcs`` (per-axis rules).  The traced graph is the
pre-dispatch training IR, whose composite ops DTensor only sees after decomposition, so they are mapped
onto the ops they decompose into:

- ``linear``/``matmul``/``einsum`` -> DTensor's einsum strategy generator (``gen_einsum_strategies``),
  the rule behind its ``mm``/``bmm``; the bias follows the output's last dim;
- ``layer_norm`` -> ``native_layer_norm``; ``rms_norm`` -> ``_fused_rms_norm``; ``dropout`` -> ``native_dropout``;
  ``group_norm`` -> ``native_group_norm``; ``conv1d/2d/3d`` -> ``convolution`` (both split the batch);
- ``scaled_dot_product_attention`` -> ``_scaled_dot_product_flash_attention`` (or the efficient kernel
  when a mask is given).

Hand-written rules, only where DTensor has none (each tested in ``tests/test_strategies.py``):

- attention batch sharding: DTensor offers only heads-sharding; attention is independent per batch
  element (``sdpa(q, k, v)[b] == sdpa(q[b], k[b], v[b])``), so ``S(0)`` on q, k, v, out is added;
- multi-query attention (one key/value head): query heads split, the key/value head replicated (each query
  head reads it whole), as Megatron-LM runs it;
- ``cross_entropy_loss``: batch-sharded (``S(0)`` logits and targets -> partial mean) and vocab-parallel
  (``S(1)`` logits, replicated targets -> replicated loss, as ``loss_parallel`` does);
- ``one_hot``: element-wise in the input's dims;
- Mamba's selective scan (``autopar.fused_kernels``): split on its channels or its batch;
- convolutions split on their channels (``autopar.conv_channels``), which DTensor's rule does not offer.

An op with no rule falls back to all-Replicate with one warning naming it.  Rules are written for one
mesh axis; ``mesh_strategies`` expands them to N-D as the Cartesian product over axes and drops every
strategy that shards a dimension unevenly (``heads % tp != 0``).

Placements are DTensor's short notation as strings: ``"R"``, ``"S(d)"``, ``"P"`` (any partial).
"""

from __future__ import annotations

import functools
import itertools
import logging
import string
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops._einsum_strategy import gen_einsum_strategies

from autopar.conv_channels import channel_rules
from autopar.fused_kernels import SELECTIVE_SCAN
from autopar.ir import BatchScaled, Node, OpGraph, Ref, TensorInfo, tensor_refs
from autopar.passes.flops import attention_mask, is_causal

log = logging.getLogger(__name__)

R = "R"
PARTIAL = "P"


def shard(dim: int) -> str:
    return f"S({dim})"


def shard_dim(p: str) -> int | None:
    """The tensor dim of ``S(d)``, else ``None``."""
    return int(p[2:-1]) if p.startswith("S(") else None


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """A strategy on one mesh axis: placement of every output and required placement of every tensor input."""

    outputs: tuple[str | None, ...]
    inputs: tuple[str, ...]


#: A strategy on an N-D mesh: one ``AxisStrategy`` per mesh axis.
Strategy = tuple[AxisStrategy, ...]

_WARNED: set[str] = set()


@functools.lru_cache(maxsize=1)
def _mesh_1d() -> DeviceMesh:
    # No process group: strategy enumeration only needs the mesh's shape.
    return DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0)


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


class _UnsupportedPlacement(Exception):
    """A rule uses a partial other than a sum (avg/max/min): autopar's ``P`` always means a pending sum."""


def _placement_str(p: Any, is_float: bool = True, is_output: bool = False) -> str:
    if p is None:
        return R
    if isinstance(p, Shard) or type(p).__name__ == "_ShardingPlaceholder":
        return shard(p.dim)
    if isinstance(p, Replicate):
        return R
    if p.is_partial():
        if not is_float:  # an index input of a vocab-parallel embedding: the ids are replicated
            return R
        op = getattr(p, "reduce_op", "sum")
        # A reduction may leave a pending average (mean of shards): reduced by the same all-reduce as a sum.
        # Inputs must be pending sums, or P would mean two different things downstream.
        if op != "sum" and not (is_output and op == "avg"):
            raise _UnsupportedPlacement(str(p))
        return PARTIAL
    return R


def _rule(outputs: list[Any], inputs: list[Any], float_inputs: list[bool]) -> AxisStrategy | None:
    try:
        return AxisStrategy(tuple(_placement_str(x, is_output=True) if x is not None else None for x in outputs),
                            tuple(_placement_str(x, f) for x, f in zip(inputs, float_inputs)))
    except _UnsupportedPlacement:
        return None


def _meta(t: TensorInfo, batch: int) -> TensorMeta:
    shape = t.shape_at(batch)
    dtype = getattr(torch, t.dtype, torch.float32)
    x = torch.empty(shape, dtype=dtype, device="meta")
    return TensorMeta(x.shape, x.stride(), x.dtype)


def _candidates(meta: TensorMeta) -> OpStrategy:
    mesh = _mesh_1d()
    placements = [Replicate(), *(Shard(d) for d in range(len(meta.shape)))]
    if meta.dtype.is_floating_point:
        placements.append(Partial())
    return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tensor_meta=meta)) for p in placements])


def _concrete(a: Any, batch: int) -> Any:
    if isinstance(a, BatchScaled):
        return a.at(batch)
    if isinstance(a, (list, tuple)):
        return type(a)(_concrete(x, batch) for x in a)
    return a


def _specs_to_strategies(st: Any, n_out: int, float_inputs: list[bool]) -> list[AxisStrategy]:
    out: list[AxisStrategy] = []
    for spec in st.strategies:
        o = spec.output_specs
        outs = o if isinstance(o, tuple) else (o,)
        rule = _rule([x.placements[0] if x is not None else None for x in outs[:n_out]],
                     [x.placements[0] for x in spec.input_specs or ()], float_inputs)
        if rule is not None:
            out.append(rule)
    return out


def _einsum_strategies(equation: str, n_out: int, float_inputs: list[bool]) -> list[AxisStrategy]:
    return _specs_to_strategies(gen_einsum_strategies(equation, _mesh_1d()), n_out, float_inputs)


def _linear_strategies(graph: OpGraph, node: Node) -> list[AxisStrategy]:
    x = graph.tensor(node.args[0])
    letters = string.ascii_lowercase[: len(x.shape) - 1]
    eq = f"{letters}k,nk->{letters}n"
    base = _einsum_strategies(eq, 1, [True, True])
    has_bias = len(node.args) > 2 and isinstance(node.args[2], Ref)
    if not has_bias:
        return base
    last = len(x.shape) - 1
    rules = []
    for s in base:
        out = s.outputs[0]
        bias = "S(0)" if out == shard(last) else (PARTIAL if out == PARTIAL else R)
        rules.append(AxisStrategy(s.outputs, (*s.inputs, bias)))
    return rules


def _matmul_equation(a: tuple[int, ...], b: tuple[int, ...]) -> str | None:
    if len(a) < 2 or len(b) < 2:
        return None
    nb = max(len(a), len(b)) - 2
    batch = string.ascii_lowercase[:nb]
    ab, bb = batch[nb - (len(a) - 2):], batch[nb - (len(b) - 2):]
    return f"{ab}mk,{bb}kn->{batch}mn"


def _sdpa_strategies(graph: OpGraph, node: Node, batch: int) -> list[AxisStrategy]:
    p = _propagator()
    q, k, v = (graph.tensor(node.args[i]) for i in range(3))
    metas = [_candidates(_meta(t, batch)) for t in (q, k, v)]
    mask, causal = attention_mask(node), is_causal(node)
    if isinstance(mask, Ref):
        op = torch.ops.aten._scaled_dot_product_efficient_attention.default
        schema = OpSchema(op, (*metas, None, False, 0.0, causal), {}, schema_info=p.op_to_schema_info.get(op))
    else:
        op = torch.ops.aten._scaled_dot_product_flash_attention.default
        schema = OpSchema(op, (*metas, 0.0, causal), {}, schema_info=p.op_to_schema_info.get(op))
    rules = _specs_to_strategies(p.op_strategy_funcs[op](schema), 1, [True, True, True])
    if isinstance(mask, Ref):  # the mask input rides along replicated (it broadcasts over batch/heads)
        rules = [AxisStrategy(r.outputs, (*r.inputs, R)) for r in rules]
    batch_rule = AxisStrategy((shard(0),), (shard(0),) * 3 + ((shard(0),) if isinstance(mask, Ref) else ()))
    if isinstance(mask, Ref) and graph.tensor(mask).shape_at(batch)[0] == 1:
        batch_rule = AxisStrategy((shard(0),), (shard(0),) * 3 + (R,))
    rules.append(batch_rule)
    if q.shape[1] > 1 and k.shape[1] == v.shape[1] == 1:  # multi-query: every query head reads the one K/V head
        mask_heads = isinstance(mask, Ref) and graph.tensor(mask).shape_at(batch)[1] > 1
        rules.append(AxisStrategy((shard(1),), (shard(1), R, R) + ((shard(1) if mask_heads else R,)
                                                                   if isinstance(mask, Ref) else ())))
    return rules


def _cross_entropy_strategies(graph: OpGraph, node: Node) -> list[AxisStrategy]:
    logits = graph.tensor(node.args[0])
    n_in = len(tensor_refs(node))
    pad = (R,) * (n_in - 2)
    rules = [AxisStrategy((R,), (R, R, *pad)), AxisStrategy((PARTIAL,), (shard(0), shard(0), *pad))]
    if len(logits.shape) == 2:  # vocab-parallel (loss_parallel): class dim sharded, targets replicated
        rules.append(AxisStrategy((R,), (shard(1), R, *pad)))
    return rules


def _one_hot_strategies(graph: OpGraph, node: Node) -> list[AxisStrategy]:
    t = graph.tensor(node.args[0])
    return [AxisStrategy((R,), (R,)), *(AxisStrategy((shard(d),), (shard(d),)) for d in range(len(t.shape)))]


def _metadata_check_strategies(graph: OpGraph, node: Node) -> list[AxisStrategy]:
    """``aten._assert_tensor_metadata`` (what export writes for ``x.to(dtype)``) only checks the dtype the
    trace saw; it moves no data, so it takes its input as it is, and the runtime skips it."""
    t = graph.tensor(tensor_refs(node)[0])
    return [AxisStrategy((p,) * len(node.outputs), (p,)) for p in (R, *(shard(d) for d in range(len(t.shape))),
                                                                    PARTIAL)]


def _gather_strategies(graph: OpGraph, node: Node, batch: int) -> list[AxisStrategy]:
    """DTensor's gather rules, less the one that splits the index along the gathered dim of a whole input.

    That forward is local, but its backward (``gather_backward``: an in-place ``scatter_add_`` into zeros of
    the input's shape) would need the input's gradient as a pending sum, and DTensor has no such rule for
    an in-place scatter: it all-gathers the gradient and the int64 index instead.  So the ILP may not pick
    a layout whose backward the runtime does not run.
    """
    rules = _registry_strategies(graph, node, batch) or _replicate_fallback(node)
    dim = node.args[1] % len(graph.tensor(tensor_refs(node)[0]).shape)
    return [r for r in rules if not (r.inputs[0] in (R, None) and r.inputs[1] == shard(dim))]


#: Convolutions as ``aten.convolution``'s arguments: ``(input, weight, bias, stride, padding, dilation, groups)``
#: with the defaults of ``conv1d/2d/3d``.
CONVOLUTIONS = {"aten.conv1d.default": 1, "aten.conv2d.default": 2, "aten.conv3d.default": 3}


def _convolution_strategies(graph: OpGraph, node: Node, batch: int) -> list[AxisStrategy] | None:
    """``conv1d/2d/3d`` by DTensor's rule for ``aten.convolution`` (what they decompose into): the batch splits,
    the weight and bias whole; and split on the channels as ``autopar.conv_channels`` runs them (column- or
    row-parallel, depthwise), which DTensor itself does not (it takes a channel split for a spatial one)."""
    dims = CONVOLUTIONS[node.op]
    defaults = (None, None, None, [1] * dims, [0] * dims, [1] * dims, 1)
    args = list(node.args) + list(defaults[len(node.args):])
    for i, key in enumerate(("input", "weight", "bias", "stride", "padding", "dilation", "groups")):
        if key in node.kwargs:
            args[i] = node.kwargs[key]
    stride, padding, dilation = ([a] * dims if isinstance(a, int) else list(a) if isinstance(a, (list, tuple)) else a
                                 for a in args[3:6])
    conv = Node(node.name, node.kind, "aten.convolution.default",
                args=(args[0], args[1], args[2], stride, padding, dilation, False, [0] * dims, args[6]),
                outputs=node.outputs)
    has_bias = isinstance(args[2], Ref)
    in_channels = graph.tensor(args[0]).shape_at(batch)[1]
    channels = [AxisStrategy((r.output,), (r.input, r.weight, *([r.bias] if has_bias else [])))
                for r in channel_rules(in_channels, args[6])]
    return (_registry_strategies(graph, conv, batch) or []) + channels or None


def _group_norm_strategies(graph: OpGraph, node: Node, batch: int) -> list[AxisStrategy] | None:
    """``group_norm(x, groups, weight, bias, eps)`` by DTensor's rule for ``native_group_norm`` (what it
    decomposes into): the batch splits, the affine parameters whole."""
    x = graph.tensor(node.args[0]).shape_at(batch)
    groups = node.args[1] if len(node.args) > 1 else node.kwargs.get("num_groups")
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
    hw = 1
    for d in x[2:]:
        hw *= d
    native = Node(node.name, node.kind, "aten.native_group_norm.default",
                  args=(node.args[0], weight, bias, x[0], x[1], hw, groups, eps), outputs=node.outputs)
    return _registry_strategies(graph, native, batch)


def _selective_scan_strategies(graph: OpGraph, node: Node) -> list[AxisStrategy]:
    """``autopar::selective_scan(u, dt, A, B, C, D?, z?, delta_bias?)``: the recurrence runs per channel and per
    sample, so it splits the channels (``u, dt, z, y`` on dim 1, ``A, D, delta_bias`` on dim 0, ``B, C``
    whole: every channel reads the same input-dependent projections) or the batch (``u, dt, B, C, z, y`` on
    dim 0, the parameters whole)."""
    refs = tensor_refs(node)
    names = ("u", "dt", "A", "B", "C", "D", "z", "delta_bias")
    present = [names[i] for i, a in enumerate(node.args[:len(names)]) if isinstance(a, Ref)]
    if len(present) != len(refs):  # not called as traced_as_fused_kernels calls it
        return []
    channels = {"u": shard(1), "dt": shard(1), "z": shard(1), "A": shard(0), "D": shard(0), "delta_bias": shard(0)}
    batch = {"u": shard(0), "dt": shard(0), "z": shard(0), "B": shard(0), "C": shard(0)}
    return [AxisStrategy((shard(1),), tuple(channels.get(n, R) for n in present)),
            AxisStrategy((shard(0),), tuple(batch.get(n, R) for n in present))]


_DECOMPOSED = {
    "aten.layer_norm.default": "native_layer_norm.default",
    "aten.rms_norm.default": "_fused_rms_norm.default",
    "aten.dropout.default": "native_dropout.default",
    "aten.__and__.Tensor": "bitwise_and.Tensor",  # HuggingFace's masks: causal & padding
    "aten.__or__.Tensor": "bitwise_or.Tensor",
}
#: Shape-changing views whose strategies are DTensor's ``reshape`` rule towards the traced output shape.
_RESHAPES = frozenset({"aten.flatten.using_ints", "aten.unflatten.int", "aten.view.default", "aten.reshape.default",
                       "aten._unsafe_view.default"})


#: ``Tensor.to`` overloads export keeps (PEFT casts an adapter's input to its weights' dtype and device).
_TO_OPS = frozenset({"aten.to.dtype", "aten.to.device", "aten.to.dtype_layout"})


def _resolve_op(name: str) -> Any:
    name = _DECOMPOSED.get(name, name)
    packet, _, overload = name.removeprefix("aten.").rpartition(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _type_as_strategies(graph: OpGraph, node: Node, batch: int) -> list[AxisStrategy] | None:
    """``x.type_as(other)`` is ``x.to(other.dtype)``: DTensor's cast rules on ``x``; ``other`` only lends its
    dtype, so it is read as it already is when it has ``x``'s shape (RoPE's ``out.type_as(q)``), else whole."""
    refs = tensor_refs(node)
    cast = Node(node.name, node.kind, "aten._to_copy.default", args=(refs[0],),
                kwargs={"dtype": getattr(torch, graph.tensor(refs[1]).dtype)}, outputs=node.outputs)
    rules = _registry_strategies(graph, cast, batch)
    if rules is None:
        return None
    same = graph.tensor(refs[0]).shape == graph.tensor(refs[1]).shape
    return [AxisStrategy(r.outputs, (r.inputs[0], r.inputs[0] if same else R)) for r in rules]


def _registry_strategies(graph: OpGraph, node: Node, batch: int) -> list[AxisStrategy] | None:
    p = _propagator()
    refs = tensor_refs(node)
    if node.op == "aten.type_as.default" and len(refs) == 2:
        return _type_as_strategies(graph, node, batch)
    if node.op in _TO_OPS and refs and node.out is not None:  # composite: DTensor's rule is ``_to_copy``'s
        node = Node(node.name, node.kind, "aten._to_copy.default", args=(refs[0],),
                    kwargs={"dtype": getattr(torch, node.out.dtype)}, outputs=node.outputs)
    if node.op in _RESHAPES and refs:
        node = Node(node.name, node.kind, "aten.reshape.default", args=(refs[0], list(node.out.shape_at(batch))),
                    outputs=node.outputs)
    elif node.op == "aten.chunk.default" and refs:  # chunk(x, n, dim) == split(x, ceil(size / n), dim)
        dim = node.args[2] if len(node.args) > 2 else 0
        size = graph.tensor(refs[0]).shape_at(batch)[dim]
        node = Node(node.name, node.kind, "aten.split.Tensor", args=(refs[0], -(-size // node.args[1]), dim),
                    outputs=node.outputs)
    try:
        op = _resolve_op(node.op)
    except AttributeError:
        return None
    float_inputs = [graph.tensor(r).is_floating for r in refs]
    n_out = len(node.outputs)

    def build(a: Any, as_meta: bool) -> Any:
        if isinstance(a, Ref):
            meta = _meta(graph.tensor(a), batch)
            return meta if as_meta else _candidates(meta)
        if isinstance(a, (list, tuple)) and any(isinstance(x, Ref) for x in a):
            items = [build(x, as_meta) for x in a]
            return items if as_meta else TupleStrategy(items)
        return _concrete(a, batch)

    if op in p.op_single_dim_strategy_funcs:
        args = tuple(build(a, True) for a in node.args)
        kwargs = {k: build(v, True) for k, v in node.kwargs.items()}
        rules = p.op_single_dim_strategy_funcs[op](op, args, kwargs)
        out: list[AxisStrategy] = [AxisStrategy((R,) * n_out, (R,) * len(refs))]
        n_rule_out = len(rules[0]) - len(refs) if rules else n_out
        for raw in rules:
            rule = _rule(list(raw[:n_rule_out])[:n_out], list(raw[n_rule_out:]), float_inputs)
            if rule is not None and len(rule.inputs) == len(refs):
                out.append(AxisStrategy(rule.outputs + (R,) * (n_out - len(rule.outputs)), rule.inputs))
        return out
    if op in p.op_strategy_funcs:
        args = tuple(build(a, False) for a in node.args)
        schema = OpSchema(op, args, {}, schema_info=p.op_to_schema_info.get(op))
        st = p.op_strategy_funcs[op](schema)
        if isinstance(st, TupleStrategy):
            return None
        return _specs_to_strategies(st, n_out, float_inputs)
    return None


def _replicate_fallback(node: Node) -> list[AxisStrategy]:
    if node.op not in _WARNED and tensor_refs(node):  # factories (no tensor input) are replicated by nature
        _WARNED.add(node.op)
        log.warning("no sharding rule for %s: it runs replicated", node.op)
    return [AxisStrategy((R,) * len(node.outputs), (R,) * len(tensor_refs(node)))]


def _rule_key(graph: OpGraph, node: Node, batch: int) -> tuple:
    shapes = tuple((t.shape_at(batch), t.dtype) for t in (graph.tensor(r) for r in tensor_refs(node)))
    args = tuple(repr(_concrete(a, batch)) if not isinstance(a, Ref) else "T" for a in node.args)
    kwargs = tuple(sorted((k, repr(_concrete(v, batch))) for k, v in node.kwargs.items()))
    return (node.op, shapes, args, kwargs, len(node.outputs))


_AXIS_CACHE: dict[tuple, tuple[AxisStrategy, ...]] = {}


def axis_strategies(graph: OpGraph, node: Node, batch: int) -> tuple[AxisStrategy, ...]:
    """Deduplicated one-axis strategies of ``node`` (all-Replicate always first), cached by op and shapes."""
    key = _rule_key(graph, node, batch)
    cached = _AXIS_CACHE.get(key)
    if cached is not None:
        return cached
    op = node.op
    try:
        if op == "aten.linear.default":
            rules = _linear_strategies(graph, node)
        elif op in ("aten.matmul.default", "aten.mm.default", "aten.bmm.default"):
            a, b = (graph.tensor(node.args[i]).shape_at(batch) for i in range(2))
            eq = _matmul_equation(a, b)
            rules = _einsum_strategies(eq, 1, [True, True]) if eq else _replicate_fallback(node)
        elif op == "aten.einsum.default":
            rules = _einsum_strategies(node.args[0].replace(" ", ""), 1, [True] * len(tensor_refs(node)))
        elif op == "aten.scaled_dot_product_attention.default":
            rules = _sdpa_strategies(graph, node, batch)
        elif op == "aten.cross_entropy_loss.default":
            rules = _cross_entropy_strategies(graph, node)
        elif op == "aten.one_hot.default":
            rules = _one_hot_strategies(graph, node)
        elif op == "aten._assert_tensor_metadata.default" and tensor_refs(node):
            rules = _metadata_check_strategies(graph, node)
        elif op == "aten.gather.default":
            rules = _gather_strategies(graph, node, batch)
        elif op == SELECTIVE_SCAN:
            rules = _selective_scan_strategies(graph, node)
        elif op in CONVOLUTIONS:
            rules = _convolution_strategies(graph, node, batch) or _replicate_fallback(node)
        elif op == "aten.group_norm.default":
            rules = _group_norm_strategies(graph, node, batch) or _replicate_fallback(node)
        else:
            rules = _registry_strategies(graph, node, batch) or _replicate_fallback(node)
    except Exception as exc:  # a DTensor rule that rejects these arguments: run replicated
        log.debug("strategy enumeration failed for %s: %s", op, exc)
        rules = _replicate_fallback(node)
    replicate = AxisStrategy((R,) * len(node.outputs), (R,) * len(tensor_refs(node)))
    unique = tuple(dict.fromkeys([replicate, *rules]))
    _AXIS_CACHE[key] = unique
    return unique


def divides(t: TensorInfo | None, placements: tuple[str | None, ...], mesh_shape: tuple[int, ...],
            batch: int) -> bool:
    """Whether sharding ``t`` by ``placements`` (one per mesh axis) splits every dim evenly."""
    if t is None:
        return True
    shape = t.shape_at(batch)
    split = [1] * len(shape)
    for p, n in zip(placements, mesh_shape):
        d = shard_dim(p) if p else None
        if d is not None:
            if d >= len(shape):
                return False
            split[d] *= n
    return all(size % k == 0 for size, k in zip(shape, split))


def mesh_strategies(graph: OpGraph, node: Node, batch: int, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """All valid N-D strategies of ``node``: products of per-axis strategies that shard evenly."""
    per_axis = axis_strategies(graph, node, batch)
    inputs = [graph.tensor(r) for r in tensor_refs(node)]
    result = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        ok = all(divides(t, tuple(s.outputs[i] for s in combo), mesh_shape, batch)
                 for i, t in enumerate(node.outputs))
        ok = ok and all(divides(t, tuple(s.inputs[i] for s in combo), mesh_shape, batch)
                        for i, t in enumerate(inputs))
        if ok:
            result.append(combo)
    return result


def param_tp_placements(graph: OpGraph, strategies: dict[str, Strategy]) -> dict[str, str]:
    """FQN -> placement on the tp axis, as the first op reading the parameter requires it."""
    out: dict[str, str] = {}
    for n in graph.ops():
        strat = strategies.get(n.name)
        if strat is None:
            continue
        for k, r in enumerate(tensor_refs(n)):
            src = graph[r.name]
            if src.kind == "param" and src.target not in out:
                p = strat[0].inputs[k] or R
                out[src.target] = R if p == "P" else p  # a partial bias is added on one rank: stored replicated
    return out
