"""The runtime holds the model state the plan prices, at full size, without memory: a fake process group.

Each case plans a published size and applies the plan on two ranks of the fake world (the first and the
last pipeline stage) with the shards laid out on the meta device (the DTensor and FSDP2 machinery needs
real meshes, so only the tensors are fake), takes one AdamW step under ``FakeTensorMode``, and adds up
what the rank holds: its parameter, gradient and optimizer-state shards.  They must equal the stage's
``estimated_state_bytes`` within 1 % (FSDP pads each shard to an even split).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.cli import main
from autopar.plan_file import Plan
from autopar.runtime import TrainingConfig, apply
from autopar.runtime.parallelize import MESH_DIMS

LLAMA2_70B = ["llama", "--config", "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000,seq_len=4096",
              "--gpus", "64", "--global-batch", "64", "--fix", "tp=8,pp=2,cp=1,zero=1"]
GPT3_175B = ["gpt", "--config", "layers=96,hidden=12288,heads=96,vocab=51200,seq_len=2048", "--gpus", "1024",
             "--global-batch", "1536", "--fix", "tp=8,pp=8,zero=1"]


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _state_after_one_step(plan: Plan, rank: int) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes ``rank`` holds after one AdamW step (all fake)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.num_devices)
    try:
        lay = plan.layout
        mesh = init_device_mesh("cpu", (lay["pp"], lay["dp"], lay["cp"], lay["tp"]), mesh_dim_names=MESH_DIMS)
        trainer = apply(plan, lambda out, *inputs: out.sum(), config=TrainingConfig(max_grad_norm=None), mesh=mesh,
                        device=torch.device("meta"))
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = [p for _, p in trainer.named_parameters()]
            for p in params:
                p.grad = torch.zeros_like(p)
            trainer.optimizer.step()
            moments = [t for state in trainer.optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0]
            return {"parameters": sum(_local_bytes(p) for p in params),
                    "gradients": sum(_local_bytes(p.grad) for p in params),
                    "optimizer": sum(_local_bytes(t) for t in moments)}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("args", [LLAMA2_70B, GPT3_175B], ids=["llama2-70b-64", "gpt3-175b-1024"])
def test_state_on_the_first_and_last_stage_is_the_planned_one(tmp_path, capsys, monkeypatch, args):
    monkeypatch.setenv("AUTOPAR_DEVICE", "cpu")
    assert main(["plan", *args, "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    plan = Plan.load(tmp_path / "plan.json")
    per_stage = plan.layout["dp"] * plan.layout["cp"] * plan.layout["tp"]
    for stage in (plan.stages[0], plan.stages[-1]):
        held = _state_after_one_step(plan, stage["index"] * per_stage)
        # fp32 parameters, fp32 gradients and two fp32 moments: 4 + 4 + 8 bytes per local parameter
        assert held["gradients"] == pytest.approx(held["parameters"], rel=1e-6)
        assert held["optimizer"] == pytest.approx(2 * held["parameters"], rel=1e-6)
        assert sum(held.values()) == pytest.approx(stage["estimated_state_bytes"], rel=0.01), (stage["index"], held)
