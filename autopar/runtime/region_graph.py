"""Run a ``PlacedParameters`` region op by op, laid out as the plan's intra-op ILP chose.

Left to itself, DTensor picks each op's sharding greedily from the placements its inputs arrive in, which
is not the layout the ILP priced (for a mixture of experts it moved about three quarters of the planned
bytes, by different collectives).  Here the region's module is exported once per rank, on fake tensors
(``torch.export``, the route the planner traced it by, so its aten ops are the plan's ops in the same
order), and the exported graph is interpreted on the module's own DTensor parameters: before each op, every
tensor argument is redistributed to the placement the plan's ``op_strategies`` give it, and DTensor then
runs the op under the strategy those inputs select.  The collectives are therefore the ILP's edge
reshards, and autograd runs their transposes in the backward.

An op is written ``"aten.einsum.default: S(1), S(0) -> S(1)"``: its tensor arguments' placements on tp
(positional arguments, lists flattened, as the planner lists them), then its outputs'.  When the exported
graph does not list the plan's ops (a model file changed since planning, say), the region falls back to
DTensor's own choices and says so once per region type.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from autopar.fused_kernels import register_dtensor_rules, traced_as_fused_kernels
from autopar.hf_masks import is_transformers_object, repeated_kv_heads

log = logging.getLogger(__name__)

#: Ops that only check metadata the export saw (a dtype, say); under autocast they would fail, and they
#: compute nothing.
CHECK_OPS = frozenset({torch.ops.aten._assert_tensor_metadata.default})

_OP = re.compile(r"^\s*([\w.]+)\s*:\s*(.*?)\s*->\s*(.*?)\s*$")


@dataclass(frozen=True)
class PlannedOp:
    """One op of a region as the plan laid it out on tp."""

    op: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]

    @classmethod
    def parse(cls, text: str) -> PlannedOp:
        m = _OP.match(text)
        if not m:
            raise ValueError(f"not a planned op: {text!r} (expected 'aten.op.overload: IN, ... -> OUT, ...')")

        def side(s: str) -> tuple[str | None, ...]:
            return tuple(None if p in ("", "-") else p for p in (x.strip() for x in s.split(","))) if s else ()
        return cls(m.group(1), side(m.group(2)), side(m.group(3)))

    def source(self) -> str:
        inputs = ", ".join(p or "-" for p in self.inputs)
        outputs = ", ".join(p or "-" for p in self.outputs)
        return f"{self.op}: {inputs} -> {outputs}" if inputs else f"{self.op}: -> {outputs}"


def planned_op_source(op: str, inputs: Sequence[str | None], outputs: Sequence[str | None]) -> str:
    """A plan's op strategy as the one-line text a region takes (``PlannedOp.parse`` reads it back)."""
    return PlannedOp(op, tuple(inputs), tuple(outputs)).source()


def placement(text: str) -> Placement:
    """A plan placement (``R``, ``S(k)``, ``P``) as a DTensor placement."""
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    m = re.fullmatch(r"S\((-?\d+)\)", text)
    if not m:
        raise ValueError(f"unknown placement {text!r}")
    return Shard(int(m.group(1)))


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory)."""
    return _copy_with(module, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))


def _copy_with(module: nn.Module, make: Any, dtypes: Mapping[str, torch.dtype] | None = None) -> nn.Module:
    """A deep copy of ``module`` with every parameter and buffer replaced by ``make(global shape, dtype)``,
    in the dtype ``dtypes`` gives its name, else its own."""
    memo: dict[int, Any] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        local = t.to_local() if isinstance(t, DTensor) else t
        new = make(t.shape, (dtypes or {}).get(name, local.dtype))  # the global shape, for a DTensor
        memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(module, memo)


def _fake_empty(mode: FakeTensorMode, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype, device=device)


def _fake_like(x: Any, mode: FakeTensorMode, device: torch.device) -> Any:
    """A tensor argument (a DTensor by its global shape) as a fake tensor on ``device``; anything else as is."""
    if isinstance(x, torch.Tensor):
        local = x.to_local() if isinstance(x, DTensor) else x
        return _fake_empty(mode, x.shape, local.dtype, device)
    return x


def _signature(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    return (str(spec), tuple((tuple(x.shape), (x.to_local() if isinstance(x, DTensor) else x).dtype)
                             if isinstance(x, torch.Tensor) else x for x in leaves
                             if isinstance(x, (torch.Tensor, bool, int, float, str, type(None)))))


class RegionGraph:
    """A region's exported forward, interpreted with the plan's placements before each op."""

    def __init__(self, program: torch.export.ExportedProgram, ops: Sequence[PlannedOp]) -> None:
        self.program = program
        self.graph: fx.Graph = program.graph
        nodes = [n for n in self.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        self.planned: dict[fx.Node, PlannedOp] = dict(zip(nodes, ops))
        self.matches = len(nodes) == len(ops) and all(str(n.target) == o.op for n, o in zip(nodes, ops))

    def run(self, module: nn.Module, mesh: DeviceMesh, args: tuple, kwargs: dict) -> Any:
        sig = self.program.graph_signature
        user = iter(tree_flatten((args, kwargs))[0])
        env: dict[fx.Node, Any] = {}
        specs = {s.arg.name: s for s in sig.input_specs}
        for node in self.graph.nodes:
            if node.op == "placeholder":
                spec = specs[node.name]
                if spec.kind == InputKind.PARAMETER:
                    env[node] = module.get_parameter(spec.target)
                elif spec.kind == InputKind.BUFFER:
                    env[node] = module.get_buffer(spec.target)
                elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                    env[node] = self.program.constants[spec.target]
                else:
                    env[node] = next(user)
            elif node.op == "call_function":
                a, k = tree_map(lambda x: env[x] if isinstance(x, fx.Node) else x, (node.args, node.kwargs))
                if node.target in CHECK_OPS:
                    env[node] = None
                    continue
                planned = self.planned.get(node)
                if planned is not None:
                    a = _place_inputs(a, planned.inputs, mesh)
                env[node] = node.target(*a, **k)
            elif node.op == "output":
                outs = [env[x] if isinstance(x, fx.Node) else x for x in node.args[0]]
                mine = [o for o, s in zip(outs, sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
                return tree_unflatten(mine, self.program.call_spec.out_spec)
        raise AssertionError("an exported graph ends with its output node")


def _place_inputs(args: tuple, placements: Sequence[str | None], mesh: DeviceMesh) -> tuple:
    """``args`` with its tensor arguments (positional, lists flattened one level) laid out as planned."""
    wanted = iter(placements)

    def place(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        p = next(wanted, None)
        if p is None:
            return x
        target = placement(p)
        if target.is_partial():  # only DTensor makes a pending sum (of a replicated value, at no cost)
            return x
        if isinstance(x, DTensor) and any(isinstance(q, Partial) and q.reduce_op != "sum" for q in x.placements):
            # a pending mean (or max): the gradient of an explicit redistribution would come back as a
            # pending sum, which DTensor cannot turn into a pending mean; its op dispatch reduces it instead
            return x
        if not isinstance(x, DTensor):
            # a tensor made inside the region or passed by keyword (rotary tables): the same on every rank.
            # Made a DTensor here, not left to implicit replication, which the backward does not run under.
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if x.placements != (target,):
            # the redistribution's gradient comes back in the collective's layout: relaid for x's producer
            x = _relaid_in_backward(x).redistribute(mesh, [target])
        return _consistent(x)

    out = []
    for a in args:
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            out.append(type(a)(place(x) for x in a))
        else:
            out.append(place(a))
    return tuple(out)


def _consistent(x: DTensor) -> DTensor:
    """``x`` with its local tensor laid out in the dim order DTensor's own strides give.  A redistribution
    keeps the strides of a transposed view while the collective hands back a contiguous shard; the ops
    after it then disagree (a CPU attention kernel returns its output in its inputs' layout while DTensor,
    from the strides, expects the other), and a ``reshape`` that DTensor turns into a ``view`` fails."""
    local = x._local_tensor
    if any(st == 0 and n > 1 for st, n in zip(local.stride(), local.shape)):
        return x  # a broadcast view (``expand``): laid out as DTensor made it, and a copy would fill it out
    order = sorted(range(local.dim()), key=lambda d: (-x.stride()[d], d))  # outermost first
    if local.permute(order).is_contiguous():
        return x
    back = sorted(range(local.dim()), key=order.__getitem__)
    relaid = x.to_local().permute(order).contiguous().permute(back)  # differentiable, as every op here
    return DTensor.from_local(relaid, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=x.stride())


class _RelayGrad(torch.autograd.Function):
    """Identity forward; in backward, the gradient laid out in the dim order its DTensor strides give
    (``_consistent``): a redistribution's transpose in backward leaves the same mismatch as in forward, and
    the backward of a ``view`` before it then fails on it."""

    @staticmethod
    def forward(ctx: Any, x: DTensor) -> DTensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return _consistent(grad) if isinstance(grad, DTensor) else grad


def _relaid_in_backward(x: Any) -> Any:
    if isinstance(x, DTensor) and x.requires_grad and x.is_floating_point():
        return _RelayGrad.apply(x)
    return x


def _structure(module: nn.Module) -> tuple:
    """What an export of ``module`` depends on besides its inputs: classes, tensor shapes, plain attributes."""
    parts = []
    for name, mod in module.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(mod).items()
                             if isinstance(v, (bool, int, float, str)) and k != "training"))
        tensors = tuple((k, tuple(t.shape), str(t.dtype)) for k, t in [*mod.named_parameters(recurse=False),
                                                                     *mod.named_buffers(recurse=False)])
        parts.append((name, type(mod).__qualname__, plain, tensors))
    return tuple(parts)


@contextlib.contextmanager
def _attention_as_traced(module: nn.Module):
    """Export a HuggingFace attention region down the path the planner's whole-model export took.

    The planner's export repeats the key/value heads before attention (``repeat_kv``, ``autopar.hf_masks``), which
    splits them evenly over tp whatever their number.  A region exported alone gets no mask (run eagerly,
    HuggingFace skips it), and the integration would then pass ``enable_gqa`` to attention instead: other ops
    than the plan's.  Both compute the same; this keeps the plan's."""
    if not is_transformers_object(module):
        yield
        return
    with repeated_kv_heads():
        yield


#: Exported region graphs, shared by the identical regions of a layer stack (one export per rank and type).
_GRAPHS: dict[tuple, RegionGraph | None] = {}


class PlannedRegion:
    """Exports a region's module lazily (per call signature and training mode) and runs it as planned."""

    def __init__(self, module: nn.Module, ops: Sequence[PlannedOp]) -> None:
        self.shadow = meta_copy(module)
        self.ops = tuple(ops)
        self.structure = _structure(self.shadow)
        self.name = type(module).__name__

    def graph_for(self, module: nn.Module, args: tuple, kwargs: dict) -> RegionGraph | None:
        """The graph of a call of ``module`` (the live region) on ``args``: exported with the parameters
        in the dtype they have now (FSDP2's mixed precision hands the forward bf16 ones)."""
        dtypes = {name: (p.to_local() if isinstance(p, DTensor) else p).dtype for name, p in module.named_parameters()}
        key = (self.structure, self.ops, module.training, tuple(sorted((k, str(v)) for k, v in dtypes.items())),
               _signature(args, kwargs))
        if key not in _GRAPHS:
            _GRAPHS[key] = self._export(module.training, dtypes, args, kwargs)
        return _GRAPHS[key]

    def _export(self, training: bool, dtypes: Mapping[str, torch.dtype], args: tuple,
                kwargs: dict) -> RegionGraph | None:
        device = next((x.device for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
        mode = FakeTensorMode()
        shadow = _copy_with(self.shadow, lambda shape, dtype: _fake_empty(mode, shape, dtype, device), dtypes)
        shadow.train(training)
        fake_args, fake_kwargs = tree_map(lambda x: _fake_like(x, mode, device), (args, kwargs))
        autocast = contextlib.nullcontext()
        if torch.is_autocast_enabled(device.type):  # export as the call runs: the op dtypes follow autocast
            autocast = torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type))
        try:
            # identity hooks: an activation checkpoint running around this first call must not count the
            # trace's tensors as saved by the forward (its recomputation finds the graph made and saves fewer)
            with autocast, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                    _attention_as_traced(shadow), traced_as_fused_kernels():
                program = torch.export.export(shadow, fake_args, fake_kwargs, strict=False)
        except Exception as exc:  # any export failure: the region still runs, by DTensor's own rules
            log.warning("autopar: %s could not be exported (%s); it runs by DTensor's own sharding choices, "
                        "not the plan's", self.name, exc)
            return None
        register_dtensor_rules()  # the fused kernels the export traced (Mamba's scan) run on DTensors
        graph = RegionGraph(program, self.ops)
        if not graph.matches:
            log.warning("autopar: %s's ops differ from the plan's; it runs by DTensor's own sharding choices",
                        self.name)
            return None
        return graph
