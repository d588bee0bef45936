"""A ``PlacedParameters`` region runs its ops laid out as the plan chose (``autopar.runtime.region_graph``).

That the collectives then are the planned ones is ``test_runtime_comm.py``'s check (MoE tp8), and that the
numbers are the single-process ones is ``test_runtime.py``'s (the MoE verify cases); here, the pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging

import pytest
import torch

from autopar.cli import main
from autopar.plan import Plan
from autopar.runtime.region_graph import PlannedOp, PlannedRegion, placement
from autopar.runtime.support import model_on_meta
from autopar.runtime.tensor_parallel import region_ops

MOE = ["--config", "layers=3,hidden=128,heads=4,vocab=256,seq_len=16,experts=4", "--cluster", "cpu",
       "--global-batch", "8"]


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("moe")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "moe", *MOE, "--fix", "dp=2,tp=2,sp=off", "-o", str(out)]) == 0
    return Plan.load(out / "plan.json")


def test_planned_ops_read_back_what_they_write():
    op = PlannedOp.parse("aten.einsum.default: S(1), S(0) -> S(1)")
    assert op == PlannedOp("aten.einsum.default", ("S(1)", "S(0)"), ("S(1)",))
    assert PlannedOp.parse(op.source()) == op
    factory = PlannedOp("aten.arange.default", (), ("R",))
    assert factory.source() == "aten.arange.default: -> R" and PlannedOp.parse(factory.source()) == factory
    assert PlannedOp.parse("aten._assert_tensor_metadata.default: S(1) -> -").outputs == (None,)
    with pytest.raises(ValueError, match="not a planned op"):
        PlannedOp.parse("einsum(S(1))")
    with pytest.raises(ValueError, match="unknown placement"):
        placement("Shard(1)")


def test_every_layer_takes_the_ops_of_its_type_in_graph_order(moe_plan):
    first, last = region_ops(moe_plan, "blocks.0.mlp"), region_ops(moe_plan, "blocks.2.mlp")
    assert first and first == last  # the plan lists layer 0's; layer 2 is of the same type
    assert first[0].startswith("aten.linear.default:")  # the router comes first
    assert any(op.startswith("aten.einsum.default: S(1), S(0)") for op in first)  # experts split on tp
    old = dataclasses.replace(moe_plan, op_strategies={
        k: {f: v for f, v in e.items() if f != "order"} for k, e in moe_plan.op_strategies.items()})
    assert region_ops(old, "blocks.0.mlp") == ()  # a plan without the ops' order: DTensor's own choices


def test_the_exported_region_lists_the_plans_ops(moe_plan):
    model = model_on_meta(moe_plan)
    x = torch.zeros(4, 16, 128)
    region = PlannedRegion(model.get_submodule("blocks.1.mlp"), [PlannedOp.parse(o) for o in
                                                                  region_ops(moe_plan, "blocks.1.mlp")])
    graph = region.graph_for(True, (x,), {})
    assert graph is not None and graph.matches
    assert region.graph_for(True, (x,), {}) is graph  # exported once per call signature
    twin = PlannedRegion(model.get_submodule("blocks.2.mlp"), region.ops)
    assert twin.graph_for(True, (x,), {}) is graph  # and once for the identical regions of the stack


def test_a_region_whose_ops_changed_runs_by_dtensors_rules_and_says_so(moe_plan, caplog):
    model = model_on_meta(moe_plan)
    ops = [PlannedOp.parse(o) for o in region_ops(moe_plan, "blocks.0.mlp")][:-1]  # one op short
    with caplog.at_level(logging.WARNING):
        assert PlannedRegion(model.get_submodule("blocks.0.mlp"), ops).graph_for(True, (torch.zeros(2, 16, 128),),
                                                                                  {}) is None
    assert "ops differ from the plan's" in caplog.text


def test_without_sequence_parallelism_a_region_hands_its_output_on_whole(tmp_path):
    """Left free, the ILP ends this MoE block hidden-split (its dropout ``S(2)``) and gathers outside."""
    from autopar.frontend import trace_model
    from autopar.intra_op.problem import _region_outputs, region_modules
    from autopar.modelfile import parse_config

    config = "layers=2,hidden=2048,heads=16,vocab=32000,seq_len=512,experts=8"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "moe", "--config", config, "--cluster", "a100-80gb", "--gpus", "8", "--global-batch", "8",
                     "--fix", "tp=8,sp=off", "-o", str(tmp_path)]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    graph = trace_model("moe", parse_config(config), 512).graph
    assert {"blocks.0.mlp", "blocks.0.ln1", "ln_f"} <= set(region_modules(graph))  # experts, norms
    leaving = _region_outputs(graph, graph.ops())
    assert any(graph[n].module == "blocks.0.mlp.dropout" for n in leaving)  # the MoE's last op
    planned = {n: e for n, e in plan.op_strategies.items() if n in leaving}
    assert planned and all(p in ("R", None) for e in planned.values() for p in e["tp"]["outputs"])
