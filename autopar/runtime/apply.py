"""``autopar.apply(plan, model)``: lay the plan onto the model in a torchrun process and train with it.

Supported today: data parallelism on the ``dp`` axis with the plan's ZeRO level (0: gradients
all-reduced after the last micro-batch; 1-3: FSDP2 ``fully_shard`` per block and on the root, weights
resharded after forward at level 3), and gradient accumulation over the plan's micro-batches.  Plans
with ``tp > 1`` or ``pp > 1`` are refused with a clear error until their runtime lands (see the issue).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.plan import Plan


@dataclass
class DistributedTrainer:
    """One rank's view of a plan: the (possibly sharded) model, its optimizer, and a training step."""

    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor]
    dp_rank: int
    dp_size: int

    @property
    def local_batch(self) -> int:
        return self.plan.global_batch // self.dp_size

    def step(self, global_inputs: Sequence[torch.Tensor]) -> float:
        """One iteration on the global batch (every rank passes the same tensors; each takes its slice).

        Returns the global mean loss (the same on every rank).
        """
        lay = self.plan.layout
        lo = self.dp_rank * self.local_batch
        local = [x[lo:lo + self.local_batch] for x in global_inputs]
        m, mbs = lay["num_microbatches"], lay["mbs"]
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i in range(m):
            micro = [x[i * mbs:(i + 1) * mbs] for x in local]
            loss = self.loss_fn(self.model(*micro), *micro) / m
            loss.backward()
            total += loss.detach()
        if self.plan.zero == 0 and self.dp_size > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= self.dp_size
        self.optimizer.step()
        if self.dp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            total /= self.dp_size
        return float(total)


def check_supported(plan: Plan) -> None:
    """Refuse plans whose runtime does not exist yet, before anything is launched."""
    lay = plan.layout
    if lay["tp"] > 1 or lay["pp"] > 1:
        raise AutoparError(f"this autopar runs data-parallel plans only (the plan has tp={lay['tp']}, "
                           f"pp={lay['pp']}); tensor and pipeline parallel runtimes are not implemented yet")


def _check_launch(plan: Plan) -> int:
    if not dist.is_initialized():
        raise AutoparError("autopar.apply needs torch.distributed to be initialized (run under torchrun)")
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise AutoparError(f"world size {world} differs from the plan's {plan.num_devices} devices")
    check_supported(plan)
    return world


def _blocks(model: nn.Module, container: str | None) -> list[nn.Module]:
    if not container:
        return []
    mod = model.get_submodule(container)
    return list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod.children())


def apply(plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor], lr: float = 0.1) -> DistributedTrainer:
    """Apply ``plan`` to ``model`` (same FQNs as when planned) on this rank; returns a trainer."""
    _check_launch(plan)
    rank = dist.get_rank()
    dp = plan.layout["dp"]
    if plan.zero >= 1 and dp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = "cuda" if torch.cuda.is_available() and os.environ.get("AUTOPAR_DEVICE") != "cpu" else "cpu"
        mesh = init_device_mesh(device, (dp,), mesh_dim_names=("dp",))
        for block in _blocks(model, plan.model.get("layer_container")):
            fully_shard(block, mesh=mesh, reshard_after_forward=plan.zero >= 3)
        fully_shard(model, mesh=mesh, reshard_after_forward=plan.zero >= 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return DistributedTrainer(plan, model, optimizer, loss_fn, rank, dp)
