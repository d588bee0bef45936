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
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.cli import main
from autopar.plan_file import Plan
from autopar.runtime.region_graph import PlannedOp, PlannedRegion, _consistent, placement
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
    model.train()
    x = torch.zeros(4, 16, 128)
    live = model.get_submodule("blocks.1.mlp")
    region = PlannedRegion(live, [PlannedOp.parse(o) for o in region_ops(moe_plan, "blocks.1.mlp")])
    graph = region.graph_for(live, (x,), {})
    assert graph is not None and graph.matches
    assert region.graph_for(live, (x,), {}) is graph  # exported once per call signature
    twin = model.get_submodule("blocks.2.mlp")
    assert PlannedRegion(twin, region.ops).graph_for(twin, (x,), {}) is graph  # once for the stack's twins
    # FSDP2's mixed precision hands the forward bf16 weights: the region is exported in them, with bf16 inputs
    live.to(torch.bfloat16)
    bf16 = region.graph_for(live, (x.bfloat16(),), {})
    assert bf16 is not None and bf16 is not graph
    placeholders = [n for n in bf16.graph.nodes if n.op == "placeholder"]
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in placeholders if n.meta["val"].is_floating_point())


def test_a_region_whose_ops_changed_runs_by_dtensors_rules_and_says_so(moe_plan, caplog):
    model = model_on_meta(moe_plan)
    ops = [PlannedOp.parse(o) for o in region_ops(moe_plan, "blocks.0.mlp")][:-1]  # one op short
    live = model.get_submodule("blocks.0.mlp").train()
    with caplog.at_level(logging.WARNING):
        assert PlannedRegion(live, ops).graph_for(live, (torch.zeros(2, 16, 128),), {}) is None
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


def test_a_shard_laid_out_against_its_dtensors_strides_is_relaid_and_keeps_its_gradient():
    """A redistribution keeps a transposed view's strides while the collective hands back a contiguous shard."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.arange(24.0).reshape(2, 3, 4).requires_grad_()  # contiguous [b, s, h]
        global_stride = (24, 1, 3)  # [b, h, s] storage seen as [b, s, h]: dims 1 and 2 swapped
        x = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=(2, 3, 8), stride=global_stride)
        y = _consistent(x)
        assert y.stride() == x.stride() and y.placements == x.placements
        assert y._local_tensor.stride() == (12, 1, 3)  # laid out as the strides say: s innermost
        assert torch.equal(y.to_local(), local)
        y.to_local().mul(torch.arange(24.0).reshape(2, 3, 4)).sum().backward()
        assert torch.equal(local.grad, torch.arange(24.0).reshape(2, 3, 4))  # the gradient flows through
        same = DTensor.from_local(torch.zeros(2, 3, 4), mesh, [Shard(2)], run_check=False)
        assert _consistent(same) is same  # nothing to do: no copy
        index = torch.arange(3).view(1, 3, 1).expand(2, 3, 4)  # a broadcast index, as a MoE gather's
        wide = DTensor.from_local(index, mesh, [Shard(2)], run_check=False, shape=(2, 3, 8), stride=(0, 1, 0))
        assert _consistent(wide) is wide  # left a view: relaid it would be a full copy
    finally:
        dist.destroy_process_group()
