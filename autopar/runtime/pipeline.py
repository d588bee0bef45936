"""Drive a torch pipelining schedule over this rank's stages (built by ``autopar.runtime.stages``).

Tied parameters shared by the first and last stage (embedding and head) get one copy per stage; their
gradients are summed over a dedicated group of the two ranks before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.plan_file import Plan
from autopar.runtime.materialize import clean_fqn


def tied_pairs(plan: Plan) -> list[tuple[str, str]]:
    """(canonical FQN, alias) of every tied parameter."""
    return [(fqn, alias) for fqn, p in plan.parameters.items() for alias in p.get("aliases", [])]


class PipelineRunner:
    """This rank's stages (its chunks of the model, already parallelized) and the schedule that runs them;
    ``step`` runs one iteration's micro-batches."""

    def __init__(self, modules: list[nn.Module], chunks: list[int], num_chunks: int, schedule: str,
                 num_microbatches: int, loss_fn: Callable[..., torch.Tensor], mesh: object, device: torch.device,
                 tied: list[tuple[str, str]]) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.modules, self.mesh, self.device, self.tied = modules, mesh, device, tied
        self.pp = mesh["pp"].size()
        group = mesh["pp"].get_group()
        self.stages = [PipelineStage(m, c, num_chunks, device, group=group) for m, c in zip(modules, chunks)]
        self.has_first = 0 in chunks
        self.has_last = num_chunks - 1 in chunks
        n = num_microbatches
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches=n, loss_fn=loss_fn)
        elif schedule == "gpipe":
            self.schedule = ScheduleGPipe(self.stages[0], n_microbatches=n, loss_fn=loss_fn)
        else:
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches=n, loss_fn=loss_fn)
        self._tie_group = self._make_tie_group()

    def _make_tie_group(self) -> dist.ProcessGroup | None:
        """One group per (dp, tp) coordinate of the first and last pipeline ranks; every rank creates all."""
        if not self.tied or self.pp == 1:
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

    def step(self, local_inputs: list[torch.Tensor], target: torch.Tensor | None = None) -> torch.Tensor:
        """Run the schedule on this dp rank's batch; returns the mean loss (on every pipeline rank).
        ``target``: what the loss reads beside the output (default: the token ids)."""
        ids = local_inputs[0]
        target = ids if target is None else target
        losses: list[torch.Tensor] = []
        if self.has_first and self.has_last:
            self.schedule.step(ids, target=target, losses=losses)
        elif self.has_first:
            self.schedule.step(ids)
        elif self.has_last:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        losses = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]  # under loss_parallel
        loss = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=self.device)
        pp_group = self.mesh["pp"].get_group()  # the last stage knows the loss: share it along the pipeline
        dist.broadcast(loss, src=dist.get_global_rank(pp_group, self.pp - 1), group=pp_group)
        self._sum_tied_grads()
        return loss

    def _sum_tied_grads(self) -> None:
        if self._tie_group is None:
            return
        names = dict(self.named_parameters())
        for fqn, alias in self.tied:
            p = names.get(fqn, names.get(alias))
            if p is None or p.grad is None:
                continue
            g = p.grad.redistribute(p.grad.device_mesh, p.placements) if hasattr(p.grad, "redistribute") else p.grad
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            dist.all_reduce(local, group=self._tie_group)
            if g is not p.grad:
                p.grad = g
