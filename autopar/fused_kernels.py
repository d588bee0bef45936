"""Kernels that training runs fused and HuggingFace's torch path writes out op by op, traced as one op each.

Mamba's selective scan is a recurrence over the sequence, ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t u_t`` and
``y_t = C_t h_t``.  HuggingFace's torch fallback (``mamba_selective_scan``) unrolls it token by token, so a traced
graph grows with the sequence (six ops per token per layer) and materializes ``[batch, channels, seq, state]``
tensors; what real runs call instead (``mamba_ssm``'s ``selective_scan_fn``, which HuggingFace loads from the
kernel hub when it can) reads ``u, dt, B, C, z`` once, keeps the state in SRAM, and writes ``y``.

``traced_as_fused_kernels()`` swaps the fallback for ``autopar::selective_scan``, one op with the fused kernel's
inputs and output, while a model is traced:

- the graph has one scan op per layer whatever the sequence length;
- the traffic pass prices it by the tensors it reads and writes (the fused kernel's memory traffic), and the
  activations pass saves its inputs (``selective_scan_fn`` recomputes the states in backward);
- its sharding rules split the channels (``d_inner``: the recurrence is independent per channel, as Megatron-LM's
  Mamba layers split them over tp) or the batch (``autopar.intra_op.strategies``).

The op's own implementation is the recurrence in torch, exactly HuggingFace's fallback, and its backward runs it
again under autograd.  It runs where the runtime executes a plan's exported region op by op
(``autopar.runtime.region_graph``, whose export swaps the scan too); elsewhere the model runs its own code.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

#: The op's name in a traced graph.
SELECTIVE_SCAN = "autopar.selective_scan.default"
#: HuggingFace modules whose ``mamba_selective_scan`` torch fallback unrolls the scan.
_HF_SCAN_MODULES = ("transformers.models.mamba.modeling_mamba",
                    "transformers.models.falcon_mamba.modeling_falcon_mamba")


@torch.library.custom_op("autopar::selective_scan", mutates_args=())
def selective_scan(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                   delta_softplus: bool) -> torch.Tensor:
    """``selective_scan_fn(u, dt, A, B, C, D, z, delta_bias, delta_softplus)``: ``u, dt, z`` are ``[batch,
    channels, seq]``, ``A`` is ``[channels, state]``, ``B, C`` are ``[batch, state, seq]``, ``D, delta_bias``
    ``[channels]``; returns ``y`` ``[batch, channels, seq]``."""
    return _recurrence(u, dt, A, B, C, D, z, delta_bias, delta_softplus)


def _recurrence(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                delta_softplus: bool) -> torch.Tensor:
    """The scan in torch ops, as HuggingFace's fallback computes it (and on DTensors, in backward)."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[..., None])  # [b, d, s, n]
    drive = dt[..., None] * B.transpose(1, 2)[:, None].float() * u[..., None].float()
    state = torch.zeros_like(decay[:, :, 0])
    ys = []
    for t in range(u.shape[-1]):
        state = decay[:, :, t] * state + drive[:, :, t]
        ys.append((state * C[:, None, :, t].float()).sum(-1))
    y = torch.stack(ys, dim=-1).to(_out_dtype(u, D, z))
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y.to(_out_dtype(u, D, z))


def _out_dtype(u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.dtype:
    """The dtype HuggingFace's fallback returns: ``y`` in ``u``'s, promoted by ``D`` and ``z``."""
    dtype = u.dtype
    for other in (D, z):
        if other is not None:
            dtype = torch.promote_types(dtype, other.dtype)
    return dtype


@selective_scan.register_fake
def _(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
      z: torch.Tensor | None, delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    return u.new_empty(u.shape, dtype=_out_dtype(u, D, z))


def _save_inputs(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    *tensors, ctx.delta_softplus = inputs
    ctx.present = [t is not None for t in tensors]
    ctx.save_for_backward(*(t for t in tensors if t is not None))


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """The gradients by running the recurrence again under autograd, from the saved inputs (as ``selective_scan_fn``
    recomputes its states in backward rather than saving them)."""
    saved = iter(ctx.saved_tensors)
    inputs = [next(saved).detach().requires_grad_() if present else None for present in ctx.present]
    with torch.enable_grad():
        y = _recurrence(*inputs, ctx.delta_softplus)
        wrt = [t for t in inputs if t is not None]
        grads = iter(torch.autograd.grad(y, wrt, grad, allow_unused=True))
    return (*(next(grads) if t is not None else None for t in inputs), None)


selective_scan.register_autograd(_backward, setup_context=_save_inputs)


@functools.cache  # register once per process
def register_dtensor_rules() -> None:
    """DTensor's sharding of ``autopar::selective_scan``, the planner's rules (``autopar.intra_op.strategies``):
    the channels split, or the batch, or nothing; for a plan's tensor-parallel region run op by op
    (``autopar.runtime.region_graph``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.autopar.selective_scan.default)
    def rule(u: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, z: Any, delta_bias: Any, delta_softplus: Any) -> list:
        def given(arg: Any, p: Any) -> Any:
            return None if arg is None else p

        r = Replicate()
        channels = [Shard(1), Shard(1), Shard(0), r, r, given(D, Shard(0)), given(z, Shard(1)),
                    given(delta_bias, Shard(0)), None]
        batch = [Shard(0), Shard(0), r, Shard(0), Shard(0), given(D, r), given(z, Shard(0)), given(delta_bias, r),
                 None]
        whole = [r, r, r, r, r, given(D, r), given(z, r), given(delta_bias, r), None]
        return [([r], whole), ([Shard(1)], channels), ([Shard(0)], batch)]


def _fused_hf_scan(original: Any) -> Any:
    """HuggingFace's ``mamba_selective_scan`` as one ``autopar::selective_scan`` (the original where the caller
    wants the last state too: generation with a cache)."""
    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
             delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any) -> Any:
        if return_last_state:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=True, **kwargs)
        return torch.ops.autopar.selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus)

    return scan


@contextlib.contextmanager
def traced_as_fused_kernels() -> Iterator[None]:
    """While tracing: HuggingFace's unrolled Mamba scans become ``autopar::selective_scan`` (module docstring)."""
    patched: list[tuple[Any, Any]] = []
    try:
        for name in _HF_SCAN_MODULES:
            module = sys.modules.get(name)  # a model built from it has imported it; nothing else needs it
            original = getattr(module, "mamba_selective_scan", None)
            if callable(original):
                patched.append((module, original))
                module.mamba_selective_scan = _fused_hf_scan(original)
        yield
    finally:
        for module, original in patched:
            module.mamba_selective_scan = original


__all__ = ["SELECTIVE_SCAN", "register_dtensor_rules", "selective_scan", "traced_as_fused_kernels"]
