"""Training-loop pieces that must not depend on the layout: the gradient norm that clipping divides by."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.runtime.training import grad_norm


def test_the_norm_counts_each_element_once_whatever_holds_it():
    """Rank 0 of a 2 x 2 (dp x tp) mesh: its share of the squared norm, before the all-reduce over ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        local = torch.full((2, 3), 2.0)  # 6 elements of 4: 24 on this rank

        def param(placements: list) -> torch.nn.Parameter:
            p = torch.nn.Parameter(torch.zeros(8, 3))
            p.grad = DTensor.from_local(local, mesh, placements, run_check=False, shape=(8, 3), stride=(3, 1))
            return p

        def norm(p: torch.nn.Parameter) -> float:
            return float(grad_norm([("w", p)], 4, {}, torch.device("cpu"), reduce=False))

        # FSDP2 over the dim tp splits holds a _StridedShard, which is no Shard but splits all the same
        assert norm(param([_StridedShard(0, split_factor=2), Shard(0)])) == pytest.approx(math.sqrt(24.0))
        # sharded on dp only: the two tp ranks hold the same elements, each counts half
        assert norm(param([Shard(0), Replicate()])) == pytest.approx(math.sqrt(12.0))
    finally:
        dist.destroy_process_group()
