"""The four steps that lay a plan onto a model, in torchtitan's order: pipeline split, TP, AC, data parallelism.

Both ``autopar.runtime.apply`` and generated ``train.py`` scripts call these; the scripts pass the plan's
choices as the literals they print.  Each function works on a meta-device model (``autopar.runtime.
materialize``): nothing is allocated until the split and sharded modules are materialized.

Data parallelism by ZeRO level, as FSDP2 runs it (the cost model prices the same):

- 0: ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``): whole parameters, one
  bucketed gradient all-reduce per block overlapped with backward.  The FSDP2-based replicate rather than
  the DDP-based ``_composable.replicate``, because it composes with pipelining and with tensor-parallel
  DTensor parameters, and takes the same mixed-precision policy as ``fully_shard``.
- 1: ``fully_shard(reshard_after_forward=False)``; outside pipelining the parameters stay gathered and the
  gradients accumulate unsharded until the last micro-batch, which reduce-scatters once (ZeRO-1's traffic:
  one all-gather and one reduce-scatter per step, an all-reduce's worth).
- 2: as 1, but every micro-batch reduce-scatters its gradients (sharded gradients, ZeRO-2).
- 3: ``fully_shard(reshard_after_forward=True)``: gathered for each block's forward and again for its
  backward, every micro-batch.

Under pipelining torch's ``PipelineStage`` itself defers the gradient sync and the reshard to the last
micro-batch, at every level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from autopar.runtime.materialize import MetaModel, build_on_meta, materialize
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.stages import prune


def apply_pp(build: Callable[[], nn.Module], stage_layers: list[tuple[int, int]], chunks: Iterable[int],
             container: str) -> list[nn.Module]:
    """One meta-device model per pipeline chunk of this rank, each pruned to the chunk's layers (the
    embeddings stay on the first chunk, the head on the last).  Each is built afresh: no deep copies."""
    last = len(stage_layers) - 1
    return [prune(build_on_meta(build).model, *stage_layers[c], c == 0, c == last, container) for c in chunks]


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, styles: Mapping[str, ParallelStyle],
             tied: Iterable[tuple[str, str]] = ()) -> None:
    """``parallelize_module`` with the styles of the modules ``module`` holds, then re-tie shared weights
    (``parallelize_module`` replaces parameters, which unties them)."""
    from torch.distributed.tensor.parallel import parallelize_module

    present = {name for name, _ in module.named_modules()}
    plan = {name: style for name, style in styles.items() if name in present}
    if not plan:
        return
    parallelize_module(module, tp_mesh, plan)
    for name in plan:
        communicate_in_autocast_dtype(module.get_submodule(name))
    for src, alias in tied:
        owner, _, attr = alias.rpartition(".")
        src_owner, _, src_attr = src.rpartition(".")
        if owner in present and src_owner in present:
            setattr(module.get_submodule(owner), attr, getattr(module.get_submodule(src_owner), src_attr))


def _to_autocast_dtype(value: object) -> object:
    """A float32 tensor or DTensor in autocast's dtype, when autocast is on for its device; anything else as
    it is.  A DTensor with a pending sum is cast shard by shard and keeps its placements (a vocab-parallel
    embedding's masked partial output among them): DTensor's own cast would settle the sum first."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return value
    device = value.device.type
    if not torch.is_autocast_enabled(device):
        return value
    dtype = torch.get_autocast_dtype(device)
    if isinstance(value, DTensor) and any(p.is_partial() for p in value.placements):
        return DTensor.from_local(value.to_local().to(dtype), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value.to(dtype)


def communicate_in_autocast_dtype(module: nn.Module) -> None:
    """Cast the float32 inputs and outputs of a tensor-parallel module to autocast's dtype (bf16) before
    its style redistributes them, so that its collectives move 16-bit activations as the plan prices them
    (and as Megatron-LM, whose activations are bf16, moves them).  Under autocast a norm or an embedding
    hands float32 to the next module: a column-parallel Linear would all-reduce a float32 input gradient in
    backward, a sequence-parallel region all-gather a float32 input.  Forward numerics of the Linears do not
    change (autocast casts their inputs to bf16 anyway).  The hooks run before the style's own (``prepend``),
    and do nothing outside autocast."""
    from torch.utils._pytree import tree_map

    module.register_forward_pre_hook(lambda _, args, kwargs: tree_map(_to_autocast_dtype, (args, kwargs)),
                                     prepend=True, with_kwargs=True)
    module.register_forward_hook(lambda _, args, out: tree_map(_to_autocast_dtype, out), prepend=True)


def apply_ac(module: nn.Module, container: str | None, recompute: str) -> None:
    """Activation checkpointing of the block stack (``none``, ``selective``, ``op`` or ``full``)."""
    apply_recompute(module, container, recompute)


def mixed_precision(precision: str):  # -> MixedPrecisionPolicy
    """FSDP2's policy for ``bf16`` training (bf16 compute and gathers, fp32 gradient reduction, as
    torchtitan sets it) or ``fp32``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_dp(module: nn.Module, dp_mesh: DeviceMesh, container: str | None, zero: int,
             precision: str = "bf16") -> bool:
    """Data parallelism at ZeRO level ``zero`` on every block and on the root; returns whether it applied
    (nothing to do on one data-parallel rank)."""
    if dp_mesh.size() == 1:
        return False
    policy = mixed_precision(precision)
    blocks = list(module.get_submodule(container).children()) if container else []
    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=policy)
        replicate(module, mesh=dp_mesh, mp_policy=policy)
        return True
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=zero >= 3, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero >= 3, mp_policy=policy)
    return True


def set_micro_batch(modules: Iterable[nn.Module], zero: int, last: bool) -> None:
    """Before a micro-batch's backward (outside pipelining): whether it syncs gradients and reshards.

    ZeRO 0 and 1 reduce on the last micro-batch only; 2 and 3 on every one.  Levels 1 and 2 keep the
    parameters gathered until the last micro-batch; 3 reshards after every forward and backward.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(last or zero >= 2, recurse=True)
            module.set_reshard_after_backward(last or zero >= 3, recurse=True)
            module.set_is_last_backward(last)


def parallelize(build: Callable[[], nn.Module], mesh: DeviceMesh, device: torch.device, seed: int, *,
                stage_layers: list[tuple[int, int]], chunks: list[int], container: str | None,
                tp_styles: Callable[[int, nn.Module], Mapping[str, ParallelStyle]], tied: list[tuple[str, str]],
                recompute: str, zero: int, precision: str, reference: MetaModel | None = None) -> list[nn.Module]:
    """This rank's parts of the model (one per pipeline chunk it runs), split, tensor-parallel, checkpointed,
    data-parallel and only then allocated on ``device`` with the weights of ``seed``.

    ``tp_styles(chunk, module)`` gives the ``parallelize_module`` styles of a chunk.  ``reference``: the
    whole model on the meta device, if the caller has built one already (it is never sharded: the recipe of
    every parameter and buffer).
    """
    reference = reference or build_on_meta(build)
    if mesh["pp"].size() > 1:
        parts = apply_pp(build, stage_layers, chunks, container or "")
    else:
        parts = [build_on_meta(build).model]
    aliases = {alias: src for src, alias in tied}
    for chunk, part in zip(chunks, parts):
        if mesh["tp"].size() > 1:
            apply_tp(part, mesh["tp"], tp_styles(chunk, part), tied)
        apply_ac(part, container, recompute)
        apply_dp(part, mesh["dp"], container, zero, precision)
        materialize(part, reference, device, seed, aliases)
        part.train()
    return parts


__all__ = ["apply_ac", "apply_dp", "apply_pp", "apply_tp", "communicate_in_autocast_dtype", "mixed_precision",
           "parallelize", "set_micro_batch"]
