"""The plan's ``tp`` placements as torch's ``parallelize_module`` styles.

A plan's parameter placements on ``tp`` map onto module styles when they follow Megatron's pattern:

- a Linear whose weight is ``S(0)`` (output features) is ``ColwiseParallel``: its output stays a local
  shard, which the next Linear consumes;
- a Linear whose weight is ``S(1)`` (input features) is ``RowwiseParallel``: its output is all-reduced;
  unless a column-parallel Linear of the same parent module feeds it (Megatron's pair), its input is a
  whole replicated activation (the head after the final norm), which it slices itself;
- an Embedding whose weight is ``S(0)`` (vocabulary) is ``RowwiseParallel`` (vocab-parallel lookup);
  ``S(1)`` is ``ColwiseParallel`` with the hidden dim gathered;
- the output head (a column-parallel Linear nobody consumes) gathers its logits for the loss.

Any other sharded parameter (stacked expert weights sharded on the expert dimension, say) makes its
module a ``PlacedParameters`` region: its parameters become DTensors with the plan's placements, its
inputs replicated DTensors, and DTensor's own sharding rules run every op inside, redistributing where
an op needs it; the output is made whole (replicated) again.  Such a region must not contain a module
with a style of its own.

When *all* parameters are replicated, the plan uses the ``tp`` axis for the batch (the ILP found that
cheaper), and the runtime runs that axis as data parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils._pytree import tree_map

from autopar.errors import AutoparError
from autopar.plan import Plan


def _fed_by_column_parallel(name: str, linears: list[tuple[str, nn.Module]], placement: dict[str, str]) -> bool:
    """Whether the Linear registered just before ``name``, under the same parent, is column-parallel."""
    names = [n for n, _ in linears]
    i = names.index(name)
    if i == 0:
        return False
    prev = names[i - 1]
    return prev.rpartition(".")[0] == name.rpartition(".")[0] and placement.get(f"{prev}.weight") == "S(0)"


StyleSpec = tuple[str, dict[str, str]]  # ("ColwiseParallel", {"output_layouts": "Replicate()"})


def tp_styles(plan: Plan, model: nn.Module) -> dict[str, ParallelStyle] | None:
    """``parallelize_module`` plan for ``model``; ``None`` when every parameter is replicated on tp."""
    specs = tp_style_specs(plan, model)
    return None if specs is None else {name: make_style(spec) for name, spec in specs.items()}


def placement_source(plan_placement: str) -> str:
    """A plan placement (``R``, ``S(k)``) as DTensor source code (``Replicate()``, ``Shard(k)``)."""
    return "Replicate()" if plan_placement == "R" else plan_placement.replace("S(", "Shard(")


def make_placement(source: str) -> Placement:
    if source == "Replicate()":
        return Replicate()
    if source.startswith("Shard(") and source.endswith(")") and source[6:-1].isdigit():
        return Shard(int(source[6:-1]))
    raise AutoparError(f"placement {source!r} is neither Replicate() nor Shard(k)")


def make_style(spec: StyleSpec) -> ParallelStyle:
    kind, kwargs = spec
    cls = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
           "PlacedParameters": PlacedParameters}[kind]
    return cls(**{k: make_placement(v) for k, v in kwargs.items()})


class PlacedParameters(ParallelStyle):
    """Parameters as DTensors with the given placements (keyword per parameter name; others replicated).

    Inputs enter as replicated DTensors, DTensor's sharding rules run the module's ops (plain tensors made
    inside, such as ``torch.arange``, count as replicated), and outputs leave whole and local.
    """

    def __init__(self, **placements: Placement) -> None:
        super().__init__()
        self.placements = placements

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            where = self.placements.get(f"{name}.{pname}" if name else pname, Replicate())
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [where])))

    @staticmethod
    def _inputs(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        def to_dtensor(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return x
        return tree_map(to_dtensor, args)

    @staticmethod
    def _outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        def to_local(x: Any) -> Any:
            return x.redistribute(mesh, [Replicate()]).to_local() if isinstance(x, DTensor) else x
        return tree_map(to_local, outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            with implicit_replication():
                return inner(*args, **kwargs)

        module.forward = forward
        return module


def tp_style_specs(plan: Plan, model: nn.Module) -> dict[str, StyleSpec] | None:
    """The styles as plain data (also what generated scripts print); ``None`` when all is replicated."""
    placement = {fqn: p["placements"].get("tp", "R") for fqn, p in plan.parameters.items()}
    for fqn, p in plan.parameters.items():
        for alias in p.get("aliases", []):
            placement[alias] = placement[fqn]
    if all(v == "R" for v in placement.values()):
        return None
    styles: dict[str, StyleSpec] = {}
    handled: set[str] = set()
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    last_linear = linears[-1][0] if linears else None
    for name, mod in model.named_modules():
        wname = f"{name}.weight" if name else "weight"
        w = placement.get(wname)
        if w is None or w == "R":
            continue
        if isinstance(mod, nn.Linear):
            if w == "S(0)":
                gather = name == last_linear  # the head: the loss needs whole logits
                styles[name] = ("ColwiseParallel", {"output_layouts": "Replicate()"} if gather else {})
            elif w == "S(1)":
                local = _fed_by_column_parallel(name, linears, placement)
                styles[name] = ("RowwiseParallel", {} if local else {"input_layouts": "Replicate()"})
        elif isinstance(mod, nn.Embedding):
            if w == "S(0)":
                styles[name] = ("RowwiseParallel", {"input_layouts": "Replicate()"})
            elif w == "S(1)":
                styles[name] = ("ColwiseParallel", {"input_layouts": "Replicate()", "output_layouts": "Replicate()"})
        if name in styles:
            handled.update(f"{name}.{p}" if name else p for p, _ in mod.named_parameters(recurse=False))
    present = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a pipeline stage holds a part
    unhandled = sorted(f for f, v in placement.items() if v != "R" and f not in handled and f in present)
    for fqn in unhandled:
        owner, _, pname = fqn.rpartition(".")
        clash = [s for s in styles if s != owner and (_inside(s, owner) or _inside(owner, s))]
        if clash or (owner in styles and styles[owner][0] != "PlacedParameters"):
            raise AutoparError(f"the plan shards {fqn} as {placement[fqn]} on tp inside a region that also holds "
                               f"the {(clash or [owner])[0]!r} style; mixing them is not supported")
        styles.setdefault(owner, ("PlacedParameters", {}))[1][pname] = placement_source(placement[fqn])
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(styles.items(), key=lambda item: order[item[0]]))


def _inside(name: str, region: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``region`` (the root holds everything)."""
    return name != region and (region == "" or name.startswith(region + "."))
