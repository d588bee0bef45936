"""Turn a chosen layout (an ``Estimate`` and its intra-op strategies) into a ``Plan``."""

from __future__ import annotations

from typing import Any

from autopar.cluster import Cluster
from autopar.inter_op.context_parallel import RUNTIME_PATH
from autopar.inter_op.estimate import Estimate
from autopar.inter_op.fp8 import plan_precision
from autopar.inter_op.pipelining import chain_ends, pipeline_carry, stack_ends
from autopar.inter_op.unit_costs import unit_sequence
from autopar.inter_op.units import is_layer_unit, unit_chain
from autopar.intra_op.strategies import R, Strategy, param_tp_placements, tensor_refs
from autopar.ir import OpGraph
from autopar.modelfile import ZOO, locate
from autopar.passes.context import PassContext
from autopar.passes.experts import expert_weights, stacked_expert_params
from autopar.plan_file import Plan, model_fingerprint
from autopar.solvers.pipeline import V_SHAPED, rank_of_chunk

MESH_AXES = ("pp", "dp", "cp", "tp")


def interleaved_chunks(layers_per_stage: list[int], v: int) -> list[tuple[int, int]]:
    """Layer ranges of the ``p * v`` chunks in pipeline order (chunk ``c`` runs on stage ``c % p``), each stage's
    layers dealt over its ``v`` chunks as evenly as they go.  A short chunk goes where the embedding (first
    chunk of the first stage) or the head (last chunk of the last stage) already adds work, as Llama 3
    balances its pipeline; the layers need not divide ``p * v``."""
    p = len(layers_per_stage)
    sizes = []
    for k, n in enumerate(layers_per_stage):
        base, extra = divmod(n, v)
        rounds = [base] * v
        order = list(range(v - 1, -1, -1)) if k == 0 and p > 1 else list(range(v))
        for r in order[:extra]:
            rounds[r] += 1
        sizes.append(rounds)
    chunks, start = [], 0
    for r in range(v):
        for k in range(p):
            chunks.append((start, start + sizes[k][r]))
            start += sizes[k][r]
    return chunks


def v_chunks(layers_per_stage: list[int]) -> list[tuple[int, int]]:
    """Layer ranges of the ``2p`` chunks of a V (rank ``k`` runs chunks ``k`` and ``2p - 1 - k``), each rank's
    layers halved between its two chunks, the odd one on its way down (the first rank's way up ends in the
    head, its way down starts at the embedding, which costs less)."""
    p = len(layers_per_stage)
    sizes = [0] * (2 * p)
    for k, n in enumerate(layers_per_stage):
        sizes[k], sizes[2 * p - 1 - k] = n - n // 2, n // 2
    chunks, start = [], 0
    for n in sizes:
        chunks.append((start, start + n))
        start += n
    return chunks


def _chunks_of(est: Estimate) -> list[tuple[int, int]]:
    lay = est.layout
    counts = [s.layers[1] - s.layers[0] for s in est.stages]
    if lay.schedule in V_SHAPED and lay.pp > 1:
        return v_chunks(counts)
    if lay.v == 1:
        return [tuple(s.layers) for s in est.stages]
    return interleaved_chunks(counts, lay.v)


def _param_stages(graph: OpGraph, est: Estimate) -> dict[str, list[int]]:
    """FQN -> the pipeline ranks that hold a copy of it (the first owns it; a tied parameter has a copy on
    the ranks of the first and the last chunk, one rank in a V)."""
    keys = unit_sequence(graph)
    lay = est.layout
    chunks = _chunks_of(est)
    stage_of_unit = {0: rank_of_chunk(lay.schedule, 0, lay.pp),
                     len(keys) - 1: rank_of_chunk(lay.schedule, len(chunks) - 1, lay.pp)}
    for c, (lo, hi) in enumerate(chunks):
        for layer in range(lo, hi):
            stage_of_unit[1 + layer] = rank_of_chunk(lay.schedule, c, lay.pp)
    unit_of = unit_chain(graph).unit_of
    out: dict[str, list[int]] = {}
    for n in graph.ops():
        unit = unit_of[n.name]
        for r in tensor_refs(n):
            src = graph[r.name]
            if src.kind == "param":
                ranks = out.setdefault(src.target, [])
                if stage_of_unit[unit] not in ranks:
                    ranks.append(stage_of_unit[unit])
    return out


def build_plan(*, graph: OpGraph, model_ref: str, config: dict[str, Any], cluster: Cluster, ctx: PassContext,
               global_batch: int, estimate: Estimate, strategies: dict[str, Strategy],
               example_inputs: str | None = None, memory_limit_bytes: float | None = None,
               alternatives: dict[str, list[tuple[Strategy, float, float]]] | None = None) -> Plan:
    lay = estimate.layout
    tp_place = param_tp_placements(graph, strategies)
    stages_of = _param_stages(graph, estimate)
    experts = {f for w in expert_weights(graph) for f in w.params} if lay.ep > 1 else set()
    parameters = {}
    for fqn, p in sorted(graph.params.items()):
        # ZeRO shards over dp x cp (the ranks that hold the same weights); the plan names it on dp; the experts
        # are split on their first dimension over ep, and ZeRO shards them over the dp / ep holding the same
        replicas = lay.expert_replicas if fqn in experts else lay.replicas
        placements = {"dp": "S(0)" if lay.zero >= 3 and replicas > 1 else R, "tp": tp_place.get(fqn, R)}
        if lay.ep > 1:
            placements["ep"] = "S(0)" if fqn in experts else R
        ranks = stages_of.get(fqn, [0])
        parameters[fqn] = {"shape": list(p.shape), "dtype": p.dtype, "stage": ranks[0], "placements": placements,
                           "aliases": list(p.aliases)}
        if not p.trainable:  # fine-tuning: held in 16 bits, no gradient, no optimizer state
            parameters[fqn]["frozen"] = True
        if p.aliases:  # the pipeline ranks holding a copy (their gradients are summed)
            parameters[fqn]["stages"] = ranks
    keys = unit_sequence(graph)
    per_stage = lay.dp * lay.cp * lay.tp
    chunks = _chunks_of(estimate)
    stages = []
    stage_to_rank = [rank_of_chunk(lay.schedule, c, lay.pp) for c in range(len(chunks))]
    for s in estimate.stages:
        own = [list(c) for i, c in enumerate(chunks) if stage_to_rank[i] == s.index]
        stages.append({
            "index": s.index, "layers": list(s.layers) if len(chunks) == lay.pp else None, "chunks": own,
            "has_embedding": stage_to_rank[0] == s.index, "has_head": stage_to_rank[-1] == s.index,
            "ranks": [s.index * per_stage, (s.index + 1) * per_stage],
            "micro_batch": lay.mbs, "recompute": lay.recompute,
            "estimated_time_per_microbatch_s": s.time_s, "estimated_memory_bytes": s.memory_bytes,
            "estimated_parts_per_microbatch_s": dict(sorted(s.parts_s.items())),
            "estimated_state_bytes": s.state_bytes, "estimated_activation_bytes": s.activation_bytes,
            "estimated_state_parts_bytes": dict(zip(("weights", "grads", "optimizer"), s.state_parts_bytes,
                                                    strict=True)),
            "estimated_gathered_weight_bytes": s.gathered_weight_bytes,
            "estimated_tp_bytes_per_microbatch": dict(sorted(s.tp_bytes.items())),
            "estimated_tp_sync_bytes_per_iteration": dict(sorted(s.tp_sync_bytes.items())),
            "estimated_ep_bytes_per_microbatch": dict(sorted(s.ep_bytes.items())),
        })
    first_of_type = {}
    for layer in graph.layers:
        first_of_type.setdefault(layer.structural_hash, layer.index)
    rep_layers = set(first_of_type.values())
    ops = {}
    for order, n in enumerate(graph.ops()):
        if (n.layer is None or n.layer in rep_layers) and n.name in strategies:
            strat = strategies[n.name]
            ops[n.name] = {"tp": {"outputs": list(strat[0].outputs), "inputs": list(strat[0].inputs)},
                           "module": n.module, "op": n.op, "order": order}
            if alternatives and alternatives.get(n.name):
                ops[n.name]["alternatives"] = [
                    {"tp": {"outputs": list(alt[0].outputs), "inputs": list(alt[0].inputs)},
                     "extra_time_s": dt, "extra_memory_bytes": dm} for alt, dt, dm in alternatives[n.name]]
    carry = pipeline_carry(graph)
    ends = stack_ends(graph)
    if carry.modules:  # the module before the stack whose outputs the stages hand on beside the hidden state
        ends["carried"] = list(carry.modules)
    if carry.loop_args:  # what the stack's loop hands from layer to layer, which the stages hand on too
        ends["layer_args"] = list(carry.loop_args)
    chain = unit_chain(graph)
    if chain.chained:  # an encoder's blocks, then the layers: the stages' layer ranges run over both
        ends.update(chain_ends(graph, [s.container for s in chain.stacks]))
        loop_args = {**graph.stack_loop_args, graph.layer_container: carry.loop_args}
        ends["stacks"] = [{"container": s.container, "layers": s.blocks,
                           "layer_args": list(loop_args.get(s.container, ()))} for s in chain.stacks]
    path = None if model_ref in ZOO else locate(model_ref)
    model = {"ref": model_ref, "path": path, "config": config, "fingerprint": model_fingerprint(graph, config),
             "layer_container": graph.layer_container, "num_layers": chain.blocks, "stack_ends": ends,
             "layer_types": {h: idx for h, idx in first_of_type.items()},
             "units": [k for k in keys if is_layer_unit(k)],  # the layers' types, in order
             "expert_weights": sorted(stacked_expert_params(graph))}
    if example_inputs is not None:
        model["example_inputs"] = example_inputs
    if carry.lost:  # what stages could not hand on (a HuggingFace model's pipeline stages are refused)
        model["pipeline_carries"] = {str(k): v for k, v in carry.lost.items()}
    return Plan(
        model=model, cluster=cluster.to_dict(), global_batch=global_batch, seq_len=graph.seq_len,
        mesh={"axes": list(MESH_AXES), "shape": [lay.pp, lay.dp, lay.cp, lay.tp]}, layout=lay.to_dict(),
        stages=stages, schedule={"name": lay.schedule, "virtual_stages": lay.v,
                                 "num_microbatches": lay.num_microbatches, "chunks": [list(c) for c in chunks],
                                 "stage_to_rank": stage_to_rank},
        zero=lay.zero, parameters=parameters, op_strategies=ops,
        estimate={**estimate.to_dict(), **({"memory_limit_bytes": memory_limit_bytes} if memory_limit_bytes else {})},
        attention=ctx.attention, precision=plan_precision(graph, ctx, tp_place, lay.tp), compile=ctx.compile,
        context_parallel=RUNTIME_PATH if lay.cp > 1 else {},
    )

