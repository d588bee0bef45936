"""The plan's model for one process, its synthetic data, and a single-process reference run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autopar import modelfile
from autopar.inputs import ModelInputs
from autopar.plan_file import Plan
from autopar.runtime.document_masking import document_mask
from autopar.runtime.materialize import build_on_meta, materialize
from autopar.runtime.training import TrainingConfig, build_optimizer, lr_factor


@dataclass
class ModelSession:
    module: ModuleType
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]


def build_model(plan: Plan, seed: int | None) -> ModelSession:
    """The plan's whole model on the CPU, with the initial weights every layout starts from (``seed``);
    ``seed=None``: its structure only, on the meta device (enough for the synthetic data)."""
    module = modelfile.load_for(plan.model)
    config, ref = dict(plan.model["config"]), plan.model["ref"]
    model = build_on_meta(lambda: modelfile.build(module, config, ref)).model
    if seed is not None:
        materialize(model, build_on_meta(lambda: modelfile.build(module, config, ref)), torch.device("cpu"), seed)
    model.train()
    return ModelSession(module, model, modelfile.loss_fn_of(module))


#: Attribute names that hold a dropout probability (HuggingFace attention modules keep ``attention_dropout``,
#: OPT's layers ``dropout``, GPT-2's config ``*_pdrop``; OPT's ``layerdrop`` skips whole layers at random),
#: besides ``nn.Dropout`` modules.
_DROPOUT_NAMES = ("dropout", "pdrop", "layerdrop")
#: Config fields of heads a causal LM does not run (classification, GPT-2's summary head): not counted.
_OTHER_HEADS = ("classifier", "summary")


def disable_dropout(model: nn.Module) -> int:
    """Turn every dropout of ``model`` off: ``nn.Dropout`` modules, and probabilities modules or their
    configs keep to pass to functional dropout (``F.dropout``, attention's ``dropout_p``).  Returns how many
    were on.  ``autopar verify`` runs both sides so: a distributed run and one process draw different masks."""
    switched = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            switched += module.p > 0
            module.p = 0.0
            continue
        owners = [module] + ([module.config] if hasattr(module, "config") and not callable(module.config) else [])
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if name.startswith(_OTHER_HEADS):
                    continue
                if any(key in name for key in _DROPOUT_NAMES) and isinstance(value, float) and value > 0:
                    setattr(owner, name, 0.0)
                    switched += 1
    return switched


def batch_for_step(plan: Plan, session: ModelSession, step: int, seed: int) -> ModelInputs:
    """The synthetic global batch of ``step``: deterministic, identical in every process."""
    torch.manual_seed(seed + 1000 + step)
    gen = torch.Generator().manual_seed(seed + 1000 + step)
    return modelfile.example_inputs(session.module, session.model, plan.global_batch, plan.seq_len,
                                    dict(plan.model["config"]), generator=gen)


def reference_run(plan: Plan, steps: int, seed: int, config: TrainingConfig,
                  batches: Callable[[int], tuple[Any, torch.Tensor | None]] | None = None,
                  dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """Single-process training on the full batch: losses, last-step gradients and final parameters.

    Clipping and bf16 mixed precision are the distributed run's; with ``fp32`` and SGD the two agree to
    rounding.  Dropout is off (``disable_dropout``, as in the distributed run of ``autopar verify``).
    ``batches(step)``: the global batch's inputs and document ids (``None``: no document masking), instead of
    the synthetic batches.  ``dtype=torch.float64``: the model and its floating inputs in float64 (under fp32
    training), to measure how far fp32 rounding takes the reference itself.
    """
    from autopar.runtime.training import bf16_parameters, clip_grads, fp32_loss, grad_norm

    s = build_model(plan, seed)
    if dtype != torch.float32:
        s.model.to(dtype)
    dropout = disable_dropout(s.model)
    device = torch.device("cpu")
    opt = build_optimizer(list(s.model.parameters()), config, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, config))
    losses = []
    for step in range(steps):
        inputs, documents = batches(step) if batches else (batch_for_step(plan, s, step, seed), None)
        inputs = ModelInputs.of(inputs)
        if dtype != torch.float32:
            inputs = inputs.map(lambda t: t.to(dtype) if t.is_floating_point() else t)
        opt.zero_grad(set_to_none=True)
        mixed = bf16_parameters(list(s.model.parameters())) if config.precision == "bf16" else nullcontext()
        with mixed:
            with document_mask(documents):
                output = inputs.call(s.model)
            loss = inputs.call(fp32_loss(s.loss_fn, device, config.precision), output)
            loss.backward()
        if config.max_grad_norm is not None:
            named = list(s.model.named_parameters())
            clip_grads(named, config.max_grad_norm, grad_norm(named, 1, {}, device, reduce=False))
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    grads = {n: p.grad.detach().clone() for n, p in s.model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "dropout_off": dropout}
