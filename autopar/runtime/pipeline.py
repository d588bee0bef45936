"""Drive a torch pipelining schedule over this rank's stages (built by ``autopar.runtime.stages``).

Tied parameters shared by the first and last stage (embedding and head) get one copy per stage; their
gradients are summed over a dedicated group of the two ranks before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.plan import Plan
from autopar.runtime.stages import prune_to_stage


def clean_fqn(name: str) -> str:
    """The model FQN of a parameter seen through wrappers (activation checkpointing inserts a level)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def tied_pairs(plan: Plan) -> list[tuple[str, str]]:
    """(canonical FQN, alias) of every tied parameter."""
    return [(fqn, alias) for fqn, p in plan.parameters.items() for alias in p.get("aliases", [])]


class PipelineRunner:
    """This rank's stages and schedule; ``step`` runs one iteration's micro-batches."""

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor], mesh: object,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        lay = plan.layout
        self.plan = plan
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp = lay["pp"]
        v = lay["v"]
        chunks = [self.pp_rank + k * self.pp for k in range(v)]
        self.modules = [prune_to_stage(model, plan, c) for c in chunks]
        group = mesh["pp"].get_group()
        self.device = device
        self.stages = [PipelineStage(m, c, self.pp * v, device, group=group) for m, c in zip(self.modules, chunks)]
        self.has_first = 0 in chunks
        self.has_last = self.pp * v - 1 in chunks
        n = lay["num_microbatches"]
        if lay["schedule"] == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches=n, loss_fn=loss_fn)
        elif lay["schedule"] == "gpipe":
            self.schedule = ScheduleGPipe(self.stages[0], n_microbatches=n, loss_fn=loss_fn)
        else:
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches=n, loss_fn=loss_fn)
        self.mesh = mesh
        self._tie_group = self._make_tie_group()

    def _make_tie_group(self) -> dist.ProcessGroup | None:
        """One group per (dp, tp) coordinate of the first and last pipeline ranks; every rank creates all."""
        if not any(p.get("aliases") for p in self.plan.parameters.values()) or self.pp == 1:
            return None
        mine = None
        ranks = self.mesh.mesh  # [pp, dp, tp] tensor of global ranks
        for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
            g = dist.new_group([first, last])
            if dist.get_rank() in (first, last):
                mine = g
        return mine

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(clean_fqn(n), p) for m in self.modules for n, p in m.named_parameters()]

    def step(self, local_inputs: list[torch.Tensor]) -> torch.Tensor:
        """Run the schedule on this dp rank's batch; returns the mean loss (on every pipeline rank)."""
        ids = local_inputs[0]
        losses: list[torch.Tensor] = []
        if self.has_first and self.has_last:
            self.schedule.step(ids, target=ids, losses=losses)
        elif self.has_first:
            self.schedule.step(ids)
        elif self.has_last:
            self.schedule.step(target=ids, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        pp_group = self.mesh["pp"].get_group()  # the last stage knows the loss: share it along the pipeline
        dist.broadcast(loss, src=dist.get_global_rank(pp_group, self.pp - 1), group=pp_group)
        self._sum_tied_grads()
        return loss

    def _sum_tied_grads(self) -> None:
        if self._tie_group is None:
            return
        names = dict(self.named_parameters())
        for fqn, alias in tied_pairs(self.plan):
            p = names.get(fqn, names.get(alias))
            if p is None or p.grad is None:
                continue
            g = p.grad.redistribute(p.grad.device_mesh, p.placements) if hasattr(p.grad, "redistribute") else p.grad
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            dist.all_reduce(local, group=self._tie_group)
            if g is not p.grad:
                p.grad = g
