"""Building the model a plan names, its synthetic data, and a single-process reference run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from autopar import modelfile
from autopar.plan import Plan


@dataclass
class ModelSession:
    module: ModuleType
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]


def build_model(plan: Plan, seed: int) -> ModelSession:
    """The plan's model with real weights, initialized from ``seed`` (the same on every rank)."""
    module = modelfile.load_module(plan.model.get("path") or plan.model["ref"])
    torch.manual_seed(seed)
    model = modelfile.build(module, dict(plan.model["config"]), plan.model["ref"])
    model.train()
    return ModelSession(module, model, modelfile.loss_fn_of(module))


def batch_for_step(plan: Plan, session: ModelSession, step: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step``: deterministic, identical in every process."""
    torch.manual_seed(seed + 1000 + step)
    gen = torch.Generator().manual_seed(seed + 1000 + step)
    return modelfile.example_inputs(session.module, session.model, plan.global_batch, plan.seq_len,
                                    dict(plan.model["config"]), generator=gen)


def reference_run(plan: Plan, steps: int, seed: int, lr: float) -> dict[str, object]:
    """Single-process training on the full batch: losses, last-step gradients and final parameters."""
    s = build_model(plan, seed)
    opt = torch.optim.SGD(s.model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs = batch_for_step(plan, s, step, seed)
        opt.zero_grad(set_to_none=True)
        loss = s.loss_fn(s.model(*inputs), *inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    grads = {n: p.grad.detach().clone() for n, p in s.model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}
