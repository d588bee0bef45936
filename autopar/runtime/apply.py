"""``autopar.apply(plan, model)``: lay the plan onto the model in a torchrun process and train with it.

Order as torchtitan applies it: TP, then FSDP.  Supported today:

- tensor parallelism on ``tp`` through ``parallelize_module`` styles derived from the plan's parameter
  placements (``autopar.runtime.tensor_parallel``); a plan that keeps every parameter replicated on
  ``tp`` uses that axis for the batch, and runs it as data parallelism;
- data parallelism on ``dp`` with the plan's ZeRO level (0: gradients all-reduced after the last
  micro-batch; 1-3: FSDP2 ``fully_shard`` per block and on the root, resharded after forward at 3);
- gradient accumulation over the plan's micro-batches.

Plans with ``pp > 1`` are refused with a clear error until the pipeline runtime lands.
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
from autopar.runtime.tensor_parallel import tp_styles


@dataclass
class DistributedTrainer:
    """One rank's view of a plan: the (possibly sharded) model, its optimizer, and a training step."""

    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor]
    dp_rank: int
    dp_size: int
    micro_batch: int
    """Samples of one micro-batch on this rank."""
    dp_group: dist.ProcessGroup | None = None
    """Group over which gradients are averaged when the model is not FSDP-sharded (ZeRO 0)."""
    fsdp: bool = False

    @property
    def local_batch(self) -> int:
        return self.plan.global_batch // self.dp_size

    @property
    def num_microbatches(self) -> int:
        return self.plan.layout["num_microbatches"]

    def step(self, global_inputs: Sequence[torch.Tensor]) -> float:
        """One iteration on the global batch (every rank passes the same tensors; each takes its slice).

        Returns the global mean loss (the same on every rank).
        """
        lo = self.dp_rank * self.local_batch
        local = [x[lo:lo + self.local_batch] for x in global_inputs]
        m, mbs = self.num_microbatches, self.micro_batch
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i in range(m):
            micro = [x[i * mbs:(i + 1) * mbs] for x in local]
            loss = self.loss_fn(self.model(*micro), *micro) / m
            loss.backward()
            total += loss.detach()
        if not self.fsdp and self.dp_size > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                    dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.dp_group)
                    g /= self.dp_size
        self.optimizer.step()
        if self.dp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
            total /= self.dp_size
        return float(total)


def check_supported(plan: Plan) -> None:
    """Refuse plans whose runtime does not exist yet, before anything is launched."""
    lay = plan.layout
    if lay["pp"] > 1:
        raise AutoparError(f"this autopar runs plans without pipeline stages only (the plan has pp={lay['pp']}); "
                           "the pipeline runtime is not implemented yet")


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


def _retie(model: nn.Module, plan: Plan) -> None:
    """``parallelize_module`` unties shared parameters: point every alias back at its canonical one."""
    for fqn, p in plan.parameters.items():
        for alias in p.get("aliases", []):
            owner, _, name = alias.rpartition(".")
            src_owner, _, src_name = fqn.rpartition(".")
            setattr(model.get_submodule(owner), name, getattr(model.get_submodule(src_owner), src_name))


def apply(plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor], lr: float = 0.1) -> DistributedTrainer:
    """Apply ``plan`` to ``model`` (same FQNs as when planned) on this rank; returns a trainer."""
    from torch.distributed.device_mesh import init_device_mesh

    _check_launch(plan)
    rank = dist.get_rank()
    dp, tp = plan.layout["dp"], plan.layout["tp"]
    device = "cuda" if torch.cuda.is_available() and os.environ.get("AUTOPAR_DEVICE") != "cpu" else "cpu"
    styles = tp_styles(plan, model) if tp > 1 else None
    micro_batch = plan.layout["mbs"]
    if tp > 1 and styles is None:  # the plan shards only the batch on tp: run it as data parallelism
        dp, tp, micro_batch = dp * tp, 1, micro_batch // tp
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    if styles:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], styles)
        _retie(model, plan)
    fsdp = plan.zero >= 1 and dp > 1
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model, plan.model.get("layer_container")):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=plan.zero >= 3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=plan.zero >= 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dp_rank = mesh.get_local_rank("dp")
    del rank
    return DistributedTrainer(plan, model, optimizer, loss_fn, dp_rank, dp, micro_batch, mesh["dp"].get_group(),
                              fsdp)
