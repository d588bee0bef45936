"""The plan's ``tp`` placements as torch's ``parallelize_module`` styles.

A plan's parameter placements on ``tp`` map onto module styles when they follow Megatron's pattern:

- a Linear whose weight is ``S(0)`` (output features) is ``ColwiseParallel``: its output stays a local
  shard, which the next Linear consumes;
- a Linear whose weight is ``S(1)`` (input features) is ``RowwiseParallel``: its output is all-reduced;
  unless a column-parallel Linear of the same parent module feeds it (Megatron's pair), its input is a
  whole replicated activation (the head after the final norm), which it slices itself;
- an Embedding whose weight is ``S(0)`` (vocabulary) is ``RowwiseParallel`` (vocab-parallel lookup);
  ``S(1)`` is ``ColwiseParallel`` with the hidden dim gathered;
- the output head (a column-parallel Linear nobody consumes) keeps its logits sharded on the vocabulary
  (a DTensor) for the model file's default loss, which then runs under ``loss_parallel``: the logits are
  never gathered.  A model file's own ``loss_fn`` may do anything to the logits, so there the head gathers
  them.

Any other sharded parameter (stacked expert weights sharded on the expert dimension, say) makes its
module (for stacked experts in a block: the block's child holding them; for a convolution split on its
channels: the module calling it, ``autopar.conv_channels.conv_region``) a ``PlacedParameters`` region
(``autopar.runtime.styles``): its parameters become DTensors with
the plan's placements, its inputs whole DTensors, and every op inside runs on inputs laid out as the
plan's ``op_strategies`` say (``region_ops``, ``autopar.runtime.region_graph``); the output leaves whole
(or sequence-split, with sp) and local.
Such a region must not contain a module with a style of its own.

With sequence parallelism (``sp``) the residual stream between the tensor-parallel regions of the block
stack is split on the sequence, as in Megatron-LM (see ``_sequence_parallel``).

When *all* parameters are replicated, the plan uses the ``tp`` axis for the batch (the ILP found that
cheaper), and the runtime runs that axis as data parallelism.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from autopar import modelfile
from autopar.conv_channels import CONV_MODULE_TYPES, conv_region
from autopar.errors import AutoparError
from autopar.ir import stack_prefixes
from autopar.plan_file import Plan
from autopar.runtime.region_graph import planned_op_source
from autopar.runtime.styles import StyleSpec, make_style, placement_source


def _fed_by_column_parallel(name: str, linears: list[tuple[str, nn.Module]], placement: dict[str, str]) -> bool:
    """Whether the Linear registered just before ``name``, under the same parent, is column-parallel."""
    names = [n for n, _ in linears]
    i = names.index(name)
    if i == 0:
        return False
    prev = names[i - 1]
    return prev.rpartition(".")[0] == name.rpartition(".")[0] and placement.get(f"{prev}.weight") == "S(0)"


def tp_styles(plan: Plan, model: nn.Module) -> dict[str, ParallelStyle] | None:
    """``parallelize_module`` plan for ``model``; ``None`` when every parameter is replicated on tp."""
    specs = tp_style_specs(plan, model)
    return None if specs is None else {name: make_style(spec) for name, spec in specs.items()}


#: The head's style under ``loss_parallel``: its output stays a DTensor sharded on the vocabulary.
LOSS_PARALLEL_HEAD: StyleSpec = ("ColwiseParallel", {"use_local_output": "False"})


def runs_loss_parallel(specs: dict[str, StyleSpec] | None) -> bool:
    """Whether the loss must run under ``torch.distributed.tensor.parallel.loss_parallel``."""
    return bool(specs) and LOSS_PARALLEL_HEAD in specs.values()


def default_loss(plan: Plan) -> bool:
    """Whether the plan's model file trains with autopar's default loss (no ``loss_fn`` of its own)."""
    module = modelfile.load_for(plan.model)
    return getattr(module, "loss_fn", None) is None


def tp_style_specs(plan: Plan, model: nn.Module) -> dict[str, StyleSpec] | None:
    """The styles as plain data (also what generated scripts print); ``None`` when all is replicated."""
    # expert-parallel experts are laid out on tp by their own style (``autopar.runtime.expert_parallel``)
    placement = {fqn: p["placements"].get("tp", "R") for fqn, p in plan.parameters.items()
                 if p["placements"].get("ep", "R") == "R"}
    for fqn, p in plan.parameters.items():
        for alias in p.get("aliases", []):
            placement[alias] = placement[fqn]
    if all(v == "R" for v in placement.values()):
        return None
    styles: dict[str, StyleSpec] = {}
    handled: set[str] = set()
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    last_linear = linears[-1][0] if linears else None
    sharded_loss = default_loss(plan)
    for name, mod in model.named_modules():
        wname = f"{name}.weight" if name else "weight"
        w = placement.get(wname)
        if w is None or w == "R":
            continue
        if isinstance(mod, nn.Linear):
            if w == "S(0)":
                if name != last_linear:
                    styles[name] = ("ColwiseParallel", {})
                elif sharded_loss:  # the head, for a loss that runs under loss_parallel
                    styles[name] = LOSS_PARALLEL_HEAD
                else:  # the head, for a loss of the model file's own: whole logits
                    styles[name] = ("ColwiseParallel", {"output_layouts": "Replicate()"})
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
    regions = _mixed_regions(model, styles)
    stacks = stack_prefixes(name for name, _ in model.named_modules())
    regions += sorted({conv_region(name, stacks) for name, mod in model.named_modules()
                       if type(mod).__name__ in CONV_MODULE_TYPES and placement.get(f"{name}.weight", "R") != "R"}
                      - set(regions))
    experts = set(plan.model.get("expert_weights", ()))
    for region in regions:  # DTensor runs the whole module: drop the styles inside it
        for name in [s for s in styles if _inside(s, region)]:
            del styles[name]
    placed: dict[str, dict[str, str]] = {}
    for fqn in sorted(f for f, v in placement.items() if v != "R" and f in present):
        owner = next((r for r in regions if _inside(fqn, r)), None)
        if owner is None and fqn in handled:
            continue
        stacked = fqn in experts  # a MoE layer's stacked experts: the region is the whole layer
        owner = owner if owner is not None else _region_of(fqn, plan.model.get("layer_container") if stacked else None)
        clash = [s for s in styles if s != owner and (_inside(s, owner) or _inside(owner, s))]
        if clash or owner in styles:
            raise AutoparError(f"the plan shards {fqn} as {placement[fqn]} on tp inside a region that also holds "
                               f"the {(clash or [owner])[0]!r} style; mixing them is not supported")
        placed.setdefault(owner, {})[fqn[len(owner) + 1:] if owner else fqn] = placement_source(placement[fqn])
    for owner, params in placed.items():
        body = ", ".join(f"{name!r}: {where}" for name, where in sorted(params.items()))
        styles[owner] = ("PlacedParameters", {"placements": "{" + body + "}"})
        ops = region_ops(plan, owner)
        if ops:
            styles[owner][1]["ops"] = repr(ops)
    if plan.layout.get("sp"):
        _sequence_parallel(styles, model, plan)
    else:
        _shared_region_inputs(styles, model, plan)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(styles.items(), key=lambda item: order[item[0]]))


def _region_of(fqn: str, container: str | None) -> str:
    """The module that runs a placed parameter as one region: for stacked experts inside a block
    (``container`` given), the block's child that holds them (the whole MoE layer, so that the routing runs
    in the region too), else the parameter's own module."""
    if container and fqn.startswith(container + "."):
        parts = fqn[len(container) + 1:].split(".")
        if len(parts) > 2:
            return ".".join([container, *parts[:2]])
    return fqn.rpartition(".")[0]


def region_ops(plan: Plan, region: str) -> tuple[str, ...]:
    """The plan's op strategies on tp for the ops of module ``region``, in graph order, as the one-line
    texts ``PlacedParameters(ops=...)`` takes (``autopar.runtime.region_graph``).

    The plan lists the ops of the first layer of each type; a region in a later layer takes its own
    type's.  Empty for a plan that does not record the ops' order.
    """
    container = plan.model.get("layer_container")
    planned = region
    if container and region.startswith(container + "."):
        index, _, rest = region[len(container) + 1:].partition(".")
        if index.isdigit():
            units, first = plan.model.get("units", []), plan.model.get("layer_types", {})
            rep = first.get(units[int(index)]) if int(index) < len(units) else None
            if rep is None:
                return ()
            planned = f"{container}.{rep}" + (f".{rest}" if rest else "")
    entries = [e for e in plan.op_strategies.values() if _covers(planned, e.get("module", ""))]
    if not entries or any("order" not in e for e in entries):
        return ()
    entries.sort(key=lambda e: e["order"])
    return tuple(planned_op_source(e["op"], e["tp"]["inputs"], e["tp"]["outputs"]) for e in entries)


def _mixed_regions(model: nn.Module, styles: dict[str, StyleSpec]) -> list[str]:
    """Modules whose Linears start a Megatron pair but do not finish one cleanly.

    A module with a column-parallel Linear (local output) is a clean pair when every Linear directly in it
    has a style and a row-parallel one reads the local shards back.  Anything else (say q column-parallel,
    k and v replicated, the layout the ILP picks for GQA when tp exceeds the KV heads; or a module whose own
    code reads whole channels, ``_works_on_whole_channels``) would feed shards to code that expects whole
    tensors, so the whole module runs as one ``PlacedParameters`` region.
    """
    mixed = []
    for name, mod in model.named_modules():
        linears = [f"{name}.{c}" if name else c for c, child in mod.named_children() if isinstance(child, nn.Linear)]
        starts = [n for n in linears if styles.get(n) == ("ColwiseParallel", {})]
        if not starts:
            continue
        ends = [n for n in linears if styles.get(n) == ("RowwiseParallel", {})]
        if (not ends or any(n not in styles for n in linears) or len(starts) + len(ends) != len(linears)
                or _works_on_whole_channels(mod)):
            mixed.append(name)
    return mixed


def _works_on_whole_channels(module: nn.Module) -> bool:
    """Whether code between a module's Linears reads whole channels: a convolution, or parameters of the module's
    own (Mamba's mixer: its depthwise ``conv1d``, ``A_log`` and ``D`` over all ``d_inner`` channels), which
    column-parallel shards would not match."""
    if any(True for _ in module.parameters(recurse=False)):
        return True
    return any(isinstance(child, nn.modules.conv._ConvNd) for child in module.children())


def _inside(name: str, region: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``region`` (the root holds everything)."""
    return name != region and (region == "" or name.startswith(region + "."))


def _covers(region: str, name: str) -> bool:
    return name == region or _inside(name, region)


def _ancestors(name: str) -> list[str]:
    """``name`` and every module that holds it, innermost last (``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``; the root
    ``""`` holds everything)."""
    parts = name.split(".") if name else []
    return ["", *(".".join(parts[:k]) for k in range(1, len(parts) + 1))]


def _is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and their look-alikes (``LlamaRMSNorm``): they act on each token alone."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _pair_regions(styles: dict[str, StyleSpec], blocks: list[str]) -> set[str]:
    """The parents of the Megatron pairs inside the blocks (a row-parallel Linear reading local shards)."""
    return {name.rpartition(".")[0] for name, (kind, kwargs) in styles.items()
            if kind == "RowwiseParallel" and "input_layouts" not in kwargs and any(_covers(b, name) for b in blocks)}


def _shared_region_inputs(styles: dict[str, StyleSpec], model: nn.Module, plan: Plan) -> None:
    """Without sequence parallelism: each Megatron pair's parent takes its input as one replicated DTensor
    (``PrepareActivation(use_local_output=False)``), so that q, k and v share it and their input gradients
    are all-reduced once, not once each."""
    container = plan.model.get("layer_container")
    if not container:
        return
    blocks = [f"{container}.{key}" for key, _ in model.get_submodule(container).named_children()]
    for region in sorted(_pair_regions(styles, blocks) - set(blocks)):
        if region not in styles:
            styles[region] = ("PrepareActivation", {"input_layouts": "Replicate()",
                                                    "desired_input_layouts": "Replicate()",
                                                    "use_local_output": "False"})


def _sequence_parallel(styles: dict[str, StyleSpec], model: nn.Module, plan: Plan) -> None:
    """Megatron sequence parallelism inside the block stack, on top of the tensor-parallel styles.

    Between the tensor-parallel regions the residual stream is split on the sequence (dim 1): the first
    block of the stack slices its input, the last gathers its output.  A Megatron pair's row-parallel
    Linear reduce-scatters (``output_layouts=Shard(1)``) instead of all-reducing, and the pair's parent
    module all-gathers its input (``PrepareActivation``).  The norms run on the sequence shards as
    ``SequenceParallel``, which keeps their parameters replicated DTensors so that their gradients are
    summed over tp.  Any other module with parameters outside the regions could mix tokens (attention
    kept replicated, say), so it is refused rather than run on a slice of the sequence.
    """
    container, tp = plan.model.get("layer_container"), plan.layout["tp"]
    if not container:
        raise AutoparError("sequence parallelism (sp=on) needs a block stack; plan with --fix sp=off")
    if plan.seq_len % tp:
        raise AutoparError(f"sequence parallelism needs the sequence length ({plan.seq_len}) divisible by tp ({tp})")
    blocks = [f"{container}.{key}" for key, _ in model.get_submodule(container).named_children()]
    if not blocks:
        return

    block_set = set(blocks)

    def in_blocks(name: str) -> bool:
        return any(prefix in block_set for prefix in _ancestors(name))

    regions: set[str] = set()
    for name, (kind, kwargs) in styles.items():
        if not in_blocks(name):
            continue
        if kind == "RowwiseParallel" and "input_layouts" not in kwargs:  # the end of a Megatron pair
            kwargs["output_layouts"] = "Shard(1)"
            regions.add(name.rpartition(".")[0])
        elif kind == "PlacedParameters":
            kwargs.update(input_layouts="Shard(1)", output_layouts="Shard(1)")
        elif not (kind == "ColwiseParallel" and not kwargs):  # a pair's start reads its region's input
            raise AutoparError(f"sequence parallelism cannot lay out {name} ({kind}); plan with --fix sp=off")
    if regions & set(blocks) or set(styles) & set(blocks):
        raise AutoparError("sequence parallelism needs the tensor-parallel Linears inside a submodule of each "
                           "block; plan with --fix sp=off")
    for region in sorted(regions):
        styles[region] = ("PrepareActivation", {"input_layouts": "Shard(1)", "desired_input_layouts": "Replicate()",
                                                "use_local_output": "False"})
    covered = set(styles)
    holding = {prefix for c in covered for prefix in _ancestors(c) if prefix != c}  # modules with a region inside
    for name, mod in model.named_modules():
        if not in_blocks(name) or next(mod.parameters(recurse=False), None) is None:
            continue
        if any(prefix in covered for prefix in _ancestors(name)):
            continue
        if name in holding:
            raise AutoparError(f"sequence parallelism: {name} holds parameters and contains a tensor-parallel "
                               "region; plan with --fix sp=off")
        if not _is_norm(mod):  # only token-wise modules may see a slice of the sequence
            raise AutoparError(f"sequence parallelism would run {name} ({type(mod).__name__}) on a slice of the "
                               "sequence outside any tensor-parallel region; plan with --fix sp=off")
        styles[name] = ("SequenceParallel", {"use_local_output": "True"})
    first, last = blocks[0], blocks[-1]
    styles[first] = ("PrepareActivation", {"input_layouts": "Replicate()", "desired_input_layouts": "Shard(1)"})
    leave = {"output_layouts": "Shard(1)", "desired_output_layouts": "Replicate()"}
    styles[last] = ("PrepareActivation", {**styles[last][1], **leave} if last == first else leave)
