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

Every other parameter must be replicated on ``tp``.  When *all* parameters are replicated, the plan uses
the ``tp`` axis for the batch (the ILP found that cheaper), and the runtime runs that axis as data
parallelism.  Anything else is refused with a clear error: it needs per-op DTensor redistribution,
which is not implemented yet.
"""

from __future__ import annotations

from typing import Any

from torch import nn

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


StyleSpec = tuple[str, dict[str, str]]  # ("ColwiseParallel", {"output_layouts": "Replicate"})


def tp_styles(plan: Plan, model: nn.Module) -> dict[str, Any] | None:
    """``parallelize_module`` plan for ``model``; ``None`` when every parameter is replicated on tp."""
    specs = tp_style_specs(plan, model)
    return None if specs is None else {name: make_style(spec) for name, spec in specs.items()}


def make_style(spec: StyleSpec) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind, kwargs = spec
    cls = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel}[kind]
    return cls(**{k: Replicate() for k in kwargs})


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
                styles[name] = ("ColwiseParallel", {"output_layouts": "Replicate"} if gather else {})
            elif w == "S(1)":
                local = _fed_by_column_parallel(name, linears, placement)
                styles[name] = ("RowwiseParallel", {} if local else {"input_layouts": "Replicate"})
        elif isinstance(mod, nn.Embedding):
            if w == "S(0)":
                styles[name] = ("RowwiseParallel", {"input_layouts": "Replicate"})
            elif w == "S(1)":
                styles[name] = ("ColwiseParallel", {"input_layouts": "Replicate", "output_layouts": "Replicate"})
        if name in styles:
            handled.update(f"{name}.{p}" if name else p for p, _ in mod.named_parameters(recurse=False))
    present = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a pipeline stage holds a part
    unhandled = sorted(f for f, v in placement.items() if v != "R" and f not in handled and f in present)
    if unhandled:
        raise AutoparError(f"the plan shards {unhandled[0]} as {placement[unhandled[0]]} on tp, which no "
                           "parallelize_module style expresses; per-op DTensor redistribution is not implemented yet")
    return styles
