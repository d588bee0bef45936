"""Mixtures of experts: finding the experts, expert parallelism's search space, cost and errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from autopar.passes import PassContext
from autopar.passes.experts import (
    EXPERT_PRODUCT_OPS,
    expert_count,
    expert_parallel_count,
    expert_weights,
    stacked_weight,
)

from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.frontend import trace_model
from autopar.inter_op.search import layouts, search
from autopar.inter_op.techniques import parse_fix
from autopar.inter_op.unit_costs import solve_tp
from autopar.intra_op.sharding_costs import compute_s
from autopar.intra_op.strategies import tensor_refs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FIXTURE = Path(__file__).parent / "fixtures" / "stacked_weights.py"
MOE = {"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 16, "experts": 8, "top_k": 2}
H100 = load_cluster("h100-80gb").with_overrides(gpus=16)
CTX = PassContext(cluster=H100)


@pytest.fixture(scope="module")
def moe():
    return trace_model("moe", MOE, ctx=CTX).graph


@pytest.fixture(scope="module")
def dropless():
    return trace_model("moe", {**MOE, "routing": "dropless"}, ctx=CTX).graph


def _best(graph, fix: str, batch: int = 32):
    return search(graph, H100, CTX, batch, parse_fix(fix), H100.usable_memory_bytes).best.estimate


def test_stacked_experts_are_found_with_their_routing(moe, dropless):
    found = expert_weights(moe)
    assert [w.module for w in found] == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    assert found[0].params == ("blocks.0.mlp.experts.w_in", "blocks.0.mlp.experts.w_out")
    assert found[0].experts == 8 and found[0].capacity_slots  # reads [batch, experts, capacity, hidden]
    assert expert_parallel_count(moe) == 8
    assert [w.capacity_slots for w in expert_weights(dropless)] == [False, False]
    assert expert_count(dropless) == 8 and expert_parallel_count(dropless) == 0


def test_huggingface_mixtral_grouped_experts_are_found_and_counted():
    """HuggingFace's grouped-matmul experts read a transposed view of their stacked weights; the flop
    counter does not count ``_grouped_mm``, autopar does: tokens x top-k rows, each by its expert's matrix."""
    config = {"arch": "mixtral", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32}
    graph = trace_model(str(EXAMPLES / "hf_decoder.py"), config).graph
    found = expert_weights(graph)
    assert found[0].params == ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    assert found[0].experts == 4 and not found[0].capacity_slots
    grouped = [n for n in graph.ops() if n.op == "aten._grouped_mm.default" and n.layer == 0]
    rows = 32 * 2  # a sample's tokens, two experts each
    assert [n.annotations["flops"].fwd for n in grouped] == [2.0 * rows * 64 * 2 * 256, 2.0 * rows * 256 * 64]


def test_ep_is_searched_only_for_capacity_routed_experts(moe, dropless):
    gpt = trace_model("gpt", {"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 16}, ctx=CTX).graph
    assert {lay.ep for lay in layouts(gpt, H100, 32, {}, CTX.framework)} == {1}
    assert {lay.ep for lay in layouts(dropless, H100, 32, {}, CTX.framework)} == {1}
    eps = {(lay.dp, lay.ep) for lay in layouts(moe, H100, 32, {}, CTX.framework)}
    assert {ep for _, ep in eps} == {1, 2, 4, 8} and all(dp % ep == 0 for dp, ep in eps)
    # neither with sequence parallelism nor with context parallelism
    assert not any(lay.sp and lay.ep > 1 for lay in layouts(moe, H100, 32, {"tp": 2}, CTX.framework))


@pytest.mark.parametrize(("fix", "message"), [
    ("ep=3", "--fix ep=3 does not divide the 8 experts"),
    ("dp=2,ep=4", "--fix ep=4 must divide dp=2"),
    ("ep=2,tp=2,sp=on", "without sequence parallelism"),
    ("ep=2,cp=2", "without context parallelism"),
])
def test_pinned_ep_that_cannot_run_is_refused_in_one_line(moe, fix, message):
    with pytest.raises(AutoparError, match=message):
        _best(moe, fix)


def test_pinned_ep_is_refused_for_dropless_experts_and_dense_models(dropless):
    with pytest.raises(AutoparError, match=r"blocks\.0\.mlp\.experts routes without a capacity"):
        _best(dropless, "ep=2")
    gpt = trace_model("gpt", {"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 16}, ctx=CTX).graph
    with pytest.raises(AutoparError, match="no stacked experts"):
        _best(gpt, "ep=2")


def test_ep_costs_its_all_to_alls_and_splits_the_expert_state(moe):
    one = _best(moe, "dp=16,tp=1,pp=1,ep=1,mbs=2,zero=0,recompute=none")
    four = _best(moe, "dp=16,tp=1,pp=1,ep=4,mbs=2,zero=0,recompute=none")
    assert one.breakdown["ep_comm_s"] == 0.0 < four.breakdown["ep_comm_s"]
    # one rank's slots [mbs, experts, capacity, hidden] in bf16, dispatched and combined, forward and
    # backward, in each of the two layers
    slots = 2 * 8 * math.ceil(2 * 16 * 1.25 / 8) * 128 * 2
    assert four.stages[0].ep_bytes == {"all_to_all": pytest.approx(2 * 2 * 2 * slots)}
    expert_params = 2 * 2 * 8 * 128 * 512  # w_in and w_out of both layers
    saved = one.stages[0].state_bytes - four.stages[0].state_bytes
    assert saved == pytest.approx(CTX.state_bytes(expert_params) * (1 - 1 / 4))  # split over ep = 4


def test_ep_plan_records_the_expert_placements(tmp_path):
    import contextlib
    import io
    import json

    from autopar.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "moe", "--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4",
                     "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "--fix", "dp=4,ep=2,zero=3",
                     "-o", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["layout"]["ep"] == 2 and "ep_comm_s" in plan["estimate"]["breakdown"]
    experts = plan["parameters"]["blocks.1.mlp.experts.w_out"]["placements"]
    assert experts == {"dp": "S(0)", "ep": "S(0)", "tp": "R"}  # ZeRO-3 over the dp / ep = 2 holding them
    assert plan["parameters"]["blocks.1.mlp.router.weight"]["placements"] == {"dp": "S(0)", "ep": "R", "tp": "R"}
    assert "EP = 2" in (tmp_path / "train.py").read_text()


def _expert_forward_s(graph, layer: int) -> float:
    """Forward time of the expert products of one layer (no launches), each op costed on its own."""
    mesh, strategies, _ = solve_tp(graph, H100, CTX, 1, 1, False)
    return sum(compute_s(n, graph, strategies[n.name], mesh, 1, H100, CTX)[0]
               - n.annotations["traffic"].fwd_kernels * H100.kernel_gap_s for n in graph.ops()
               if n.layer == layer and n.op in EXPERT_PRODUCT_OPS
               and any(stacked_weight(graph, r) for r in tensor_refs(n)))


def test_expert_products_are_retimed_at_a_ranks_shapes():
    """Under ep a rank runs 1 / ep of the experts over ep times the slots: the same FLOPs in bigger GEMMs.
    Ten slots per expert leave most of an H100's tiles empty; eighty fill them better."""
    from autopar.inter_op.expert_parallel import expert_parallel_share
    from autopar.inter_op.unit_costs import unit_costs

    config = {"layers": 2, "hidden": 1024, "heads": 16, "vocab": 1024, "seq_len": 256, "experts": 64, "top_k": 2}
    graph = trace_model("moe", config, ctx=CTX).graph
    mesh, strategies, _ = solve_tp(graph, H100, CTX, 1, 1, False)
    layer = unit_costs(graph, strategies, mesh, 1, H100, CTX)[graph.layers[1].structural_hash]
    assert len(layer.expert_products) == 2 and expert_parallel_share(layer, 1, H100) is layer
    shared = expert_parallel_share(layer, 8, H100)
    # one of 8 ranks runs 8 experts of ceil(2 * 256 * 1.25 / 64) = 10 slots from each of the 8 ranks: the
    # products of a model of 8 experts, whose capacity is ceil(2 * 256 * 1.25 / 8) = 80 slots
    eight = trace_model("moe", {**config, "experts": 8}, ctx=CTX).graph
    expected = (_expert_forward_s(eight, 1) - _expert_forward_s(graph, 1)) / layer.clock  # at the unit's clock
    assert expected < 0 and shared.fwd_s - layer.fwd_s == pytest.approx(expected, rel=1e-6)
    assert shared.fwd_flops == layer.fwd_flops  # the same work
    assert shared.expert_params_local == pytest.approx(layer.expert_params_local / 8)


def test_experts_in_a_module_list_are_found_and_ep_refused_for_them():
    graph = trace_model(str(FIXTURE), {"mixer": "listed"}, ctx=CTX).graph
    found = expert_weights(graph)
    assert [(w.module, w.experts, w.stacked) for w in found] == [("blocks.0.experts", 3, False),
                                                               ("blocks.1.experts", 3, False)]
    assert found[0].params[:2] == ("blocks.0.experts.0.down.bias", "blocks.0.experts.0.down.weight")
    assert len(found[0].params) == 3 * 4 and expert_parallel_count(graph) == 0
    with pytest.raises(AutoparError, match=r"blocks\.0\.experts keeps its 3 experts in a ModuleList"):
        _best(graph, "ep=3")


def test_a_per_head_weight_is_no_expert():
    """Three dimensions and a 4-D activation whose dim 1 matches (heads), but no token is routed to it."""
    graph = trace_model(str(FIXTURE), {"mixer": "per_head"}, ctx=CTX).graph
    assert expert_weights(graph) == [] and expert_count(graph) == 0
