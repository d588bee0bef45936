"""Per-unit costs of the model on a tensor-parallel group: the inputs of the inter-op search.

The model is a chain of units: the ops before the block stack (``pre``: embeddings), every layer of the
stack, and the ops after it (``post``: final norm, head, loss).  For a tensor-parallel degree, a
micro-batch size and the sequence-parallel switch, one intra-op ILP over the whole graph on the 1-D
``tp`` mesh (identical layers tied, so its size does not depend on depth) chooses every op's strategy;
this module then reads off, per unit, what the pipeline and data-parallel models need: forward/backward
compute, tensor-parallel communication, parameters per device, saved activations, the unit's input
(what a pipeline boundary sends and full recomputation keeps) and the attention core (what selective
recomputation drops).  Data parallelism is priced on top, per layout (``autopar.inter_op.data_parallel``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autopar.cluster import Cluster, MeshSpec
from autopar.inter_op.units import POST, PRE, unit_chain, unit_sequence
from autopar.intra_op.problem import IntraOpConfig, IntraOpProblem, IntraOpSolution, build_intra_op, solve_intra_op
from autopar.intra_op.sharding_costs import (
    ATTENTION_OPS,
    PRODUCT_OPS,
    Gemm,
    collectives_s,
    fp8_cast_s,
    grad_placements,
    host_s,
    local_bytes,
    local_tensor_bytes,
    op_timing,
    operand_bytes,
    output_bytes,
    param_cost,
    product_gemms,
    redistribute_collectives,
    saved_bytes,
    shard_factor,
    weight_grad_s,
)
from autopar.intra_op.strategies import AxisStrategy, R, Strategy, shard_dim, tensor_refs
from autopar.ir import Node, OpGraph, Ref, TensorInfo
from autopar.kernels import memory_s
from autopar.passes.activations import storage_key
from autopar.passes.context import PassContext
from autopar.passes.experts import EXPERT_PRODUCT_OPS, stacked_weight
from autopar.passes.traffic import FP32_BYTES, LOSS_OPS
from autopar.power import NO_POWER, PowerMix, clock_fraction
from autopar.recompute_policy import is_attention_module, product_is_saved
from autopar.solvers.ilp import Backend

ATTENTION_CORE_KEYS = ("probs", "dropout_mask", "dropped_probs")


@dataclass(frozen=True, slots=True)
class UnitCost:
    """Costs of one unit for one micro-batch on one device of its tensor-parallel group."""

    fwd_s: float
    bwd_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    tp_sync_s: float  # per iteration: gradients of parameters replicated on tp but computed split (SP norms)
    tp_fwd_bytes: dict[str, float]  # collective kind -> bytes of the forward's tp collectives (sized as priced)
    tp_bwd_bytes: dict[str, float]  # the same for the backward
    tp_sync_bytes: dict[str, float]  # the same for the per-iteration gradient synchronization on tp
    param_local: dict[str, float]  # FQN -> elements one device holds (after tensor parallelism)
    activation_bytes: float  # saved for backward, per micro-batch
    input_bytes: float  # the unit's input activation on one device (pipeline send, full-recompute checkpoint)
    attention_fwd_s: float  # forward time of attention (recomputed by selective recomputation)
    attention_saved_bytes: float  # the s x s tensors math attention saves (dropped by selective recomputation)
    fwd_flops: float  # model FLOPs of the forward, whole tp group, one micro-batch
    attention_fwd_flops: float
    attention_module_recompute_s: float = 0.0  # forward time re-run when the attention module is checkpointed
    attention_module_saved_bytes: float = 0.0  # what its ops save, beyond the module's input
    attention_module_recompute_flops: float = 0.0
    full_recompute_s: float = 0.0  # forward time full recomputation re-runs (see ``_recompute_stop``)
    full_recompute_flops: float = 0.0
    op_recompute_s: float = 0.0  # forward time of what per-op checkpointing recomputes (see ``_op_checkpoint``)
    op_saved_bytes: float = 0.0  # what per-op checkpointing keeps: the unit's input and the saved ops' outputs
    op_recompute_flops: float = 0.0
    transient_bytes: float = 0.0  # memory alive only while the unit runs (fp32 logits and loss gradients)
    forward_transient_bytes: float = 0.0  # the most its forward holds at once beside what it saves
    after_backward_bytes: float = 0.0  # what it holds after the micro-batch's backward, its activations freed: the
    # framework's training metrics over the logits (``metric_bytes_per_logit``)
    param_modules: int = 0  # modules holding parameters (one ZeRO-3 collective each for per-module runtimes)
    largest_module_params: float = 0.0  # elements one device holds of the largest of them
    attention_kv_bytes: float = 0.0  # the keys and values attention reads, on one device: what context
    # parallelism gathers over its ranks (and reduce-scatters the gradients of)
    bwd_weight_s: float = 0.0  # the weight-gradient products in ``bwd_s``: a split backward's weight step
    weight_grad_residue_bytes: float = 0.0  # the output gradients of the ops with parameters, which a split
    # backward keeps from its input step to its weight step (``stage_backward_input``'s param groups)
    product_s: float = 0.0  # forward and backward time of the matrix products (FP8 casts excluded)
    attention_s: float = 0.0  # forward and backward time of attention
    fp8_cast_s: float = 0.0  # forward and backward time of the FP8 casts (``autopar.intra_op.fp8``)
    fp8_params: float = 0.0  # elements one device holds of the FP8 Linears' weights
    expert_fqns: tuple[str, ...] = ()  # the stacked expert weights (``autopar.passes.experts``)
    expert_counts: tuple[int, ...] = ()  # per expert weight, the experts one device holds on tp (all of them,
    # or 1 / tp of them when tp splits the expert dimension); 0 when tp splits another of its dimensions,
    # which expert parallelism does not run
    expert_dispatch_bytes: float = 0.0  # the slots entering the experts (the first expert product's
    # activation input) on one device: what expert parallelism's dispatch all-to-all moves
    expert_combine_bytes: float = 0.0  # the experts' output slots (the last expert product's output)
    expert_products: tuple[ExpertProduct, ...] = ()  # their GEMMs, which expert parallelism reshapes
    fwd_host_s: float = 0.0  # CPU time of issuing the forward's ops (``sharding_costs.host_s``): the host
    # timeline the GPU's ``fwd_s`` runs behind
    bwd_host_s: float = 0.0  # the same for the backward
    power: PowerMix = NO_POWER  # its kernels at the boost clock, as the power manager sees them (``autopar.power``)
    clock: float = 1.0  # the SM clock its forward and backward hold under the power cap, over the boost clock;
    # every time above is at this clock
    frozen_fqns: tuple[str, ...] = ()  # the parameters of ``param_local`` that do not train (fine-tuning): no
    # gradient, no optimizer state
    params_local: float = field(init=False)  # elements one device holds of all of them (read per layout)
    frozen_local: float = field(init=False)  # of which frozen

    def __post_init__(self) -> None:
        object.__setattr__(self, "params_local", sum(self.param_local.values()))
        object.__setattr__(self, "frozen_local", sum(self.param_local[f] for f in self.frozen_fqns))

    @property
    def param_tensors(self) -> int:
        return len(self.param_local)

    @property
    def expert_params_local(self) -> float:
        """Elements one device holds of the stacked expert weights."""
        return sum(self.param_local.get(f, 0.0) for f in self.expert_fqns)

    @property
    def frozen_expert_local(self) -> float:
        """Elements one device holds of the frozen stacked expert weights."""
        return sum(self.param_local.get(f, 0.0) for f in self.expert_fqns if f in self.frozen_fqns)

    def parameter_split(self, ep: int) -> tuple[float, float, float, float]:
        """(dense, expert-parallel, frozen dense, frozen expert-parallel) elements one device holds; with
        ``ep == 1`` the experts count as dense."""
        expert = self.expert_params_local if ep > 1 else 0.0
        frozen_expert = self.frozen_expert_local if ep > 1 else 0.0
        return self.params_local - expert, expert, self.frozen_local - frozen_expert, frozen_expert


@dataclass(frozen=True, slots=True)
class ExpertProduct:
    """One expert product's local GEMMs, each with the field (``m``, ``n`` or ``k``) that runs over the
    tokens' slots: expert parallelism gives a rank ``1 / ep`` of the experts (the GEMMs' batch) and ``ep``
    times their slots (``autopar.inter_op.expert_parallel``)."""

    fwd: tuple[tuple[Gemm, str], ...]
    bwd: tuple[tuple[Gemm, str], ...]
    weight: int  # which of ``bwd`` makes the weights' gradient (-1: none)
    memory_fwd_s: float  # streaming its operands and result, the floor of its time
    memory_bwd_s: float
    weight_memory_s: float  # the weights' part of ``memory_fwd_s`` (read once; twice in backward, with
    # their gradient written): a rank streams ``1 / ep`` of them


def _replicated(graph: OpGraph, names: list[str], axes: int) -> dict[str, Strategy]:
    return {name: tuple(AxisStrategy((R,) * len(graph[name].outputs), (R,) * len(tensor_refs(graph[name])))
                        for _ in range(axes)) for name in names}


def solve_tp(graph: OpGraph, cluster: Cluster, ctx: PassContext, tp: int, mbs: int, sp: bool,
             backend: Backend = "cbc", time_limit_s: float = 60.0, grad_sync_weight: float = 0.0,
             memory_slack: float | None = None, built: dict[tuple, IntraOpProblem] | None = None,
             ) -> tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]:
    """Every op's strategy on the ``tp`` mesh at micro-batch ``mbs`` (all replicated when ``tp == 1``).
    ``built``: ILPs built by earlier calls, keyed by ``(tp, mbs, sp)`` and the solve settings: the fast and the
    lean solve share one."""
    mesh = MeshSpec.on_cluster(cluster, ("tp",), (tp,))
    ops = [n.name for n in graph.ops()]
    if tp == 1:
        return mesh, _replicated(graph, ops, 1), None
    cfg = IntraOpConfig(batch=mbs, sequence_parallel=sp, split_batch_on_tp=ctx.framework.tp_splits_batch,
                        shard_block_linears=ctx.framework.tp_layout == "megatron",
                        backend=backend, time_limit_s=time_limit_s,
                        grad_sync_weight=grad_sync_weight, memory_slack=memory_slack)
    key = (tp, mbs, sp, backend, time_limit_s, grad_sync_weight)
    problem = built.get(key) if built is not None else None
    if problem is None:
        problem = build_intra_op(graph, ops, mesh, cfg, cluster, ctx)
        if built is not None:
            built[key] = problem
    sol = solve_intra_op(graph, ops, mesh, cfg, cluster, ctx, problem)
    if not sol.node_strategies:
        raise RuntimeError(f"intra-op ILP returned no solution ({sol.result.status})")
    return mesh, sol.node_strategies, sol


def unit_costs(graph: OpGraph, strategies: dict[str, Strategy], mesh: MeshSpec, mbs: int, cluster: Cluster,
               ctx: PassContext) -> dict[str, UnitCost]:
    """Read per-unit costs off the chosen strategies."""
    out = {}
    chain = unit_chain(graph)
    units = {key: list(names) for key, names in chain.members.items()}
    users = graph.users()
    for key, names in units.items():
        cost = _unit_cost(graph, names, strategies, mesh, mbs, cluster, ctx)
        transient = _forward_transient_bytes(graph, names, strategies, mesh, mbs, ctx, users)
        out[key] = dataclasses.replace(cost, forward_transient_bytes=transient)
    for stack in chain.stacks:
        first, feeder = chain.keys[stack.first_unit], chain.keys[stack.first_unit - 1]
        # a block type is costed off its second instance, whose input comes from a block like it: the edge into
        # the first is priced on the unit before it, where that unit is the only one of its kind (pre; an encoder's
        # last block, with the decoder's embedding)
        if chain.keys.count(first) > 1 and chain.keys.count(feeder) == 1:
            into = {name for name, unit in chain.unit_of.items() if unit == stack.first_unit}
            out[feeder] = _with_first_block_input(out[feeder], graph, set(units[feeder]), into, strategies, mesh,
                                                  mbs, ctx)
    return out


def _with_first_block_input(feeder: UnitCost, graph: OpGraph, feeder_nodes: set[str], first_block: set[str],
                            strategies: dict[str, Strategy], mesh: MeshSpec, mbs: int, ctx: PassContext) -> UnitCost:
    """``feeder`` plus the resharding of what it hands the first block of a stack (``first_block``: its ops; the
    embedding's output gathered for the first norm, say)."""
    edges = _Reshards(mesh, mbs, ctx, fwd_bytes=dict(feeder.tp_fwd_bytes), bwd_bytes=dict(feeder.tp_bwd_bytes))
    for n in graph.ops():
        if n.name not in first_block or n.name not in strategies:
            continue
        strat = strategies[n.name]
        for k, r in enumerate(tensor_refs(n)):
            if r.name in feeder_nodes and r.name in strategies:
                edges.add(graph.tensor(r), r, _produced(strategies[r.name], r), tuple(ax.inputs[k] for ax in strat),
                          strat)
    return dataclasses.replace(feeder, tp_fwd_s=feeder.tp_fwd_s + edges.fwd_s, tp_bwd_s=feeder.tp_bwd_s + edges.bwd_s,
                               tp_fwd_bytes=edges.fwd_bytes, tp_bwd_bytes=edges.bwd_bytes)


def _produced(producer: Strategy, ref: Ref) -> tuple:
    """The placements in which ``producer`` makes output ``ref.index``."""
    return tuple(ax.outputs[ref.index] if ref.index < len(ax.outputs) else R for ax in producer)


def loss_transient_bytes_per_logit(ctx: PassContext) -> float:
    """What the loss holds per logit while it runs, beyond what it saves (``Framework.cross_entropy``).  Under bf16
    autocast the loss runs in fp32 (``log_softmax`` is on autocast's fp32 list): beside the fp32 log-probabilities
    it saves, the fp32 copy of the logits in forward and the fp32 gradient of the log-probabilities in backward,
    8 bytes.  Megatron's vocab-parallel loss (fused or not) rewrites its fp32 copy in place (the softmax it saves):
    beside it, the 16-bit logits it was cast from in forward and the 16-bit gradient it is cast back to in
    backward.  A fused loss rewrites the 16-bit logits in place: nothing."""
    kind = ctx.framework.cross_entropy
    if kind == "fused":
        return 0.0
    return ctx.precision.activation_bytes if kind.startswith("vocab_parallel") else 2 * FP32_BYTES


def metric_bytes_per_logit(graph: OpGraph, logits: TensorInfo, ctx: PassContext) -> float:
    """What the framework's training metrics hold per logit after the backward (``Framework.metric_cross_entropies``,
    one after the other): the logits the training loop keeps for them, and one metric's fp32 copy of them and its
    fp32 log-probabilities; nothing without metrics."""
    if not ctx.framework.metric_cross_entropies:
        return 0.0
    return graph.width(logits, ctx.precision.activation_bytes) + 2 * FP32_BYTES


def _op_checkpoint_saves(node_op: str, product_index: int) -> bool:
    """Whether per-op checkpointing keeps this op's output (``product_index``: 1 for a unit's first product)."""
    if node_op in ATTENTION_OPS:
        return True
    return node_op in PRODUCT_OPS and product_is_saved(product_index)


def _recompute_stop(graph: OpGraph, names: list[str], early_stop: bool) -> int:
    """Index of the last op a recomputation re-runs.  Non-reentrant checkpointing stops as soon as every
    tensor backward needs is back (``torch.utils.checkpoint``'s early stop), so the ops after the last one
    whose output (or internal state) is saved are never re-run; reentrant checkpointing re-runs them all."""
    if not early_stop:
        return len(names) - 1
    producers = {t.key.split(":", 1)[0] for name in names for t in graph[name].annotations.get("saved", ())}
    return max((i for i, name in enumerate(names) if name in producers), default=len(names) - 1)


def _attention_module_nodes(graph: OpGraph, names: list[str]) -> list[str]:
    """The ops of a layer that run inside its attention module (the child the runtime checkpoints for
    ``recompute=selective``: named attn/self_attn/attention, or of a type whose name says attention)."""
    prefix = {layer.index: layer.prefix for layer in graph.layers}
    child_type: dict[str, str] = {}
    for name in names:
        n = graph[name]
        if n.layer is None:
            continue
        rest = n.module[len(prefix[n.layer]) + 1:] if n.module.startswith(prefix[n.layer] + ".") else ""
        if rest and "." not in rest:
            child_type.setdefault(rest, n.module_type)
    out = []
    for name in names:
        n = graph[name]
        if n.layer is None or not n.module.startswith(prefix[n.layer] + "."):
            continue
        child = n.module[len(prefix[n.layer]) + 1:].split(".", 1)[0]
        if is_attention_module(child, child_type.get(child, "")):
            out.append(name)
    return out


def _add_bytes(into: dict[str, float], collectives: tuple[tuple[int, str, float], ...]) -> None:
    for _, kind, nbytes in collectives:
        into[kind] = into.get(kind, 0.0) + nbytes


@dataclass
class _Reshards:
    """The tensor-parallel resharding of a unit's edges, forward and backward, in seconds and bytes.

    A tensor resharded the same way for several consumers (q, k and v reading one norm output) is resharded
    once, and the gradients they send back are summed before one resharding."""

    mesh: MeshSpec
    mbs: int
    ctx: PassContext
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_bytes: dict[str, float] = field(default_factory=dict)
    bwd_bytes: dict[str, float] = field(default_factory=dict)
    seen: set[tuple] = field(default_factory=set)

    def add(self, t: TensorInfo, ref: Ref, produced: tuple, required: tuple, consumer: Strategy) -> None:
        if (ref, produced, required) not in self.seen:
            self.seen.add((ref, produced, required))
            self.fwd_s += self._priced(t, produced, required, self.fwd_bytes)
        grads = grad_placements(produced, required, consumer)
        if t.requires_grad and t.is_floating and (ref, *grads) not in self.seen:
            self.seen.add((ref, *grads))
            self.bwd_s += self._priced(t, *grads, self.bwd_bytes)

    def _priced(self, t: TensorInfo, src: tuple, dst: tuple, into: dict[str, float]) -> float:
        collectives = redistribute_collectives(t, src, dst, self.mesh, self.mbs, self.ctx)
        _add_bytes(into, collectives)
        return collectives_s(collectives, self.mesh)


def _forward_transient_bytes(graph: OpGraph, names: list[str], strategies: dict[str, Strategy], mesh: MeshSpec,
                             mbs: int, ctx: PassContext, users: dict[str, list[str]]) -> float:
    """The most the unit's forward holds at once of tensors nobody saves for backward: each op output
    lives from its op to its last reader (through the views of it; to the unit's end if a later unit
    reads it).  Saved ones count in ``activation_bytes``.  Dense layers hold a tensor or two this way;
    a mixture of experts its dispatch buffers and the copies ``einsum`` makes."""
    order = {name: i for i, name in enumerate(names)}
    saved = {t.key for name in names for t in graph[name].annotations.get("saved", ())}
    end = len(names)

    def last_read(name: str) -> int:
        last = order[name]
        for user in users.get(name, ()):
            if user not in order:
                return end
            last = max(last, last_read(user) if graph[user].alias_of == name else order[user])
        return last

    change = [0.0] * (end + 2)
    for i, name in enumerate(names):
        node = graph[name]
        if node.alias_of is not None:
            continue  # a view: no memory of its own
        strat = strategies[name]
        last = last_read(name)
        for j, t in enumerate(node.outputs):
            if t is None or f"{name}:{j}" in saved:
                continue
            nbytes = local_tensor_bytes(graph, t, tuple(ax.outputs[j] for ax in strat), mesh, mbs, ctx)
            change[i] += nbytes
            change[last + 1] -= nbytes
    peak = live = 0.0
    for delta in change:
        live += delta
        peak = max(peak, live)
    return peak


def _unit_cost(graph: OpGraph, names: list[str], strategies: dict[str, Strategy], mesh: MeshSpec, mbs: int,
               cluster: Cluster, ctx: PassContext) -> UnitCost:
    members = set(names)
    stop = _recompute_stop(graph, names, ctx.framework.recompute_early_stop)
    attn_nodes = _attention_module_nodes(graph, names)
    attn_members = set(attn_nodes)
    attn_stop = _recompute_stop(graph, attn_nodes, ctx.framework.recompute_early_stop) if attn_nodes else -1
    attn_rank = {name: i for i, name in enumerate(attn_nodes)}
    attn_module_s = attn_module_bytes = attn_module_flops = 0.0
    full_recompute = full_recompute_flops = 0.0
    products = 0
    op_recompute = op_saved = op_recompute_flops = transient = after_backward = 0.0
    modules: dict[str, float] = {}
    fwd = bwd = tp_sync = attn_s = attn_bytes = bwd_weight = residue = 0.0
    host_fwd = host_bwd = 0.0
    edges = _Reshards(mesh, mbs, ctx)
    sync_bytes: dict[str, float] = {}
    act = 0.0
    input_bytes = 0.0
    params: dict[str, float] = {}
    frozen: list[str] = []
    fwd_flops = attn_flops = kv_bytes = 0.0
    product = attention = fp8_cast = 0.0
    fp8_weights: set[str] = set()
    seen: set[str] = set()
    experts = _ExpertSlots(graph, mesh, mbs, ctx, cluster)
    timings = [op_timing(graph[name], graph, strategies[name], mesh, mbs, cluster, ctx) for name in names]
    power = sum((t.power() for t in timings), PowerMix())
    phi = clock_fraction(cluster, power)  # the clock the unit's kernels hold together under the power cap
    for i, name in enumerate(names):
        node = graph[name]
        strat = strategies[name]
        f, b = timings[i].at_clock(phi)
        hf, hb = host_s(node, ctx)
        host_fwd, host_bwd = host_fwd + hf, host_bwd + hb
        reruns = i <= stop
        fwd, bwd = fwd + f, bwd + b
        bwd_weight += min(b, weight_grad_s(node, graph, strat, mesh, mbs, cluster, ctx) / phi)
        cast_f, cast_b = fp8_cast_s(node, graph, strat, mesh, mbs, cluster, ctx)
        if cast_f or cast_b:
            fp8_cast += cast_f + cast_b
            fp8_weights.add(tensor_refs(node)[1].name)
        if node.op in PRODUCT_OPS:
            product += f + b - cast_f - cast_b
        elif node.op in ATTENTION_OPS:
            attention += f + b
        if any(graph[r.name].kind == "param" and graph.tensor(r).requires_grad for r in tensor_refs(node)):
            residue += output_bytes(node, graph, strat, mesh, mbs, ctx)
        flops = node.annotations["flops"].fwd * graph.scale(node, mbs)
        fwd_flops += flops
        if node.op in ATTENTION_OPS:
            attn_s += f
            attn_flops += flops
            kv_bytes += sum(operand_bytes(node, graph, strat, mesh, mbs, ctx, k) for k in (1, 2))
        if node.op in PRODUCT_OPS and node.annotations["flops"].fwd > 0:
            products += 1
        experts.add(node, strat)
        if reruns:
            full_recompute += f
            full_recompute_flops += flops
        if attn_rank.get(name, attn_stop + 1) <= attn_stop:
            attn_module_s += f
            attn_module_flops += flops
        if _op_checkpoint_saves(node.op, products):
            op_saved += output_bytes(node, graph, strat, mesh, mbs, ctx)
        elif reruns:
            op_recompute += f
            op_recompute_flops += flops
        refs = tensor_refs(node)
        produced_of: dict[str, tuple] | None = {} if ctx.framework.sp_saves_sharded_input else None
        if node.op in LOSS_OPS:
            logits = graph.tensor(refs[0])
            shards = shard_factor(tuple(ax.inputs[0] for ax in strat), mesh)
            transient += logits.numel_at(mbs) * loss_transient_bytes_per_logit(ctx) / shards
            after_backward += logits.numel_at(mbs) * metric_bytes_per_logit(graph, logits, ctx) / shards
        for k, r in enumerate(refs):
            src = graph[r.name]
            required = tuple(ax.inputs[k] for ax in strat)
            if src.kind == "param":
                pc = param_cost(src.out, required, strat, mesh, ctx)
                tp_sync += pc.per_iteration_s
                _add_bytes(sync_bytes, pc.sync)
                if src.target not in params:
                    params[src.target] = src.out.numel_at(1) / shard_factor(required, mesh)
                    if not src.out.requires_grad:
                        frozen.append(src.target)
                    owner = src.target.rsplit(".", 1)[0] if "." in src.target else ""
                    modules[owner] = modules.get(owner, 0.0) + params[src.target]
                continue
            if r.name not in strategies:  # inputs, buffers, constants: produced replicated, no gradient
                continue
            t = graph.tensor(r)
            produced = _produced(strategies[r.name], r)
            edges.add(t, r, produced, required, strat)
            if produced_of is not None:
                produced_of.setdefault(storage_key(graph, r), produced)
            if r.name not in members and graph[r.name].kind == "op" and t.is_floating:
                input_bytes = max(input_bytes, t.numel_at(mbs) * ctx.precision.activation_bytes
                                  / shard_factor(produced, mesh))
        saved = [t for t in node.annotations.get("saved", ()) if t.key not in seen]
        seen.update(t.key for t in saved)
        if saved:
            for t, b_ in zip(saved, saved_bytes(graph, node, strat, mesh, mbs, saved, produced_of), strict=True):
                act += b_
                if t.key.rsplit(":", 1)[-1] in ATTENTION_CORE_KEYS:
                    attn_bytes += b_
                if name in attn_members and t.key.split(":", 1)[0] in attn_members:
                    attn_module_bytes += b_  # made inside the module: freed when it is checkpointed
    return UnitCost(fwd, bwd, edges.fwd_s, edges.bwd_s, tp_sync, edges.fwd_bytes, edges.bwd_bytes, sync_bytes,
                    params, act,
                    input_bytes, attn_s, attn_bytes, fwd_flops, attn_flops,
                    attention_module_recompute_s=attn_module_s, attention_module_saved_bytes=attn_module_bytes,
                    attention_module_recompute_flops=attn_module_flops,
                    full_recompute_s=full_recompute, full_recompute_flops=full_recompute_flops,
                    op_recompute_s=op_recompute, op_saved_bytes=input_bytes + op_saved,
                    op_recompute_flops=op_recompute_flops, transient_bytes=transient,
                    after_backward_bytes=after_backward, param_modules=len(modules),
                    largest_module_params=max(modules.values(), default=0.0), attention_kv_bytes=kv_bytes,
                    bwd_weight_s=bwd_weight, weight_grad_residue_bytes=residue, product_s=product,
                    attention_s=attention, fp8_cast_s=fp8_cast,
                    fp8_params=sum(params.get(graph[w].target, 0.0) for w in fp8_weights),
                    expert_fqns=tuple(experts.counts), expert_counts=tuple(experts.counts.values()),
                    expert_dispatch_bytes=experts.dispatch_bytes(), expert_combine_bytes=experts.combine_bytes(),
                    expert_products=tuple(experts.products), fwd_host_s=host_fwd, bwd_host_s=host_bwd, power=power,
                    clock=phi, frozen_fqns=tuple(frozen))


@dataclass
class _ExpertSlots:
    """The stacked expert weights of a unit, and the slots its experts modules take and give: per module,
    the activation input of its first product and the output of its last."""

    graph: OpGraph
    mesh: MeshSpec
    mbs: int
    ctx: PassContext
    cluster: Cluster
    counts: dict[str, int] = field(default_factory=dict)
    first_in: dict[str, float] = field(default_factory=dict)
    last_out: dict[str, float] = field(default_factory=dict)
    products: list[ExpertProduct] = field(default_factory=list)

    def add(self, node: Node, strat: Strategy) -> None:
        if node.op not in EXPERT_PRODUCT_OPS:
            return
        refs = tensor_refs(node)
        weights = [(k, fqn) for k, fqn in enumerate(stacked_weight(self.graph, r) for r in refs) if fqn is not None]
        if not weights:
            return
        for k, fqn in weights:
            placements = tuple(ax.inputs[k] for ax in strat)
            experts = self.graph.params[fqn].shape[0]
            dims = {shard_dim(p) for p in placements if p != R}
            self.counts[fqn] = experts // shard_factor(placements, self.mesh) if dims <= {0} else 0
        self._product(node, strat, weights[0][0])
        taken = {k for k, _ in weights}
        acts = [k for k, r in enumerate(refs) if self.graph[r.name].kind == "op" and k not in taken]
        if node.module not in self.first_in and acts:
            self.first_in[node.module] = operand_bytes(node, self.graph, strat, self.mesh, self.mbs, self.ctx, acts[0])
        self.last_out[node.module] = output_bytes(node, self.graph, strat, self.mesh, self.mbs, self.ctx)

    def _product(self, node: Node, strat: Strategy, weight: int) -> None:
        gemms = product_gemms(node, self.graph, strat, self.mesh, self.mbs)
        if gemms is None or weight not in (0, 1):
            return
        refs = tensor_refs(node)
        grads = [k for k in (0, 1) if self.graph.tensor(refs[k]).requires_grad]
        # the slots run along the activation's own dims: m when it is the first operand, else n; in the
        # backward, dA = dC B^T is (m, k, n) and dB = A^T dC is (k, n, m)
        fwd_field = "m" if weight == 1 else "n"
        bwd_field = {(0, 1): "m", (1, 1): "k", (0, 0): "k", (1, 0): "n"}
        fwd_bytes, bwd_bytes = local_bytes(node, self.graph, strat, self.mesh, self.mbs, self.ctx)
        weight_bytes = operand_bytes(node, self.graph, strat, self.mesh, self.mbs, self.ctx, weight)
        self.products.append(ExpertProduct(
            tuple((g, fwd_field) for g in gemms[0]),
            tuple((g, bwd_field[(k, weight)]) for g, k in zip(gemms[1], grads)),
            grads.index(weight) if weight in grads else -1,
            memory_s(self.cluster, fwd_bytes), memory_s(self.cluster, bwd_bytes),
            memory_s(self.cluster, weight_bytes)))

    def dispatch_bytes(self) -> float:
        return sum(self.first_in.values())

    def combine_bytes(self) -> float:
        return sum(self.last_out.values())


__all__ = ["POST", "PRE", "UnitCost", "solve_tp", "unit_costs", "unit_sequence"]
