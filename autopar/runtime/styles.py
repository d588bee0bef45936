"""Parallel styles as plain data, and the two styles torch does not have.

A style is written as a ``StyleSpec``: the class name and its keyword arguments as Python source
(``("RowwiseParallel", {"output_layouts": "Shard(1)"})``).  Generated scripts print the source as is;
the runtime builds the style from it with a small evaluator that accepts only placements
(``Replicate()``, ``Shard(k)``), ``None``, booleans, integers, strings, and tuples and str-keyed dicts of those,
so nothing from a plan file is ever executed.
"""

from __future__ import annotations

import ast
import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils._pytree import tree_map

from autopar.conv_channels import install_dtensor_handlers
from autopar.errors import AutoparError
from autopar.runtime.region_graph import PlannedOp, PlannedRegion

StyleSpec = tuple[str, dict[str, str]]


@functools.cache  # register once per process
def register_cpu_attention_rules() -> None:
    """Sharding rules for the CPU flash-attention kernels, which DTensor has only for CUDA's.

    Batch (dim 0) or heads (dim 1) split the same way on every input and output, or nothing is split;
    the same as DTensor's rules for ``_scaled_dot_product_flash_attention`` on CUDA.
    """
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    tail = [None, None, None, None]  # dropout_p, is_causal, attn_mask, scale

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward_rule(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> list:
        return [([p, p], [p, p, p, *tail]) for p in (Replicate(), Shard(0), Shard(1))]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward_rule(grad: Any, query: Any, key: Any, value: Any, out: Any, lse: Any, *args: Any,
                      **kwargs: Any) -> list:
        return [([p, p, p], [p, p, p, p, p, p, *tail]) for p in (Replicate(), Shard(0), Shard(1))]


class PlacedParameters(ParallelStyle):
    """Parameters as DTensors with the given placements (by name inside the module; others replicated).

    Inputs enter as DTensors (local tensors read as ``input_layouts``, then made whole), and outputs leave
    as local tensors laid out as ``output_layouts``.  Inside, with ``ops`` (the plan's op strategies, one
    line per op, ``autopar.runtime.region_graph``) every op's inputs are first laid out as the plan chose;
    without, DTensor's sharding rules choose (plain tensors made inside, such as ``torch.arange``, count as
    replicated).
    """

    def __init__(self, placements: dict[str, Placement], *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, ops: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()
        self.placements = dict(placements)
        self.ops = tuple(PlannedOp.parse(op) for op in ops)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            where = self.placements.get(f"{name}.{pname}" if name else pname, Replicate())
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [where])))

    def _whole(self, x: Any, mesh: DeviceMesh) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layouts], run_check=False)
        return x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor) else x

    def _inputs(self, module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tree_map(lambda x: self._whole(x, mesh), args)

    def _outputs(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        def to_local(x: Any) -> Any:
            return x.redistribute(mesh, [self.output_layouts]).to_local() if isinstance(x, DTensor) else x
        return tree_map(to_local, outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.device_type == "cpu":
            register_cpu_attention_rules()
        install_dtensor_handlers()  # convolutions split on their channels, as the planner prices them
        planned = PlannedRegion(module, self.ops) if self.ops else None  # a meta copy, before distribution
        activation = next(iter(inspect.signature(module.forward).parameters), None)
        distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not args and activation in kwargs:  # the activation by name (HuggingFace's hidden_states=)
                kwargs = {**kwargs, activation: self._whole(kwargs[activation], device_mesh)}
            with implicit_replication():
                graph = planned.graph_for(module, args, kwargs) if planned is not None else None
                if graph is None:
                    return inner(*args, **kwargs)
                return graph.run(module, device_mesh, args, kwargs)

        module.forward = forward
        return module


class PrepareActivation(ParallelStyle):
    """Re-lay a module's activation: its first argument (passed by position or by name) and/or its output.

    Local tensors are read as ``input_layouts`` (``output_layouts``) and leave, local again, laid out as
    ``desired_input_layouts`` (``desired_output_layouts``).  With ``use_local_output=False`` the input
    enters the module as a DTensor instead: the column-parallel Linears that share it (q, k and v) then
    take it as it is, and their input gradients add up as one pending sum that is reduced once (a
    reduce-scatter back to the sequence shards, or one all-reduce), as in Megatron-LM.

    Unlike ``PrepareModuleInput`` it needs no layout for the module's other arguments, and it finds the
    activation whether the caller passes it by position (``block(x, cos, sin)``) or by keyword
    (HuggingFace's ``self_attn(hidden_states=...)``).
    """

    def __init__(self, *, input_layouts: Placement | None = None, desired_input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, desired_output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts, self.desired_input_layouts = input_layouts, desired_input_layouts
        self.output_layouts, self.desired_output_layouts = output_layouts, desired_output_layouts
        self.use_local_output = use_local_output

    @staticmethod
    def _relayout(x: Any, have: Placement, want: Placement, mesh: DeviceMesh, local: bool = True) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [have], run_check=False)
        x = x.redistribute(mesh, [want])
        return x.to_local() if local else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = next(iter(inspect.signature(module.forward).parameters), None)  # what the activation is called

        def prepare_input(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            have, want, local = self.input_layouts, self.desired_input_layouts, self.use_local_output
            if args:
                return (self._relayout(args[0], have, want, device_mesh, local), *args[1:]), kwargs
            if name is not None and name in kwargs:
                return args, {**kwargs, name: self._relayout(kwargs[name], have, want, device_mesh, local)}
            return args, kwargs

        def prepare_output(mod: nn.Module, args: tuple, output: Any) -> Any:
            return self._relayout(output, self.output_layouts, self.desired_output_layouts, device_mesh)

        if self.input_layouts is not None:
            module.register_forward_pre_hook(prepare_input, with_kwargs=True)
        if self.output_layouts is not None:
            module.register_forward_hook(prepare_output)
        return module


STYLE_CLASSES: dict[str, type[ParallelStyle]] = {cls.__name__: cls for cls in (
    ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput,
    PrepareModuleInputOutput, PlacedParameters, PrepareActivation)}
PLACEMENTS = {"Replicate": Replicate, "Shard": Shard}


def placement_source(plan_placement: str) -> str:
    """A plan placement (``R``, ``S(k)``) as DTensor source code (``Replicate()``, ``Shard(k)``)."""
    return "Replicate()" if plan_placement == "R" else plan_placement.replace("S(", "Shard(")


def evaluate(source: str) -> Any:
    """The value of a style argument's source: placements, ``None``, bools, ints, strs, tuples, str-keyed dicts."""
    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, str))):
            return node.value
        if isinstance(node, ast.Tuple):
            return tuple(value(e) for e in node.elts)
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                              for k in node.keys):
            return {k.value: value(v) for k, v in zip(node.keys, node.values)}
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PLACEMENTS
                and not node.keywords):
            return PLACEMENTS[node.func.id](*(value(a) for a in node.args))
        raise AutoparError(f"style argument {source!r} is not a placement, tuple, dict, str, bool, int or None")
    try:
        return value(ast.parse(source, mode="eval").body)
    except SyntaxError as exc:
        raise AutoparError(f"style argument {source!r} is not valid Python") from exc


def make_style(spec: StyleSpec) -> ParallelStyle:
    kind, kwargs = spec
    if kind not in STYLE_CLASSES:
        raise AutoparError(f"unknown parallel style {kind!r}")
    return STYLE_CLASSES[kind](**{k: evaluate(v) for k, v in kwargs.items()})


def style_source(spec: StyleSpec) -> str:
    """The style as a constructor call (what generated scripts print)."""
    kind, kwargs = spec
    return f"{kind}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
