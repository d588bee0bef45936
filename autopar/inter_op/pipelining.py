"""Pipeline parallelism's rules: which schedules, chunk counts and micro-batch groups run, as one source for the
search's space (``search.layouts``) and for the errors of pinned values (``search.check_fixed``).

- GPipe, and 1F1B with at least as many micro-batches as stages (torch's ``Schedule1F1B`` requires it);
- interleaved 1F1B with ``v`` in {2, 4, 8} (any ``v`` when pinned) wherever ``ScheduleInterleaved1F1B`` accepts it
  (``m`` a multiple of ``max(1, m // pp)``) and every stage holds ``v`` chunks (the layers need not divide
  ``pp * v``; the end stages may hold one layer fewer), in torch's rounds or, where the framework tunes them, in
  groups of ``N`` micro-batches (``group_runs``);
- the zero-bubble schedules: ``interleaved_zb`` (``v`` in {1, 2, 4, 8}, the same rule), ``zbv`` and ``dualpipev``
  (two chunks per rank in a V: ``v = 2``, at least ``2 pp`` layers; ``dualpipev`` also ``m >= 2 pp``); they split
  the backward into two autograd passes, which per-op checkpointing refuses, and run each weight step after ZeRO-3
  resharded its block, and whose weight steps cannot run a weight's output that several layers read (what the
  stack's loop hands from layer to layer: T5's relative position bias) (``schedule_refuses``);
- with one stage there is no pipeline: the schedules coincide.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import AxisLink, Cluster
from autopar.collectives import all_gather_s, send_recv_s
from autopar.errors import AutoparError
from autopar.framework import Framework
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.links import Links
from autopar.inter_op.technique import (
    Partial,
    SearchSpace,
    Technique,
    UnitLoadDraft,
    UnitTotals,
    check_divides,
    divisors,
)
from autopar.inter_op.unit_costs import UnitCost
from autopar.inter_op.units import unit_chain
from autopar.ir import OpGraph, Ref, tensor_refs
from autopar.passes.activations import storage_key
from autopar.passes.context import PassContext
from autopar.solvers.pipeline import (
    MULTI_CHUNK,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    bubble_s,
    in_flight_microbatches,
    simulate_pipeline,
    split_fraction,
    splits_backward,
)

INTERLEAVE_V = (2, 4, 8)


def interleaving_runs(pp: int, m: int, layers: int, v: int) -> bool:
    """Whether torch's ``ScheduleInterleaved1F1B`` runs ``m`` micro-batches over ``pp`` ranks of ``v`` chunks,
    with ``v`` chunks per stage (the first and last stage may give one up to the embedding and head)."""
    rounds = max(1, m // pp)
    return v >= 2 and m % rounds == 0 and layers >= pp * v - 2


def schedule_options(pp: int, m: int, layers: int, fixed: Mapping[str, Any], fw: Framework) -> list[tuple[str, int]]:
    """The (schedule, v) pairs the search offers for ``pp`` stages, ``m`` micro-batches and ``layers`` layers: those
    torch runs (see the module docstring), among the framework's own schedules unless one is pinned."""
    if pp == 1:
        options = [("1f1b", 1), ("gpipe", 1)]
    else:
        options = [("gpipe", 1)] + ([("1f1b", 1)] if m >= pp else [])
        vs = [fixed["v"]] if fixed.get("v", 1) > 1 else list(INTERLEAVE_V)
        options += [("interleaved", v) for v in vs if interleaving_runs(pp, m, layers, v)]
        zb_vs = [fixed["v"]] if "v" in fixed else [1, *INTERLEAVE_V]
        options += [("interleaved_zb", v) for v in zb_vs
                    if m % max(1, m // pp) == 0 and (v == 1 or interleaving_runs(pp, m, layers, v))]
        if layers >= 2 * pp:
            options += [("zbv", 2)] + ([("dualpipev", 2)] if m >= 2 * pp else [])
        if "schedule" not in fixed:  # the framework's own schedules, unless one is pinned
            options = [o for o in options if o[0] in fw.schedules]
    if "schedule" in fixed:
        options = [o for o in options if o[0] == fixed["schedule"]]
    if "v" in fixed and pp > 1:
        options = [o for o in options if o[1] == fixed["v"]]
    if pp == 1:
        options = options[:1] if "schedule" not in fixed else options  # one stage: the schedules coincide
    return options


def group_runs(group: int, pp: int, m: int) -> bool:
    """Whether ``interleaved`` runs ``m`` micro-batches in groups of ``group``: Megatron-Core's rule for
    ``microbatch_group_size_per_vp_stage`` (``pp <= N <= m``, and ``m % N`` zero or at least ``pp``, else
    "dependency bubbles"), or one group of all ``m < pp``.  Smaller groups deadlock this warm-up (the first rank
    would wait on forwards the last one runs only after its first backward)."""
    if group == 0:
        return True
    if m < pp:
        return group == m
    return pp <= group <= m and (m % group == 0 or m % group >= pp)


def group_options(schedule: str, pp: int, m: int, fixed: Mapping[str, Any], fw: Framework) -> list[int]:
    """``Layout.group`` values: 0 (the schedule's rounds), and, for ``interleaved`` where the framework tunes
    them (``Framework.interleaved_groups``), every other group size that runs (``group_runs``)."""
    if "group" in fixed:
        return [fixed["group"]] if fixed["group"] == 0 or (schedule == "interleaved"
                                                           and group_runs(fixed["group"], pp, m)) else []
    if schedule != "interleaved" or pp == 1 or fw.interleaved_groups != "tunable":
        return [0]
    default = m // max(1, m // pp)
    # whole multiples of pp, and all m in one group: the sizes that change how many micro-batches are in flight
    sizes = sorted({*range(pp, m + 1, pp), m})
    return [0] + [g for g in sizes if g != default and group_runs(g, pp, m)]


def schedule_refuses(schedule: str, pp: int, recompute: str | None = None, zero: int | None = None,
                     layer_loop: bool = False) -> bool:
    """Whether ``schedule`` on ``pp`` stages cannot run with this recomputation or ZeRO level, or on this model: a
    split backward's second autograd pass is refused by per-op checkpointing's selective-checkpoint regions, its
    weight step would not find the weights of blocks ZeRO-3 resharded after their forward, and (``layer_loop``:
    ``OpGraph.layer_loop_args``) it fails on a weight's output that several layers of a chunk read: torch's weight
    step runs one autograd pass per group of weights without keeping the graph, and the pass of the shared weight
    (which starts at its last reader) frees what the others' passes need."""
    split = splits_backward(schedule, pp)
    return split and (recompute == "op" or zero == 3 or layer_loop)


def check_fixed_pipeline(layers: int, global_batch: int, fixed: dict[str, Any], layer_loop: bool = False) -> None:
    """A one-line ``AutoparError`` for pinned pipeline values that cannot run together (``layers``: the model's;
    ``layer_loop``: its stack's loop hands a weight's output from layer to layer, ``schedule_refuses``)."""
    schedule = fixed.get("schedule")
    if schedule in SPLIT_BACKWARD and layer_loop and fixed.get("pp", 2) > 1:
        raise AutoparError(f"schedule={schedule} splits the backward into two autograd passes, and torch's weight "
                           "pass fails on a weight's output that several layers read (this model's layers hand one "
                           "on, as T5's relative position bias): use schedule=1f1b, gpipe or interleaved")
    if fixed.get("group", 0) and (schedule or "interleaved") != "interleaved":
        raise AutoparError("group (micro-batches per round) needs schedule=interleaved")
    if fixed.get("v", 1) > 1 and (schedule or "interleaved") not in MULTI_CHUNK:
        raise AutoparError(f"v > 1 needs a schedule with several chunks per rank ({', '.join(sorted(MULTI_CHUNK))})")
    if schedule in V_SHAPED and fixed.get("v", 2) != 2:
        raise AutoparError(f"schedule={schedule} holds exactly 2 chunks per rank (v=2)")
    if schedule in SPLIT_BACKWARD and fixed.get("recompute") == "op":
        raise AutoparError(f"schedule={schedule} splits the backward into two autograd passes, which per-op "
                           "checkpointing (recompute=op) refuses; use recompute=full, selective or none")
    if schedule in SPLIT_BACKWARD and fixed.get("zero") == 3:
        raise AutoparError(f"schedule={schedule} runs each weight step after its blocks were resharded by ZeRO-3, "
                           "and torch's weight step then misses their weights; use zero 0-2")
    if schedule in V_SHAPED and "pp" in fixed and layers < 2 * fixed["pp"]:
        raise AutoparError(f"schedule={schedule} puts 2 chunks on each of pp={fixed['pp']} ranks: it needs at "
                           f"least {2 * fixed['pp']} layers, the model has {layers}")
    if schedule in MULTI_CHUNK and fixed.get("pp", 2) > 1 and all(k in fixed for k in ("dp", "mbs")):
        pp, v = fixed.get("pp", 1), fixed.get("v", 2 if schedule in V_SHAPED else None)
        m = global_batch // (fixed["dp"] * fixed["mbs"])
        torch_name = {"interleaved": "ScheduleInterleaved1F1B", "interleaved_zb": "ScheduleInterleavedZeroBubble"}
        if "pp" in fixed and schedule in torch_name and m % max(1, m // pp):
            raise AutoparError(f"{m} micro-batches over pp={pp} with schedule={schedule} need m to be a multiple "
                               f"of max(1, m // pp) = {max(1, m // pp)} (torch's {torch_name[schedule]})")
        if "pp" in fixed and schedule == "dualpipev" and m < 2 * pp:
            raise AutoparError(f"schedule=dualpipev needs at least 2 * pp = {2 * pp} micro-batches, the layout "
                               f"has {m} (torch's ScheduleDualPipeV)")
        if "pp" in fixed and v and schedule not in V_SHAPED and layers < pp * v - 2:
            raise AutoparError(f"interleaving v={v} chunks on pp={pp} stages needs at least {pp * v - 2} layers, "
                               f"the model has {layers}")

# ---- what a pipeline costs beyond its slowest stage's slots


# ---- what a cut between stages hands on


@dataclass(frozen=True, slots=True)
class Crossing:
    """A tensor a pipeline cut would hand on besides the hidden state: the op that made it (its storage), the
    module that op ran in, and its bytes per sample."""

    node: str
    module: str
    bytes_per_sample: float
    read_by_layers: bool = True  # the layers after the cut read it (cross-attention), not only the ops after them
    fixed_bytes: float = 0.0  # bytes that do not grow with the batch (a position bias shared by the samples)

    def describe(self) -> str:
        return f"the output of {self.module or 'the model'} ({self.node})"


def cut_crossings(graph: OpGraph) -> dict[int, list[Crossing]]:
    """What a pipeline cut before layer ``k`` (1 .. layers - 1) would have to hand on besides the hidden state:
    the tensors made before the cut, from parameters (so a later stage cannot make them again: its copy of an
    earlier module is a placeholder), that the layers from ``k`` on or the ops after the stack read.  The
    hidden state itself is the one tensor of layer ``k - 1`` that crosses."""
    chain = unit_chain(graph)
    layers = chain.blocks  # the blocks of every stack (an encoder's, then the layers)
    if layers < 2:
        return {}
    derived: set[str] = set()
    unit: dict[str, int] = {}  # an op's block (-1: before the first, ``layers``: after the last)
    for n in graph.nodes:
        if n.kind == "param":
            derived.add(n.name)
        elif n.kind == "op":
            if any(i in derived for i in n.inputs):
                derived.add(n.name)
            unit[n.name] = chain.unit_of[n.name] - 1
    crossing: dict[int, dict[str, tuple[int, Ref]]] = {}  # cut -> storage -> (the unit that made it, a ref)
    in_layers: set[str] = set()  # storages a layer reads from before it
    last_reader: dict[str, int] = {}
    for n in graph.ops():
        for r in tensor_refs(n):
            if r.name not in derived or r.name not in unit or unit[r.name] >= unit[n.name]:
                continue
            key, made = storage_key(graph, r), unit[r.name]
            last_reader[key] = max(last_reader.get(key, -1), unit[n.name])
            if unit[n.name] < layers:
                in_layers.add(key)
            for k in range(max(1, made + 1), min(layers - 1, unit[n.name]) + 1):
                crossing.setdefault(k, {})[key] = (made, r)
    out = {}
    for k, storages in sorted(crossing.items()):
        # the hidden state: made by the block before the cut and read by the next block only (where the block
        # before the cut makes more, an encoder's last block its output and the decoder's embedding), else the
        # first made by the block before the cut
        made_before = [key for key, (made, _) in sorted(storages.items()) if made == k - 1]
        hidden = next((key for key in made_before if last_reader[key] == k), made_before[0] if made_before else None)
        extra = [(key, r) for key, (_, r) in sorted(storages.items()) if key != hidden]
        if extra:
            out[k] = [_crossing(graph, key, r, key in in_layers) for key, r in extra]
    return out


def _crossing(graph: OpGraph, key: str, ref: Ref, read_by_layers: bool) -> Crossing:
    t = graph.tensor(ref)
    one, two = t.numel_at(1) * t.itemsize, t.numel_at(2) * t.itemsize
    node = key.split(":")[0]
    return Crossing(node, graph[node].module, float(two - one), read_by_layers, float(2 * one - two))


@dataclass(frozen=True, slots=True)
class PipelineCarry:
    """What pipeline stages hand on beside the hidden state (``pipeline_carry``)."""

    modules: tuple[str, ...] = ()
    """The module called before the stack whose outputs the layers (an encoder's, for cross-attention) or the ops
    after them (CLIP's image embeddings, for its loss) read: the first stage hands its outputs on, and later
    stages take them in place of the module (one module at most; several are ``lost``)."""
    bytes_per_sample: float = 0.0
    """What a cut carries beside the hidden state, per sample (the most over the cuts) ..."""
    fixed_bytes: float = 0.0
    """... and per micro-batch whatever its size (a position bias without a batch dimension)."""
    loop_args: tuple[str, ...] = ()
    """The slots of the layers' calls (``OpGraph.layer_loop_args``) that the stack's loop hands from layer to layer,
    made by an earlier layer (T5's relative position bias): the stage before a cut hands on what its loop would
    pass the next layer there, and the stage after passes it to its first layer."""
    lost: dict[int, list[str]] = field(default_factory=dict)
    """Per cut, the tensors no stage could hand on (what only the ops after the layers read, or what layers make
    and pass on other than through the stack's loop)."""


def pipeline_carry(graph: OpGraph) -> PipelineCarry:
    """What a pipeline of ``graph``'s stack carries beside the hidden state (``cut_crossings``), split into the
    outputs of a module before the stack (``stack_ends``) that the layers or the ops after them read (an
    encoder's, for the decoder's cross-attention; CLIP's image embeddings, for its loss), which the stages hand
    on; what a layer made that the stack's loop hands to the later layers (``OpGraph.layer_loop_args``: T5's
    relative position bias), which the stages hand on too; and the rest (what a layer made that only the ops
    after the stack read, as a Mixtral's router logits for its load-balancing loss), which stays refused."""
    before = stack_ends(graph)["before"]
    layers_prefix = f"{graph.layer_container}."

    def end_of(module: str) -> str | None:
        return next((e for e in before if module == e or module.startswith(e + ".")), None)

    modules: set[str] = set()
    lost: dict[int, list[str]] = {}
    per_sample = fixed = 0.0
    looped = False
    crossings_at = cut_crossings(graph)
    for k, crossings in crossings_at.items():
        at_cut = [0.0, 0.0]
        for c in crossings:
            end = end_of(c.module)  # an encoder's output, for the layers, or CLIP's image embeddings, for its loss
            in_loop = bool(c.read_by_layers and graph.layer_loop_args and c.module.startswith(layers_prefix))
            if end is None and not in_loop:
                lost.setdefault(k, []).append(c.describe())
                continue
            if end is not None:
                modules.add(end)
            looped = looped or in_loop
            at_cut[0] += c.bytes_per_sample
            at_cut[1] += c.fixed_bytes
        if at_cut[0] + at_cut[1] > per_sample + fixed:
            per_sample, fixed = at_cut
    if len(modules) > 1:  # the stages hand on one module's outputs
        names = ", ".join(m for m in before if m in modules)
        return PipelineCarry(lost={k: [f"the outputs of several modules before the layers ({names})"]
                                   for k in sorted(crossings_at)})
    return PipelineCarry(tuple(modules), per_sample, fixed, graph.layer_loop_args if looped else (), lost)


def stack_ends(graph: OpGraph) -> dict[str, list[str]]:
    """The modules beside the layer stack (children of the modules on the path to it) by when the forward
    first calls them: ``before`` the stack (embeddings) or ``after`` it (final norm, head).  From the traced
    op order, since registration order need not say (OPT registers its final norm before its layers).  Also,
    where there are any, the parameters registered on the modules of that path themselves (CLIP's temperature
    on the model) by when an op first reads them: ``params_before``, ``params_after``."""
    path = (graph.layer_container or "").split(".")
    on_path = {".".join(path[:i]) for i in range(len(path))}  # the root and the modules above the stack
    ends: dict[str, list[str]] = {"before": [], "after": []}
    direct: dict[str, list[str]] = {"params_before": [], "params_after": []}
    seen_layer = False
    for n in graph.ops():
        if n.layer is not None:
            seen_layer = True
            continue
        for r in tensor_refs(n):
            src = graph[r.name]
            owner = src.target.rpartition(".")[0] if src.kind == "param" else None
            if owner in on_path and src.target not in direct["params_before"] + direct["params_after"]:
                direct["params_after" if seen_layer else "params_before"].append(src.target)
        parts = n.module.split(".") if n.module else []
        depth = next((i for i, (a, b) in enumerate(zip(parts, path)) if a != b), None)  # None: on the path
        child = ".".join(parts[:depth + 1]) if depth is not None else None
        if child and child not in ends["before"] and child not in ends["after"]:
            ends["after" if seen_layer else "before"].append(child)
    return {**ends, **{k: v for k, v in direct.items() if v}}


def chain_ends(graph: OpGraph, containers: list[str]) -> dict[str, list[str]]:
    """The modules beside a chain of stacks (an encoder's blocks, then the decoder's layers: ``autopar.inter_op.
    units``) by when the forward first calls them: ``before`` the first stack's blocks (the embeddings), ``between``
    the stacks (the encoder's final norm, the decoder's embedding: on the stage that ends the encoder), ``after``
    the last (the final norm, the head).  A module here is a child of a module on the path to a stack that holds
    no stack itself."""
    on_path = {".".join(c.split(".")[:i]) for c in containers for i in range(len(c.split(".")))}
    chain = unit_chain(graph)
    post = len(chain.keys) - 1
    ends: dict[str, list[str]] = {"before": [], "between": [], "after": []}
    placed: set[str] = set()
    for n in graph.ops():
        unit = chain.unit_of[n.name]
        parts = n.module.split(".") if n.module else []
        depth = next((i for i in range(len(parts)) if ".".join(parts[:i + 1]) not in on_path), None)
        if depth is None or n.layer is not None or any(n.module == c or n.module.startswith(c + ".")
                                                       for c in containers):
            continue  # an op of a block, or of a module on the path itself (a mask made in the decoder's forward)
        child = ".".join(parts[:depth + 1])
        if child not in placed:
            placed.add(child)
            ends["before" if unit == 0 else "after" if unit == post else "between"].append(child)
    return ends


def carried_bytes(graph: OpGraph, mbs: int) -> float:
    """What a pipeline boundary of ``graph`` hands on beside the hidden state, per micro-batch of ``mbs`` samples
    (``pipeline_carry``, worked out once per graph)."""
    if "pipeline_carried_bytes" not in graph.annotations:
        carry = pipeline_carry(graph)
        runs = bool(carry.modules or carry.loop_args)
        graph.annotations["pipeline_carried_bytes"] = (carry.bytes_per_sample, carry.fixed_bytes) if runs \
            else (0.0, 0.0)
    per_sample, fixed = graph.annotations["pipeline_carried_bytes"]
    return per_sample * mbs + fixed


def simulated_bubble(layout: Layout) -> bool:
    """Whether the bubble comes from simulating the schedule rather than the closed form."""
    return splits_backward(layout.schedule, layout.pp) or (layout.pp > 1 and layout.v > 1
                                                           and (layout.num_microbatches < layout.pp
                                                                or layout.group > 0))


def bubble_time_s(parts: list[dict[str, float]], stage_times: list[float], layout: Layout,
                  exact: bool = False) -> float:
    """The pipeline's time beyond ``m`` slots of its slowest stage.  With interleaving and fewer micro-batches
    than stages the closed form is only a bound (the pipeline never fills, and the waits depend on every
    stage's times), so the schedule is simulated op by op; so are the zero-bubble schedules, whose weight
    steps fill the bubble as far as the schedule lets them (``p x m x v`` ops and more: the search prices a
    layout's bubble only once the rest of it, and a lower bound of the bubble, beat its cut-off)."""
    m, v = layout.num_microbatches, layout.v
    if not simulated_bubble(layout) and not (exact and layout.pp > 1):
        return bubble_s(stage_times, v, m)
    forward, backward, weight, rerun = op_times(parts)
    return makespan_s(layout.schedule, forward, backward, weight, rerun, m, v, layout.group) - m * max(stage_times)


def op_times(parts: list[dict[str, float]]) -> tuple[tuple[float, ...], ...]:
    """Per stage, one micro-batch's forward, backward as a split one runs it (recomputation included, twice
    when split), weight step and what the weight step recomputes again, through all its chunks; each
    transfer split between the forward and the backward."""
    half = [part["p2p_s"] / 2 for part in parts]
    return (tuple(part["forward_s"] + h for part, h in zip(parts, half)),
            tuple(backward_run_s(part) + h for part, h in zip(parts, half)),
            tuple(part.get("weight_s", 0.0) for part in parts), tuple(part.get("rerun_s", 0.0) for part in parts))


def backward_run_s(part: dict[str, float]) -> float:
    """One micro-batch's backward through a stage (``StageEstimate.parts_s``), as a split backward runs it
    (its recomputation twice) where the schedule splits, else as one pass."""
    if "rerun_s" in part:
        return part["backward_s"] + 2 * part["rerun_s"]
    return part["recompute_s"] + part["backward_s"]


def bubble_bound_s(parts: list[dict[str, float]], stage_times: list[float], layout: Layout) -> float:
    """A lower bound of a simulated schedule's bubble (its closed form, for the others): a rank cannot start
    before the forwards of the chunks ahead of its first one, and then has ``m`` micro-batches of work."""
    p, m, v = layout.pp, layout.num_microbatches, layout.v
    if not simulated_bubble(layout):
        return bubble_s(stage_times, v, m)
    forward = op_times(parts)[0]
    start, latest = 0.0, 0.0
    for k in range(p):  # chunk k runs on rank k in both the looped and the V orders
        latest = max(latest, start + m * stage_times[k])
        start += forward[k] / v
    return latest - m * max(stage_times)


@functools.lru_cache(maxsize=1024)
def makespan_s(schedule: str, forward: tuple[float, ...], backward: tuple[float, ...], weight: tuple[float, ...],
                rerun: tuple[float, ...], m: int, v: int, group: int = 0) -> float:
    runs = simulate_pipeline(schedule, forward, backward, m, v, weight, rerun, group)
    return max(end for ops in runs for _, _, end in ops)


def p2p_s(boundary_bytes: float, layout: Layout, pp_link: AxisLink, tp_link: AxisLink, ctx: PassContext) -> float:
    """One transfer of a stage-boundary tensor between neighbouring stages: the mean of an activation's and
    its gradient's, which the framework may send split over the tp ranks (``pp_scatter_gather``)."""
    fw = ctx.framework
    whole = send_recv_s(boundary_bytes, pp_link)
    if not (fw.pp_scatter_gather and layout.tp > 1 and not layout.sp and pp_link.crosses_nodes):
        return whole
    split = send_recv_s(boundary_bytes / layout.tp, pp_link) + all_gather_s(boundary_bytes, tp_link)
    return split if fw.pp_scatter_gather_grads else (split + whole) / 2

def pipeline_slots(layout: Layout) -> float:
    """The fewest slots of the mean stage's time a pipeline takes (its bound term): ``m + (p - 1) / v`` for the
    closed-form schedules (GPipe, 1F1B and interleaving: ``m t_max + (sum t - t_max) / v`` is at least that many
    slots of ``sum t / p``), ``m`` for the simulated ones (every rank runs its ``m`` micro-batches one after
    another), and for those that do not split the backward at least ``p``: the first micro-batch runs forward
    through every chunk and back before its last backward ends, the ``p`` stages' times one after another."""
    p, m = layout.pp, layout.num_microbatches
    if p == 1:
        return float(m)
    if simulated_bubble(layout):
        return float(m) if splits_backward(layout.schedule, p) else float(max(m, p))
    return m + (p - 1) / layout.v


@functools.lru_cache(maxsize=4096)
def fewest_in_flight(schedule: str, p: int, m: int, v: int, group: int) -> float:
    """The fewest micro-batches' worth of activations any of the ``p`` ranks holds at once (``residue`` 0): with the
    mean stage's activations, a bound of the fullest stage's memory."""
    return min(in_flight_microbatches(schedule, k, p, m, v, 0.0, group) for k in range(p))

def split_backward_load(u: UnitCost, layout: Layout, recompute_s: float) -> tuple[float, float, float, float]:
    """A split backward's part of unit ``u``: its weight step, what that step recomputes again, what the unit holds
    between its input and weight steps, and the recomputation with the weight steps' second pass (the weight step
    is a second autograd pass: checkpointed regions recompute for it again, on the backwards the schedule splits,
    all but DualPipeV's whole ones).  Zeros and ``recompute_s`` where the schedule does not split backwards."""
    if not splits_backward(layout.schedule, layout.pp):
        return 0.0, 0.0, 0.0, recompute_s
    again = recompute_passes(layout)
    return u.bwd_weight_s + recompute_s, recompute_s, u.weight_grad_residue_bytes, recompute_s * again


def _expand_stages(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    rest = space.gpus // (p["tp"] * p["cp"])  # pp x dp
    for pp in space.allowed("pp", [d for d in divisors(rest) if d <= space.layers]):
        if rest % pp:
            continue
        dp = rest // pp
        if ("dp" in space.fixed and space.fixed["dp"] != dp) or space.global_batch % dp:
            continue
        yield {**p, "pp": pp, "dp": dp}


def _check_fixed_stages(space: SearchSpace, graph: OpGraph) -> None:
    fixed, n = space.fixed, space.gpus
    check_divides(space, "dp")
    check_divides(space, "pp")
    if "pp" in fixed and fixed["pp"] > 1 and not graph.layers:
        raise AutoparError(f"--fix pp={fixed['pp']} splits a stack of layers into stages, and this model has none (a "
                           "stack is two or more blocks of one kind; a model of one block has no stages to cut): "
                           "plan with --fix pp=1")
    if "pp" in fixed and fixed["pp"] > space.layers:
        raise AutoparError(f"--fix pp={fixed['pp']} exceeds the {space.layers} layers")
    product = fixed.get("dp", 0) * fixed.get("tp", 0) * fixed.get("pp", 0) * fixed.get("cp", 1)
    if all(k in fixed for k in ("dp", "tp", "pp")) and product != n:
        raise AutoparError(f"--fix dp*cp*tp*pp = {product} but the cluster has {n} devices")


def _expand_schedule(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    pp, m = p["pp"], p["num_microbatches"]
    for schedule, v in schedule_options(pp, m, space.layers, space.fixed, space.fw):
        if schedule_refuses(schedule, pp, p["recompute"], p["zero"], space.layer_loop):
            continue
        for group in group_options(schedule, pp, m, space.fixed, space.fw):
            yield {**p, "schedule": schedule, "v": v, "group": group}


def _check_fixed_schedule(space: SearchSpace, graph: OpGraph) -> None:
    check_fixed_pipeline(space.layers, space.global_batch, dict(space.fixed), space.layer_loop)


def _unit_step(d: UnitLoadDraft) -> None:
    d.weight_s, d.rerun_s, d.residue_bytes, d.recompute_s = split_backward_load(d.u, d.layout, d.recompute_s)


def recompute_passes(layout: Layout) -> float:
    """How many times a layer's recomputation runs per micro-batch: once, and again in a split backward's weight
    step for the share of micro-batches that defers it (``split_fraction``)."""
    return 1 + split_fraction(layout.schedule, layout.pp, layout.num_microbatches, layout.v)


def _time_bound_s(t: UnitTotals, layout: Layout, links: Links, cluster: Cluster, ctx: PassContext) -> float:
    """The mean stage's work in the balanced pipeline's slots (the weight steps recompute again)."""
    p = layout.pp
    return pipeline_slots(layout) * ((t.work_s + recompute_passes(layout) * t.recompute_s) / p)


def _time_bound_floor_s(t: UnitTotals, layout: Layout, links: Links, cluster: Cluster, ctx: PassContext) -> float:
    """The least ``_time_bound_s`` takes over the schedules, ``v`` and groups: every schedule's ``pipeline_slots``
    are at least ``m``, and the recomputation runs at least once."""
    return layout.num_microbatches * (t.work_s + t.recompute_s) / layout.pp


def _memory_bound_bytes(t: UnitTotals, layout: Layout, ctx: PassContext) -> float:
    """The mean stage's activations, of the fewest micro-batches any stage holds at once."""
    p = layout.pp
    if p == 1:
        return t.activation_bytes
    return fewest_in_flight(layout.schedule, p, layout.num_microbatches, layout.v, layout.group) * \
        t.activation_bytes / p


#: Pipeline stages: ``pp`` (at most the layers) and with it ``dp``, what the other axes leave.
STAGES = Technique("pipeline_stages", (Knob("pp"), Knob("dp")), expand=_expand_stages, check_fixed=_check_fixed_stages)
#: The pipeline schedule, its chunks per rank and its micro-batch groups.
TECHNIQUE = Technique("pipeline_schedule", (Knob("schedule", "choice", choices=SCHEDULES), Knob("v"),
                                                           Knob("group", low=0)), expand=_expand_schedule,
                      check_fixed=_check_fixed_schedule, unit_step=_unit_step, time_bound_s=_time_bound_s,
                      time_bound_floor_s=_time_bound_floor_s, memory_bound_bytes=_memory_bound_bytes)

__all__ = ["INTERLEAVE_V", "STAGES", "TECHNIQUE", "Crossing", "PipelineCarry", "backward_run_s", "bubble_bound_s",
           "bubble_time_s", "carried_bytes", "chain_ends", "check_fixed_pipeline", "cut_crossings", "fewest_in_flight",
           "group_options", "group_runs", "interleaving_runs", "makespan_s", "op_times", "p2p_s", "pipeline_carry",
           "pipeline_slots", "recompute_passes", "schedule_options", "schedule_refuses", "simulated_bubble",
           "split_backward_load", "stack_ends"]
