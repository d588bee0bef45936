"""Intra-operator sharding: build the ILP for a slice of the graph on a device mesh, solve it, read it back.

Steps (each a function below):

1. ``_representatives``: identical layers (same structural hash) map onto the first of their type, so
   they share one set of decisions and their costs are multiplied; solve time does not grow with depth.
2. ``_classify``: nodes with no activation input (parameter views, factories, buffer slices) are
   replicated constants.  An op with exactly one activation input *follows* it when every strategy of its
   producer has a matching strategy of the follower (Alpa's merging of element-wise and view ops); the
   others are *anchors* with their own decision.  Graph inputs (the batch) are anchors too: the data
   loader can hand each device any slice of the batch for free.
3. ``_group_costs``: per group strategy, compute time of every member, parameter synchronization, and
   per-device memory (model state plus saved activations).
4. ``_edge_costs``: every edge between groups gets a matrix of forward + backward resharding costs,
   accumulated over all the layers that map onto it.

The result is a ``SolverRequest`` of plain arrays (``autopar.solvers``); ``solve_intra_op`` returns the
chosen strategy of every op and the placement of every parameter.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from autopar.cluster import Cluster, MeshSpec
from autopar.conv_channels import CONV_MODULE_TYPES, conv_region
from autopar.intra_op.sharding_costs import (
    PRODUCT_OPS,
    compute_s,
    edge_cost_s,
    param_cost,
    saved_bytes,
)
from autopar.intra_op.strategies import AxisStrategy, R, Strategy, divides, mesh_strategies, shard, tensor_refs
from autopar.ir import STACKED_MODULE, Node, OpGraph, Ref, TensorInfo, stack_prefixes, structural_hash
from autopar.passes.context import PassContext
from autopar.passes.experts import stacked_expert_params
from autopar.solvers.evaluate import alternatives, min_memory_bytes
from autopar.solvers.ilp import Backend, solve_ilp
from autopar.solvers.request import SolverRequest, SolverResult


@dataclass(frozen=True, kw_only=True, slots=True)
class IntraOpConfig:
    """Knobs of one intra-op solve."""

    batch: int
    """Samples the whole mesh processes per micro-batch (the mesh shards them)."""
    grad_sync_weight: float = 1.0
    """Share of the once-per-iteration gradient synchronization charged to one micro-batch."""
    activation_multiplier: float = 1.0
    """Micro-batches whose saved activations are alive at once (pipeline in-flight count)."""
    memory_budget_bytes: float | None = None
    """Per-device memory limit; ``None``: unlimited."""
    memory_slack: float | None = None
    """Instead of a fixed budget: allow at most ``(1 + slack)`` times the least memory any choice needs
    (``0.0`` asks for the fastest of the leanest layouts)."""
    sequence_parallel: bool = True
    """Allow sharding activations along the sequence dimension on the ``tp`` axis."""
    split_batch_on_tp: bool = True
    """Allow sharding activations along the batch dimension on the ``tp`` axis."""
    shard_block_linears: bool = False
    """Split every Linear weight of the block stack on ``tp`` (column- or row-parallel), as runtimes with a
    fixed tensor-parallel plan do (``Framework.tp_layout == "megatron"``); ``False``: the ILP may keep some
    replicated."""
    backend: Backend = "cbc"
    time_limit_s: float = 60.0

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError("batch must be >= 1")


@dataclass(slots=True)
class _Group:
    name: str
    anchor: str
    strategies: list[Strategy]
    members: list[str] = field(default_factory=list)
    # node name -> its strategy under each group strategy
    place: dict[str, list[Strategy]] = field(default_factory=dict)


@dataclass(slots=True)
class IntraOpProblem:
    """The ILP and what is needed to read its answer back."""

    request: SolverRequest
    groups: list[_Group]
    group_of: dict[str, int]
    rep_of: dict[str, str]
    build_time_s: float


@dataclass(frozen=True, slots=True)
class IntraOpSolution:
    result: SolverResult
    node_strategies: dict[str, Strategy]
    """Chosen strategy of every op node in the slice (placements per mesh axis)."""
    param_placements: dict[str, tuple[str, ...]]
    """Parameter FQN -> placement per mesh axis, as its first consumer requires it."""
    build_time_s: float
    num_groups: int
    mesh_names: tuple[str, ...] = ()
    alternatives: dict[str, list[tuple[Strategy, float, float]]] = field(default_factory=dict)
    """Op name -> its group's cheapest other strategies, as ``(strategy, extra s, extra bytes)`` if the group
    alone switched (``autopar.solvers.evaluate.alternatives``; summed over the identical ops it stands for)."""

    def placements_by_axis(self) -> dict[str, dict[str, str]]:
        """Parameter FQN -> {mesh axis name: placement}, the form the Plan stores.  A parameter consumed as a
        pending partial (a row-parallel bias is added on one rank) is stored replicated."""
        return {fqn: {axis: ("R" if p == "P" else p) for axis, p in zip(self.mesh_names, places)}
                for fqn, places in sorted(self.param_placements.items())}

    def op_strategies(self) -> dict[str, dict[str, dict[str, list[str | None]]]]:
        """Op name -> {mesh axis name: {"outputs": [...], "inputs": [...]}} in DTensor's short notation."""
        return {name: {axis: {"outputs": list(ax.outputs), "inputs": list(ax.inputs)}
                       for axis, ax in zip(self.mesh_names, strat)}
                for name, strat in sorted(self.node_strategies.items())}


def _representatives(graph: OpGraph, nodes: list[Node]) -> dict[str, str]:
    """Node name -> the node it shares decisions with (itself, or its twin in the first identical layer)."""
    by_layer: dict[int, list[Node]] = {}
    for n in nodes:
        if n.layer is not None:
            by_layer.setdefault(n.layer, []).append(n)
    first_of_type: dict[str, int] = {}
    rep = {n.name: n.name for n in nodes}
    hash_of = {layer.index: layer.structural_hash for layer in graph.layers}
    for idx in sorted(by_layer):
        h = hash_of.get(idx)
        if h is None:
            continue
        first = first_of_type.setdefault(h, idx)
        if first != idx and len(by_layer[first]) == len(by_layer[idx]):
            for a, b in zip(by_layer[idx], by_layer[first]):
                rep[a.name] = b.name
    _tie_other_stacks(graph, nodes, rep)
    return rep


def _tie_other_stacks(graph: OpGraph, nodes: list[Node], rep: dict[str, str]) -> None:
    """Identical blocks of stacks other than the layers (an encoder-decoder's second stack, a vision tower)
    share decisions too, in place: ``rep`` maps each op of a block onto its twin in the first block of the stack
    with the same structure (``structural_hash``).  The solve then grows with neither stack's depth."""
    blocks: dict[tuple[str, int], list[Node]] = {}
    for n in nodes:
        m = STACKED_MODULE.match(n.module) if n.layer is None else None
        if m is not None:
            blocks.setdefault((m["stack"], int(m["index"])), []).append(n)
    by_name = {n.name: n for n in graph.nodes}
    first_of: dict[tuple[str, str], list[Node]] = {}
    for (stack, index), members in sorted(blocks.items()):
        h = structural_hash(members, f"{stack}.{index}", by_name)
        first = first_of.setdefault((stack, h), members)
        if first is not members:
            for a, b in zip(members, first, strict=True):
                rep[a.name] = b.name


def _input_strategies(t: TensorInfo, mesh: MeshSpec, batch: int) -> list[Strategy]:
    singles = [R, *(shard(d) for d in range(len(t.shape)))]
    out = []
    for combo in itertools.product(singles, repeat=len(mesh.shape)):
        if divides(t, combo, mesh.shape, batch):
            out.append(tuple(AxisStrategy((p,), ()) for p in combo))
    return out


def _is_sequence_sharded(graph: OpGraph, node: Node, strategy: Strategy, tp: int | None) -> bool:
    if tp is None:
        return False
    for i, t in enumerate(node.outputs):
        p = strategy[tp].outputs[i] if i < len(strategy[tp].outputs) else None
        if t is None or not p or not p.startswith("S("):
            continue
        d = int(p[2:-1])
        if d != t.batch_dim and d < len(t.shape) and t.shape[d] == graph.seq_len and graph.seq_len > 1:
            return True
    return False


def _is_batch_sharded(graph: OpGraph, node: Node, strategy: Strategy, tp: int | None) -> bool:
    """Whether ``strategy`` splits a tensor of ``node`` along its batch dimension on the ``tp`` axis."""
    if tp is None:
        return False
    tensors = [*zip(node.outputs, strategy[tp].outputs),
               *((graph.tensor(r), p) for r, p in zip(tensor_refs(node), strategy[tp].inputs))]
    for t, p in tensors:
        if t is not None and p and p.startswith("S(") and t.batch_dim is not None and t.shape:
            if int(p[2:-1]) % len(t.shape) == t.batch_dim % len(t.shape):
                return True
    return False


#: Modules whose sharded weights have ``parallelize_module`` styles (``autopar.runtime.tensor_parallel``).
STYLED_MODULE_TYPES = frozenset({"Linear", "Embedding"})


def region_modules(graph: OpGraph) -> tuple[str, ...]:
    """Modules with parameters of their own that are not a Linear or an Embedding (norms, stacked experts,
    whose region is the block's child holding them; convolutions, whose region is the module calling them,
    ``conv_region``): the runtime runs one as a ``PlacedParameters`` region once its weights are sharded on
    tp, and then hands its output on whole (``autopar.runtime.styles``)."""
    prefix = {layer.index: layer.prefix for layer in graph.layers}
    experts = stacked_expert_params(graph)
    stacks = stack_prefixes(n.module for n in graph.nodes if n.kind == "op")

    def region(n: Node) -> str:
        if experts.intersection(n.params):
            return _block_child(n.module, prefix.get(n.layer))
        return conv_region(n.module, stacks) if n.module_type in CONV_MODULE_TYPES else n.module

    owning = [n for n in graph.nodes if n.kind == "op" and n.params and n.module_type not in STYLED_MODULE_TYPES]
    regions = {region(n) for n in owning}
    convs = {region(n) for n in owning if n.module_type in CONV_MODULE_TYPES}
    # a module inside a convolutions' region (a norm between them) runs in it, not as a region of its own
    return tuple(sorted(r for r in regions if not any(r != c and _within(r, c) for c in convs)))


def _block_child(module: str, block: str | None) -> str:
    """Inside a block, the block's child holding ``module`` (the runtime's region for stacked experts in a
    submodule of the MoE layer, which then runs with its routing, ``autopar.runtime.tensor_parallel``)."""
    if block is None or not module.startswith(block + "."):
        return module
    return block + "." + module[len(block) + 1:].split(".", 1)[0]


def _within(module: str, region: str) -> bool:
    return region == "" or module == region or module.startswith(region + ".")


def _region_outputs(graph: OpGraph, nodes: Iterable[Node]) -> frozenset[str]:
    """Those of ``nodes`` inside a region module whose output some node outside that module reads."""
    regions = set(region_modules(graph))
    users = graph.users()
    out = set()
    for n in nodes:
        module = n.module
        while module not in regions and module:  # the innermost region holding the node, if any
            module = module.rpartition(".")[0]
        if module in regions and any(not _within(graph[u].module, module) for u in users[n.name]):
            out.add(n.name)
    return frozenset(out)


#: Additions that carry a residual stream (``x = x + f(x)``).
_ADD_OPS = frozenset({"aten.add.Tensor", "aten.add_.Tensor"})


def _residual_adds(graph: OpGraph, nodes: Iterable[Node]) -> frozenset[str]:
    """The additions of ``nodes`` on a block's residual stream: those adding to the block's input (an
    activation made before the block) or to another such addition, within one block of the stack, and
    keeping its shape and batch dimension (an attention mask or bias made before the block and broadcast
    onto the scores is no residual)."""
    out: set[str] = set()
    for n in nodes:  # topological order
        if n.layer is None or n.op not in _ADD_OPS or n.out is None:
            continue
        for name in n.inputs:
            src = graph[name]
            stream = name in out or (src.kind in ("op", "input") and src.layer != n.layer)
            if (stream and src.out is not None and tuple(src.out.shape) == tuple(n.out.shape)
                    and src.out.batch_dim is not None and src.out.batch_dim == n.out.batch_dim):
                out.add(n.name)
                break
    return frozenset(out)


def _split_linears(graph: OpGraph, nodes: Iterable[Node], tp: int) -> frozenset[str]:
    """The Linears of the block stack a fixed tensor-parallel plan splits on ``tp`` ranks: all but MoE routers
    (a Linear whose scores reach a top-k through element-wise and view ops, no other product), which
    Megatron-LM and torchtitan keep replicated, and the key/value projections of an attention with fewer
    key/value heads than ``tp`` (multi-query attention: the ILP places them; Megatron-Core refuses such a
    tp); and the output layer and token embedding, split on the vocabulary (``_vocab_parallel``).  HuggingFace's
    ``Conv1D`` (GPT-2) is no ``Linear`` here and stays free."""
    nodes = list(nodes)  # read twice: the block's Linears and the vocabulary-parallel ones
    users = graph.users()

    def routes(name: str) -> bool:
        frontier = [name]
        for _ in range(6):
            frontier = [u for f in frontier for u in users[f] if graph[u].op not in PRODUCT_OPS]
            if any(graph[u].op == "aten.topk.default" for u in frontier):
                return True
        return False

    def projection(name: str) -> Node | None:  # the Linear a key or value comes from (through RoPE, views)
        for _ in range(12):
            node = graph[name]
            if node.module_type == "Linear" and node.params:
                return node
            if node.op in PRODUCT_OPS:
                return None
            refs = [r for r in tensor_refs(node) if graph[r.name].kind == "op"]
            if not refs:
                return None
            name = refs[0].name
        return None

    few_heads: set[str] = set()
    for n in graph.ops():
        if n.op != "aten.scaled_dot_product_attention.default" or len(n.args) < 3:
            continue
        q = graph.tensor(n.args[0])
        head_dim = q.shape[-1] if q is not None and q.shape else 0
        for ref in n.args[1:3]:
            proj = projection(ref.name) if hasattr(ref, "name") else None
            weight = graph.params.get(proj.params[0]) if proj is not None else None
            if weight is not None and head_dim and len(weight.shape) == 2 and weight.shape[0] // head_dim < tp:
                few_heads.add(proj.name)
    block = {n.name for n in nodes if n.layer is not None and n.module_type == "Linear" and n.params
             and not routes(n.name) and n.name not in few_heads}
    return frozenset(block | _vocab_parallel(graph, nodes))


def _vocab_parallel(graph: OpGraph, nodes: Iterable[Node]) -> set[str]:
    """The output layer and the token embedding, which Megatron-LM (``VocabParallelEmbedding``, a
    column-parallel output layer), Megatron-DeepSpeed and torchtitan split on the vocabulary; learned
    positions and other Linears outside the block stack (OPT's ``project_in`` / ``project_out``) stay
    replicated.  The token embedding is the lookup that scales with the batch (positions index a range); the
    output layer a Linear after the last block with as many outputs as it has rows (the vocabulary).  A
    model without a token embedding (it reads its own features) has its last Linear after the blocks as its
    output layer."""
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    last_block = max((order[n.name] for n in graph.ops() if n.layer is not None), default=None)
    if last_block is None:
        return set()  # no block stack: nothing to tell an output layer from the model's own layers

    def rows(n: Node) -> int | None:
        w = graph.params.get(n.params[0]) if n.params else None
        return w.shape[0] if w is not None and len(w.shape) == 2 else None

    after = [n for n in graph.ops() if order[n.name] > last_block and n.module_type == "Linear" and rows(n)]
    embeddings = [n for n in graph.ops() if n.op == "aten.embedding.default" and n.batch_scaled and rows(n)]
    vocab = {rows(n) for n in embeddings}
    heads = [n for n in after if rows(n) in vocab] if embeddings else after[-1:]
    outputs = {rows(n) for n in heads}
    chosen = {n.name for n in [*heads, *(e for e in embeddings if rows(e) in outputs)]}
    return chosen & {n.name for n in nodes}


def _weight_operands(graph: OpGraph, node: Node) -> list[int]:
    """Operand positions of ``node``'s 2-D weights."""
    return [k for k, r in enumerate(tensor_refs(node)) if graph[r.name].kind == "param"
            and graph[r.name].out is not None and len(graph[r.name].out.shape) == 2]


@dataclass(frozen=True, slots=True)
class _Slice:
    """What the intra-op problems over one slice of the graph take from its structure alone, whatever the mesh,
    the micro-batch and the options: built once per slice (``OpGraph.derived``) for all its problems."""

    nodes: list[Node]  # the slice's ops, in graph order
    rep_of: dict[str, str]  # ``_representatives``
    inputs: list[Node]  # the graph inputs the slice reads
    reps: list[tuple[Node, list[str]]]  # the representatives that read activations, with those they read
    multiplicity: dict[str, int]  # how many ops each representative stands for
    edge_weights: dict[tuple[str, int, str, int], int]  # (producer rep, output, consumer rep, slot) -> edges
    parameter_uses: dict[str, list[tuple[str, int]]]  # a parameter's consuming reps and slots
    region_outputs: frozenset[str]  # ``_region_outputs``
    residual_adds: frozenset[str]  # ``_residual_adds``


def _slice(graph: OpGraph, names: frozenset[str]) -> _Slice:
    nodes = [n for n in graph.nodes if n.name in names and n.kind == "op"]
    rep_of = _representatives(graph, nodes)
    constants: set[str] = {n.name for n in graph.nodes if n.kind in ("param", "buffer", "constant")}

    def activation_inputs(n: Node) -> list[str]:
        return list(dict.fromkeys(r.name for r in tensor_refs(n) if r.name not in constants))

    read = {a for m in nodes for a in activation_inputs(m)}
    inputs = [n for n in graph.nodes if n.kind == "input" and n.name in read]
    reps = []
    for n in nodes:
        if rep_of[n.name] != n.name:
            continue
        acts = activation_inputs(n)
        if acts:
            reps.append((n, acts))
        else:  # made from constants alone (a mask, a position table): a constant too
            constants.add(n.name)
    grouped = {n.name for n in inputs} | {n.name for n, _ in reps}  # what the problem's groups hold
    weights: dict[tuple[str, int, str, int], int] = {}
    uses: dict[str, list[tuple[str, int]]] = {}
    for n in nodes:
        rep = rep_of[n.name]
        for k, r in enumerate(tensor_refs(n)):
            kind = graph[r.name].kind
            if kind == "param" and rep in grouped and (rep, k) not in uses.get(r.name, []):
                uses.setdefault(r.name, []).append((rep, k))
            if r.name in constants or kind in ("param", "buffer", "constant"):
                continue
            producer = rep_of.get(r.name, r.name)
            if producer not in grouped:
                continue  # produced outside the slice: a stage boundary, costed by the pipeline model
            key = (producer, r.index, rep, k)
            weights[key] = weights.get(key, 0) + 1
    return _Slice(nodes, rep_of, inputs, reps, _multiplicity(nodes, rep_of), weights, uses,
                  _region_outputs(graph, nodes), _residual_adds(graph, nodes))


def build_intra_op(graph: OpGraph, node_names: Iterable[str], mesh: MeshSpec, cfg: IntraOpConfig,
                   cluster: Cluster, ctx: PassContext) -> IntraOpProblem:
    """The ILP for the op nodes ``node_names`` (a stage, a layer or the whole graph) on ``mesh``."""
    t0 = time.perf_counter()
    names = frozenset(node_names)
    sl: _Slice = graph.derived(("intra_op_slice", names), lambda: _slice(graph, names))
    tp = mesh.axis("tp")
    batch = cfg.batch

    leaving = sl.region_outputs if not cfg.sequence_parallel else frozenset()
    # Without sequence parallelism the residual stream is whole on every tp rank, as Megatron-LM runs it
    # and as the runtime's RowwiseParallel hands its all-reduced output on: a row-parallel product's partial
    # sums are all-reduced, not reduce-scattered into a stream split on the hidden dimension (which would
    # price the residual's element-wise work, saved tensors and pipeline sends at 1/tp).
    # With it, a fixed Megatron plan splits the stream on the sequence between the tensor-parallel regions
    # (Korthikanti et al. 2022): a row-parallel product's partial sums are reduce-scattered into it, not
    # all-reduced into a whole stream (which the ILP may find as cheap, but Megatron-LM does not run).
    megatron_sp = cfg.sequence_parallel and cfg.shard_block_linears
    residual = sl.residual_adds if not cfg.sequence_parallel or megatron_sp else frozenset()
    fixed_split = _split_linears(graph, sl.nodes, mesh.shape[tp]) if cfg.shard_block_linears and tp is not None \
        else frozenset()
    groups: list[_Group] = []
    group_of: dict[str, int] = {}

    for n in sl.inputs:  # graph inputs feeding the slice
        strategies = _input_strategies(n.out, mesh, batch)
        if not cfg.split_batch_on_tp and tp is not None:
            strategies = [s for s in strategies if s[tp].outputs[0] != shard(n.out.batch_dim)] or strategies[:1]
        g = _Group(n.name, n.name, strategies, [n.name], {n.name: strategies})
        group_of[n.name] = len(groups)
        groups.append(g)

    rep_of = sl.rep_of
    for n, acts in sl.reps:
        strategies = mesh_strategies(graph, n, batch, mesh.shape)
        if not cfg.sequence_parallel:
            strategies = [s for s in strategies if not _is_sequence_sharded(graph, n, s, tp)] or strategies[:1]
        if not cfg.split_batch_on_tp:
            strategies = [s for s in strategies if not _is_batch_sharded(graph, n, s, tp)] or strategies[:1]
        if n.name in leaving and tp is not None:  # a region hands its output on whole
            strategies = [s for s in strategies if all(p in (None, R) for p in s[tp].outputs)] or strategies[:1]
        if n.name in fixed_split and tp is not None:
            weights = _weight_operands(graph, n)
            # a Linear no strategy splits (a weight dim smaller than tp) stays free rather than unpriceable
            strategies = [s for s in strategies
                          if all(s[tp].inputs[k] not in (None, R) for k in weights)] or strategies
        if n.name in residual and tp is not None:
            if megatron_sp:  # split on the sequence between the regions
                strategies = [s for s in strategies if _is_sequence_sharded(graph, n, s, tp)] or strategies
            else:  # whole on every rank
                strategies = [s for s in strategies
                              if all(p in (None, R) for p in (*s[tp].inputs, *s[tp].outputs))] or strategies[:1]
        leader = rep_of.get(acts[0], acts[0]) if len(acts) == 1 else None
        if leader is not None and leader in group_of:
            placed = _follow(n, acts[0], leader, groups[group_of[leader]], strategies)
            if placed is not None:
                g = groups[group_of[leader]]
                g.members.append(n.name)
                g.place[n.name] = placed
                group_of[n.name] = group_of[leader]
                continue
        g = _Group(n.name, n.name, strategies, [n.name], {n.name: strategies})
        group_of[n.name] = len(groups)
        groups.append(g)

    node_cost, memory = _group_costs(graph, sl.multiplicity, groups, mesh, cfg, cluster, ctx)
    edges, edge_mats = _edge_costs(graph, sl.edge_weights, groups, group_of, node_cost, mesh, cfg, ctx)
    edges, edge_mats = _tie_shared_parameters(sl.parameter_uses, groups, group_of, node_cost, edges, edge_mats)
    request = SolverRequest(
        node_names=tuple(g.name for g in groups),
        node_cost_s=tuple(tuple(row) for row in node_cost),
        memory_bytes=tuple(tuple(row) for row in memory),
        edges=tuple(edges),
        edge_cost_s=tuple(tuple(tuple(r) for r in m) for m in edge_mats),
        memory_budget_bytes=cfg.memory_budget_bytes,
        time_limit_s=cfg.time_limit_s,
    )
    return IntraOpProblem(request, groups, group_of, rep_of, time.perf_counter() - t0)


def _follow(node: Node, source: str, leader: str, group: _Group,
            strategies: list[Strategy]) -> list[Strategy] | None:
    """Per group strategy, the node's only strategy that takes the leader's output as it is.

    ``None`` when some leader strategy has no match, or more than one (a product given a replicated input
    may still choose to shard its output: that is a decision, not a consequence).
    """
    refs = tensor_refs(node)
    slots = [i for i, r in enumerate(refs) if r.name == source]  # ``source`` maps onto ``leader``
    out_index = refs[slots[0]].index
    by_input: dict[tuple, list[Strategy]] = {}
    for s in strategies:
        key = tuple(tuple(ax.inputs[i] for i in slots) for ax in s)
        by_input.setdefault(key, []).append(s)
    placed = []
    for gs in group.place[leader]:
        want = tuple(tuple([(ax.outputs[out_index] or R)] * len(slots)) for ax in gs)
        matches = by_input.get(want, [])
        if len(matches) != 1:
            return None
        placed.append(matches[0])
    return placed


def _multiplicity(nodes: list[Node], rep_of: dict[str, str]) -> dict[str, int]:
    mult: dict[str, int] = {}
    for n in nodes:
        mult[rep_of[n.name]] = mult.get(rep_of[n.name], 0) + 1
    return mult


def _group_costs(graph: OpGraph, mult: dict[str, int], groups: list[_Group], mesh: MeshSpec, cfg: IntraOpConfig,
                 cluster: Cluster, ctx: PassContext) -> tuple[list[list[float]], list[list[float]]]:
    cost = [[0.0] * len(g.strategies) for g in groups]
    memory = [[0.0] * len(g.strategies) for g in groups]
    seen_params: set[str] = set()
    seen_saved: set[str] = set()
    for gi, g in enumerate(groups):
        for name in g.members:
            if graph[name].kind != "op":
                continue
            node, m = graph[name], mult.get(name, 1)
            refs = tensor_refs(node)
            param_slots = [(i, graph[r.name]) for i, r in enumerate(refs) if graph[r.name].kind == "param"]
            new_params = [(i, p) for i, p in param_slots if p.target not in seen_params]
            seen_params.update(p.target for _, p in param_slots)
            saved = [t for t in node.annotations.get("saved", ()) if t.key not in seen_saved]
            seen_saved.update(t.key for t in saved)
            for s, strat in enumerate(g.place[name]):
                fwd, bwd = compute_s(node, graph, strat, mesh, cfg.batch, cluster, ctx)
                total = fwd + bwd
                mem = 0.0
                for i, p in param_slots:
                    pc = param_cost(p.out, tuple(ax.inputs[i] for ax in strat), strat, mesh, ctx)
                    total += cfg.grad_sync_weight * pc.per_iteration_s
                    if (i, p) in new_params:
                        mem += pc.state_bytes
                # Saved inputs count as the op consumes them: the producer's placement is an edge's choice,
                # so Megatron's sharded saving under sequence parallelism is left to the unit costs.
                mem += sum(saved_bytes(graph, node, strat, mesh, cfg.batch, saved)) * cfg.activation_multiplier
                cost[gi][s] += m * total
                memory[gi][s] += m * mem
    return cost, memory


def _edge_costs(graph: OpGraph, weight: dict[tuple[str, int, str, int], int], groups: list[_Group],
                group_of: dict[str, int], node_cost: list[list[float]], mesh: MeshSpec, cfg: IntraOpConfig,
                ctx: PassContext) -> tuple[list[tuple[int, int]], list[list[list[float]]]]:
    """``weight``: how many real edges map onto each (producer rep, output index, consumer rep, slot)."""
    mats: dict[tuple[int, int], list[list[float]]] = {}
    for (pu, idx, pc, k), w in weight.items():
        gu, gc = group_of[pu], group_of[pc]
        t = graph.tensor(Ref(pu, idx))
        if t is None:
            continue
        prod_place, cons_place = groups[gu].place[pu], groups[gc].place[pc]
        if gu == gc:
            for s in range(len(groups[gu].strategies)):
                produced = tuple(ax.outputs[idx] if idx < len(ax.outputs) else R for ax in prod_place[s])
                required = tuple(ax.inputs[k] for ax in cons_place[s])
                node_cost[gu][s] += w * edge_cost_s(t, produced, required, cons_place[s], mesh, cfg.batch, ctx)
            continue
        mat = mats.setdefault((gu, gc), [[0.0] * len(groups[gc].strategies) for _ in groups[gu].strategies])
        for su, ps in enumerate(prod_place):
            produced = tuple(ax.outputs[idx] if idx < len(ax.outputs) else R for ax in ps)
            for sc, cs in enumerate(cons_place):
                required = tuple(ax.inputs[k] for ax in cs)
                mat[su][sc] += w * edge_cost_s(t, produced, required, cs, mesh, cfg.batch, ctx)
    edges = sorted(mats)
    return edges, [mats[e] for e in edges]


#: Cost the ILP adds to a choice that consumes one parameter in two placements.  The runtime holds each
#: parameter once, in one placement (a tied embedding and head are one tensor), so such a choice cannot
#: run; large enough to lose against any other choice, small enough to keep the solvers' numerics sound.
SPLIT_PARAMETER_S = 1e3


def _tie_shared_parameters(consumers: dict[str, list[tuple[str, int]]], groups: list[_Group], group_of: dict[str, int],
                           node_cost: list[list[float]], edges: list[tuple[int, int]],
                           mats: list[list[list[float]]]) -> tuple[list[tuple[int, int]], list[list[list[float]]]]:
    """Make every consumer of a parameter (a tied embedding and output head; ``consumers``: each parameter's
    consuming reps and slots) require the same placement: choices that differ cost ``SPLIT_PARAMETER_S``, on the
    node when both consumers are in one group, else on an edge between their groups."""
    def required(name: str, slot: int, s: int) -> tuple[str, ...]:
        strat = groups[group_of[name]].place[name][s]
        return tuple("R" if ax.inputs[slot] in (None, R, "P") else ax.inputs[slot] for ax in strat)

    by_pair = {e: i for i, e in enumerate(edges)}
    edges, mats = list(edges), list(mats)
    for uses in consumers.values():
        first, slot = uses[0]
        for other, other_slot in uses[1:]:
            ga, gb = group_of[first], group_of[other]
            if ga == gb:
                for s in range(len(groups[ga].strategies)):
                    if required(first, slot, s) != required(other, other_slot, s):
                        node_cost[ga][s] += SPLIT_PARAMETER_S
                continue
            u, v = min(ga, gb), max(ga, gb)
            if (u, v) not in by_pair:
                by_pair[(u, v)] = len(edges)
                edges.append((u, v))
                mats.append([[0.0] * len(groups[v].strategies) for _ in groups[u].strategies])
            mat = mats[by_pair[(u, v)]]
            a_name, a_slot, b_name, b_slot = (first, slot, other, other_slot) if ga == u else (other, other_slot,
                                                                                              first, slot)
            for su in range(len(groups[u].strategies)):
                for sv in range(len(groups[v].strategies)):
                    if required(a_name, a_slot, su) != required(b_name, b_slot, sv):
                        mat[su][sv] += SPLIT_PARAMETER_S
    order = sorted(range(len(edges)), key=lambda i: edges[i])
    return [edges[i] for i in order], [mats[i] for i in order]


def solve_intra_op(graph: OpGraph, node_names: Iterable[str], mesh: MeshSpec, cfg: IntraOpConfig,
                   cluster: Cluster, ctx: PassContext, problem: IntraOpProblem | None = None) -> IntraOpSolution:
    """Build and solve the ILP; map the answer back onto every op and parameter of the slice.  ``problem``: the
    ILP already built for these nodes, mesh and config (``cfg.memory_slack`` and ``cfg.backend`` aside, which only
    the solve reads), so that a solve at another memory slack reuses it."""
    problem = problem or build_intra_op(graph, node_names, mesh, cfg, cluster, ctx)
    request = problem.request
    if cfg.memory_slack is not None:
        lean = min_memory_bytes(request) * (1 + cfg.memory_slack)
        request = dataclasses.replace(request, memory_budget_bytes=lean if request.memory_budget_bytes is None
                                      else min(lean, request.memory_budget_bytes))
    result = solve_ilp(request, cfg.backend)
    node_strategies: dict[str, Strategy] = {}
    params: dict[str, tuple[str, ...]] = {}
    others: dict[str, list[tuple[Strategy, float, float]]] = {}
    if result.choice:
        per_group = alternatives(request, result.choice)
        # an op and the ops it represents (the same op of the other layers) share its choice and alternatives
        chosen: dict[str, tuple[Strategy, list[tuple[Strategy, float, float]]]] = {}
        for rep in dict.fromkeys(problem.rep_of.values()):
            if rep in problem.group_of:
                gi = problem.group_of[rep]
                place = problem.groups[gi].place[rep]
                chosen[rep] = (place[result.choice[gi]], [(place[k], dt, dm) for k, dt, dm in per_group[gi]])
        for name, rep in problem.rep_of.items():
            if rep in chosen:
                strat, others[name] = chosen[rep]
            else:
                strat = tuple(AxisStrategy((R,) * len(graph[name].outputs), (R,) * len(tensor_refs(graph[name])))
                              for _ in mesh.shape)
            node_strategies[name] = strat
            for k, r in enumerate(tensor_refs(graph[name])):
                src = graph[r.name]
                if src.kind == "param" and src.target not in params:
                    params[src.target] = tuple(ax.inputs[k] or R for ax in strat)
    return IntraOpSolution(result, node_strategies, params, problem.build_time_s, len(problem.groups), mesh.names,
                           others)
