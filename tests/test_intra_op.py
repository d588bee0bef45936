"""Intra-op ILP: rediscovery of Megatron and data parallelism, sequence parallelism, backend agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from autopar.passes import PassContext, run_pipeline
from autopar.solvers.evaluate import objective_s
from autopar.solvers.ilp import solve_ilp
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.cluster import MeshSpec, load_cluster
from autopar.frontend import trace_model
from autopar.intra_op.problem import IntraOpConfig, build_intra_op, solve_intra_op

A100 = load_cluster("a100-80gb")
FIXTURES = Path(__file__).resolve().parent / "fixtures"
CTX = PassContext(cluster=A100)


class TwoLayerMLP(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def _mlp_graph(h: int):
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = TwoLayerMLP(h)
    g = autopar.trace(m, (torch.zeros(1, h),), loss_fn=lambda out, x: out.pow(2).mean())
    return run_pipeline(g, CTX)


def _solve(g, mesh, cfg):
    return solve_intra_op(g, [n.name for n in g.ops()], mesh, cfg, A100, CTX)


def _collectives(g, sol, mesh, cfg):
    """(forward, backward) resharding events of the chosen solution, from the edge cost model."""
    from autopar.intra_op.sharding_costs import consumer_grad, producer_grad
    from autopar.intra_op.strategies import tensor_refs

    fwd, bwd = [], []
    for n in g.ops():
        for k, r in enumerate(tensor_refs(n)):
            if r.name not in sol.node_strategies:
                continue
            prod = sol.node_strategies[r.name]
            cons = sol.node_strategies[n.name]
            produced = tuple(ax.outputs[r.index] for ax in prod)
            required = tuple(ax.inputs[k] for ax in cons)
            if produced != required:
                fwd.append((r.name, n.name, produced, required))
            t = g.tensor(r)
            if t.requires_grad:
                gc = tuple(consumer_grad(p, cons, a) for a, p in enumerate(required))
                gp = tuple(producer_grad(p) for p in produced)
                if gc != gp:
                    bwd.append((r.name, n.name, gc, gp))
    return fwd, bwd


def test_wide_mlp_on_8_gpus_is_megatron():
    g = _mlp_graph(8192)
    mesh = MeshSpec.on_cluster(A100, ("tp",), (8,))
    cfg = IntraOpConfig(batch=8)
    sol = _solve(g, mesh, cfg)
    assert sol.result.status == "optimal"
    cpsat = _solve(g, mesh, IntraOpConfig(batch=8, backend="cpsat")).result
    assert cpsat.objective_s == pytest.approx(sol.result.objective_s, rel=1e-6)
    assert sol.param_placements["fc1.weight"] == ("S(0)",)  # column-parallel (weight is [out, in])
    assert sol.placements_by_axis()["fc2.bias"] == {"tp": "R"}  # added on one rank: stored replicated
    assert sol.op_strategies()["linear"]["tp"] == {"outputs": ["S(1)"], "inputs": ["R", "S(0)", "S(0)"]}
    assert sol.param_placements["fc2.weight"] == ("S(1)",)  # row-parallel
    fwd, bwd = _collectives(g, sol, mesh, cfg)
    assert [(p, r) for _, _, p, r in fwd if p == ("P",)] == [(("P",), ("R",))]  # one all-reduce forward
    assert [(c, p) for _, _, c, p in bwd] == [(("P",), ("R",))]  # and one backward


def test_narrow_mlp_with_large_batch_is_data_parallel():
    g = _mlp_graph(64)
    mesh = MeshSpec.on_cluster(A100, ("tp",), (8,))
    sol = _solve(g, mesh, IntraOpConfig(batch=4096))
    cpsat = _solve(g, mesh, IntraOpConfig(batch=4096, backend="cpsat")).result
    assert cpsat.objective_s == pytest.approx(sol.result.objective_s, rel=1e-6)
    assert all(p == ("R",) for p in sol.param_placements.values())
    for n in g.ops():
        if n.op == "aten.linear.default":
            assert sol.node_strategies[n.name][0].inputs[0] == "S(0)"  # batch sharded


def test_backends_agree_on_the_mlp():
    g = _mlp_graph(1024)
    mesh = MeshSpec.on_cluster(A100, ("tp",), (8,))
    results = {b: _solve(g, mesh, IntraOpConfig(batch=64, backend=b)).result for b in ("cbc", "cpsat")}
    assert results["cbc"].objective_s == pytest.approx(results["cpsat"].objective_s, rel=1e-6)


@pytest.fixture(scope="module")
def gpt3_block():
    cfg = {"layers": 24, "hidden": 12288, "heads": 96, "vocab": 1024, "seq_len": 2048}
    return trace_model("gpt", cfg, ctx=CTX).graph


def _block_solution(graph, sp: bool, backend: str = "cbc"):
    cluster = A100.with_overrides(gpus=32)
    mesh = MeshSpec.on_cluster(cluster, ("tp",), (8,))
    # one pipeline stage of 16 identical layers: 64 micro-batches, 4 in flight; their state fits 80 GB only
    # with the weights split over tp
    cfg = IntraOpConfig(batch=1, grad_sync_weight=1 / 64, activation_multiplier=4,
                        memory_budget_bytes=cluster.usable_memory_bytes, sequence_parallel=sp, backend=backend)
    nodes = [n.name for n in graph.ops() if n.layer is not None and n.layer < 16]
    return solve_intra_op(graph, nodes, mesh, cfg, cluster, CTX)


@pytest.mark.parametrize("sp", [True, False])
def test_gpt_block_on_tp8(gpt3_block, sp):
    sol = _block_solution(gpt3_block, sp)
    assert sol.result.status == "optimal"
    place = sol.param_placements
    for name in ("q", "k", "v"):
        assert place[f"blocks.0.attn.{name}.weight"][0] == "S(0)"  # column-parallel on tp
    assert place["blocks.0.mlp.fc.weight"][0] == "S(0)" and place["blocks.0.mlp.proj.weight"][0] == "S(1)"
    ops = {n.name: n for n in gpt3_block.ops() if n.layer == 3}
    for name, node in ops.items():
        strat = sol.node_strategies[name]
        if node.op == "aten.scaled_dot_product_attention.default":
            assert strat[0].outputs[0] == "S(1)"  # heads sharded on tp
        if node.op == "aten.layer_norm.default":
            assert strat[0].outputs[0] == ("S(1)" if sp else "R")  # sequence parallel when available


@pytest.mark.parametrize("sp", [True, False])
def test_backends_agree_on_the_gpt_block(gpt3_block, sp):
    cbc, cpsat = (_block_solution(gpt3_block, sp, b).result for b in ("cbc", "cpsat"))
    assert cbc.status == cpsat.status == "optimal"
    assert cbc.objective_s == pytest.approx(cpsat.objective_s, rel=1e-6)


def test_sequence_parallelism_pays(gpt3_block):
    assert _block_solution(gpt3_block, True).result.objective_s < _block_solution(gpt3_block, False).result.objective_s


def test_layer_tying_keeps_the_problem_size_flat():
    cfg = {"hidden": 256, "heads": 8, "vocab": 512, "seq_len": 64}
    mesh = MeshSpec.on_cluster(A100, ("tp",), (4,))
    sizes = []
    for layers in (2, 6):
        g = trace_model("gpt", {**cfg, "layers": layers}, ctx=CTX).graph
        p = build_intra_op(g, [n.name for n in g.ops()], mesh, IntraOpConfig(batch=8), A100, CTX)
        sizes.append((len(p.request.node_names), p.request.num_variables))
    assert sizes[0] == sizes[1]


def test_blocks_of_a_second_stack_share_decisions_and_lose_nothing(monkeypatch):
    """An encoder-decoder's other stack (T5's encoder, outside the layers) ties its identical blocks as the layers
    do: the problem does not grow with its depth, and the tied optimum is the untied one (identical blocks have
    an optimum that treats them alike)."""
    import autopar.intra_op.problem as problem

    mesh = MeshSpec.on_cluster(A100, ("tp",), (2,))
    cfg = IntraOpConfig(batch=4)
    sizes, solved = [], {}
    for layers in (3, 5):
        g = trace_model(f"hf:{FIXTURES / 'hf_configs' / 't5'}", {"num_layers": layers, "num_decoder_layers": layers},
                        seq_len=32, ctx=CTX).graph
        assert g.layer_container == "decoder.block"
        p = build_intra_op(g, [n.name for n in g.ops()], mesh, cfg, A100, CTX)
        sizes.append(len(p.request.node_names))
        if layers == 3:
            solved["tied"] = _solve(g, mesh, cfg).result.objective_s
            monkeypatch.setattr(problem, "_tie_other_stacks", lambda *args: None)
            g = g.copy()  # a graph keeps what it derived from its structure (the tied slice): a fresh copy does not
            untied = build_intra_op(g, [n.name for n in g.ops()], mesh, cfg, A100, CTX)
            assert len(untied.request.node_names) > sizes[0]
            solved["untied"] = _solve(g, mesh, cfg).result.objective_s
            monkeypatch.undo()
    assert sizes[0] == sizes[1]
    assert solved["tied"] == pytest.approx(solved["untied"], rel=1e-6)


def test_infeasible_memory_reports_the_minimum():
    g = _mlp_graph(1024)
    mesh = MeshSpec.on_cluster(A100, ("tp",), (8,))
    p = build_intra_op(g, [n.name for n in g.ops()], mesh, IntraOpConfig(batch=8, memory_budget_bytes=1e3),
                       A100, CTX)
    r = solve_ilp(p.request)
    assert r.status == "infeasible" and r.min_memory_bytes > 1e3
    roomy = solve_ilp(type(p.request)(**{**_fields(p.request), "memory_budget_bytes": r.min_memory_bytes * 1.001}))
    assert roomy.status == "optimal"
    assert objective_s(p.request, roomy.choice) == pytest.approx(roomy.objective_s)


def _fields(req):
    from dataclasses import fields

    return {f.name: getattr(req, f.name) for f in fields(req)}


def test_without_sequence_parallelism_the_residual_stream_stays_whole():
    """Without sp the row-parallel products' partial sums are all-reduced and the residual stream's dropout
    and additions run whole on every tp rank (Megatron-LM, and the runtime's RowwiseParallel): the ILP must
    not reduce-scatter them into a stream split on the hidden dimension, which would price that work, its
    saved tensors and the pipeline sends at 1/tp."""
    cfg = {"layers": 2, "hidden": 4096, "heads": 32, "vocab": 1024, "seq_len": 2048, "dropout": 0.1}
    graph = trace_model("gpt", cfg, ctx=CTX).graph
    cluster = A100.with_overrides(gpus=8)
    mesh = MeshSpec.on_cluster(cluster, ("tp",), (8,))
    layer = [n for n in graph.ops() if n.layer is not None]
    for sp in (False, True):
        sol = solve_intra_op(graph, [n.name for n in layer], mesh, IntraOpConfig(batch=1, sequence_parallel=sp),
                             cluster, CTX)
        residual = [n.name for n in layer if n.layer == 1 and n.op == "aten.add.Tensor"]
        assert len(residual) == 2  # x + attn(x), then + mlp(...)
        for name in residual:
            tp = sol.node_strategies[name][0]
            if sp:
                assert tp.outputs[0] == "S(1)", (name, tp)  # split on the sequence between the regions
            else:
                assert tp.outputs[0] == "R" and set(tp.inputs) == {"R"}, (name, tp)


def test_a_fixed_tensor_parallel_plan_splits_every_linear_of_the_block():
    """A 22B-sized layer with sequence parallelism at micro-batch 4: left free, the ILP keeps the weights
    replicated and splits the sequence (its gradient sync counted at 1/16); a framework whose tensor-parallel
    plan is fixed (``tp_layout = "megatron"``) splits every Linear, and the ILP then picks Megatron's pairs."""
    cfg = {"layers": 2, "hidden": 6144, "heads": 64, "vocab": 1024, "seq_len": 2048}
    graph = trace_model("gpt", cfg, ctx=CTX).graph
    cluster = A100.with_overrides(gpus=8)
    mesh = MeshSpec.on_cluster(cluster, ("tp",), (8,))
    linears = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc", "mlp.proj")
    placed = {}
    for fixed in (False, True):
        sol = _solve(graph, mesh, IntraOpConfig(batch=4, sequence_parallel=True, grad_sync_weight=1 / 16,
                                                shard_block_linears=fixed))
        placed[fixed] = {name: sol.param_placements[f"blocks.1.{name}.weight"][0] for name in linears}
    assert "R" in placed[False].values()
    assert placed[True] == {"attn.q": "S(0)", "attn.k": "S(0)", "attn.v": "S(0)", "attn.o": "S(1)",
                            "mlp.fc": "S(0)", "mlp.proj": "S(1)"}


def test_a_fixed_plan_with_sequence_parallelism_splits_the_residual_and_the_vocabulary():
    """Megatron's sequence parallelism reduce-scatters a row-parallel product into a residual stream split on
    the sequence; a small layer at micro-batch 4 finds an all-reduced, whole stream as cheap, which Megatron
    does not run.  Its (tied) token embedding and output layer are split on the vocabulary, learned
    positions replicated."""
    graph = trace_model("gpt", {"layers": 2, "hidden": 2048, "heads": 16, "vocab": 8192, "seq_len": 256},
                        ctx=CTX).graph
    mesh = MeshSpec.on_cluster(A100.with_overrides(gpus=8), ("tp",), (8,))
    sol = _solve(graph, mesh, IntraOpConfig(batch=4, sequence_parallel=True, grad_sync_weight=1 / 16,
                                            shard_block_linears=True))
    adds = [n for n in graph.ops() if n.layer == 1 and n.op == "aten.add.Tensor"]
    assert len(adds) == 2 and all(sol.node_strategies[n.name][0].outputs == ("S(1)",) for n in adds)
    assert sol.param_placements["tok.weight"] == ("S(0)",) and sol.param_placements["pos.weight"] == ("R",)


def test_only_the_output_layer_and_token_embedding_are_split_on_the_vocabulary():
    """Linears outside the block stack that are not the output layer (OPT's projections in and out of the
    blocks) stay replicated under a fixed plan; the output layer and the token embedding are split."""
    from autopar.intra_op.problem import _vocab_parallel

    graph = trace_model(str(FIXTURES / "projected_lm.py"), {}, ctx=CTX).graph
    split = {graph[name].module for name in _vocab_parallel(graph, graph.ops())}
    assert split == {"head", "tok"}


def test_a_fixed_tensor_parallel_plan_keeps_routers_and_multi_query_attention_free():
    from autopar.intra_op.problem import _split_linears

    cfg = {"layers": 2, "hidden": 64, "heads": 4, "experts": 64, "top_k": 2, "vocab": 128, "seq_len": 16}
    graph = trace_model("moe", cfg, ctx=CTX).graph
    split = {graph[name].module for name in _split_linears(graph, graph.ops(), 2)}
    assert "blocks.0.attn.q" in split and "blocks.0.attn.o" in split
    assert "blocks.0.mlp.router" not in split  # its scores feed the top-k: Megatron and torchtitan replicate it
    cfg = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 1, "ffn": 512, "vocab": 128, "seq_len": 16}
    graph = trace_model("llama", cfg, ctx=CTX).graph
    split = {graph[name].module for name in _split_linears(graph, graph.ops(), 8)}
    assert {"blocks.0.attn.q", "blocks.0.attn.o", "blocks.0.ffn.gate", "blocks.0.ffn.down"} <= split
    assert not {"blocks.0.attn.k", "blocks.0.attn.v"} & split  # one kv head on 8 ranks: left to the ILP
    split = {graph[name].module for name in _split_linears(graph, graph.ops(), 1)}
    assert {"blocks.0.attn.k", "blocks.0.attn.v"} <= split


class _BiasedBlock(torch.nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.o = torch.nn.Linear(h, h)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) + bias
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h))


class _BiasedStack(torch.nn.Module):
    """Blocks sharing an ALiBi-style attention bias made before them (no batch dimension)."""

    def __init__(self, h: int = 32, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.blocks = torch.nn.ModuleList(_BiasedBlock(h, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        pos = torch.arange(s, device=x.device)
        bias = -(pos[None, :] - pos[:, None]).abs().float()[None, None].expand(1, self.heads, s, s)
        for block in self.blocks:
            x = block(x, bias)
        return x


def test_an_attention_bias_made_before_the_blocks_is_no_residual_stream():
    from autopar.intra_op.problem import _residual_adds

    graph = run_pipeline(autopar.trace(_BiasedStack(), (torch.zeros(2, 8, 32),),
                                       loss_fn=lambda out, x: out.pow(2).mean()), CTX)
    adds = {n.name: n for n in graph.ops() if n.layer == 1 and n.op == "aten.add.Tensor"}
    residual = _residual_adds(graph, graph.ops())
    assert [n.out.shape[1:] for name, n in adds.items() if name in residual] == [(8, 32)]  # x + o(...)
    assert any(n.out.shape[1:] == (4, 8, 8) for n in adds.values())  # scores + bias: not the stream
