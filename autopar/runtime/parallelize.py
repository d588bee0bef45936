"""The steps that lay a plan onto a model, in torchtitan's order: pipeline split, TP, EP, AC, compile, data
parallelism (over ``dp x cp``: context-parallel ranks hold the same weights; the experts over the ``dp / ep``
ranks holding the same ones), then this rank's position tables under context parallelism
(``autopar.runtime.context_parallel``).

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

bf16 training is FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters for compute, fp32 gradient reduction
and master weights) on every layout, a single data-parallel rank included, and not autocast over fp32
weights: autocast keeps the residual stream in fp32 (an fp32 embedding plus bf16 branches is fp32) and
casts a shared fp32 input once per consuming Linear (q, k and v each save their own bf16 copy): a GPT
(4 layers of 512) at tp4 measured 25.5 MiB of activations against the 16.2 the plan prices for bf16
training (Megatron-LM's, and torchtitan's FSDP path), and measures 16.15 this way.  Only the loss runs
under autocast (in fp32).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from autopar.runtime.context_parallel import ContextParallel, shard_sequence_buffers
from autopar.runtime.expert_parallel import apply_ep, expert_mesh
from autopar.runtime.fp8 import check_fp8_regions, convert_linears_to_fp8
from autopar.runtime.materialize import MetaModel, build_on_meta, clean_fqn, materialize
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.stages import prune
from autopar.runtime.support import check_compiled_recompute


def apply_pp(build: Callable[[], nn.Module], stage_layers: list[tuple[int, int]], chunks: Iterable[int],
             container: str, ends: Mapping[str, list[str]] | None = None) -> list[nn.Module]:
    """One meta-device model per pipeline chunk of this rank, each pruned to the chunk's layers (the
    embeddings stay on the first chunk, the head on the last; ``ends``: the plan's ``stack_ends``).  Each
    is built afresh: no deep copies."""
    last = len(stage_layers) - 1
    return [prune(build_on_meta(build).model, *stage_layers[c], c == 0, c == last, container, ends) for c in chunks]


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
    for src, alias in tied:
        owner, _, attr = alias.rpartition(".")
        src_owner, _, src_attr = src.rpartition(".")
        if owner in present and src_owner in present:
            setattr(module.get_submodule(owner), attr, getattr(module.get_submodule(src_owner), src_attr))


def frozen_parameters(module: nn.Module) -> set[str]:
    """FQNs of the parameters that train nothing (``requires_grad=False``: a fine-tuned model's frozen base)."""
    return {clean_fqn(name) for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def freeze(module: nn.Module, frozen: Collection[str], dtype: torch.dtype | None) -> None:
    """Keep ``frozen`` parameters frozen, in ``dtype`` where given (bf16 training holds them in bf16: no master
    copy to update).  ``parallelize_module`` makes every parameter it shards trainable again (it wraps the
    DTensor in a new ``nn.Parameter``); FSDP2, applied after, then leaves them out of its gradient
    reduce-scatter (its ``FSDPParam`` keeps ``requires_grad``)."""
    if not frozen:
        return
    cast: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for name, sub in module.named_modules(remove_duplicate=False):
        for attr, p in list(sub._parameters.items()):
            if p is None or clean_fqn(f"{name}.{attr}" if name else attr) not in frozen:
                continue
            p.requires_grad_(False)
            if (dtype is not None and p.dtype != dtype and p.is_floating_point()) or id(p) in cast:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                sub._parameters[attr] = cast[id(p)]


def apply_ac(module: nn.Module, container: str | None, recompute: str, compiled: bool = False) -> None:
    """Activation checkpointing of the block stack (``none``, ``selective``, ``op`` or ``full``), for blocks that
    run ``torch.compile``d where ``compiled``."""
    apply_recompute(module, container, recompute, compiled)


def apply_compile(module: nn.Module, container: str | None) -> None:
    """``torch.compile`` each block of the stack in place (``Module.compile``, as torchtitan's ``apply_compile``:
    the parameter names stay the model's, no ``_orig_mod.``; ``compiled_blocks`` counts them).  Applied after
    activation checkpointing (the compiled block holds its checkpointing) and before FSDP2, whose hooks run
    around it.  What Inductor then fuses is what the plan priced (``autopar.passes.fusion``)."""
    if not container:
        return
    for block in module.get_submodule(container).children():
        block.compile()


def compiled_blocks(parts: Iterable[nn.Module], container: str | None) -> int:
    """How many blocks of the stack ``apply_compile`` compiled, over this rank's ``parts``."""
    if not container:
        return 0
    return sum(getattr(block, "_compiled_call_impl", None) is not None
               for part in parts for block in part.get_submodule(container).children())


def mixed_precision(precision: str):  # -> MixedPrecisionPolicy
    """FSDP2's policy for ``bf16`` training (bf16 compute and gathers, fp32 gradient reduction, as
    torchtitan sets it) or ``fp32``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def scalar_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The 0-dim parameters of ``module`` (CLIP's ``logit_scale``), which FSDP2 cannot shard ("fully_shard
    doesn't support scalar parameters"): ``apply_dp`` leaves them whole on every rank, and the ``Trainer``
    averages their gradients over the replicas itself (``reduce_scalar_grads``)."""
    return {p for p in module.parameters() if p.ndim == 0}


def reduce_scalar_grads(params: Iterable[nn.Parameter], replicas: DeviceMesh) -> None:
    """Average the gradients of the parameters data parallelism left whole (``scalar_parameters``) over the
    ranks holding the same weights, as FSDP2 averages the rest: one all-reduce for all of them."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or replicas.size() == 1:
        return
    flat = torch.stack([g.float() for g in grads])
    dist.all_reduce(flat, group=replicas.get_group())
    flat /= replicas.size()
    for g, total in zip(grads, flat, strict=True):
        g.copy_(total)


def apply_dp(module: nn.Module, dp_mesh: DeviceMesh, container: str | None, zero: int,
             precision: str = "bf16", experts: tuple[DeviceMesh, Collection[str]] | None = None) -> bool:
    """Data parallelism at ZeRO level ``zero`` on every block and on the root; returns whether it applied.

    Under ``bf16`` it applies on one data-parallel rank too (as ``replicate``): FSDP2's mixed-precision
    policy is how bf16 training runs (see the module's docstring), and without a second rank its
    collectives are copies.  Under ``fp32`` a single rank has nothing to do.

    ``experts``: the expert-parallel experts modules and the mesh of the ranks holding the same experts
    (``dp / ep``), over which they are wrapped first, as torchtitan does; their gradients are divided by
    all ``dp x cp`` replicas like the rest, since each rank's already sum its ``ep`` peers' tokens.

    Scalar parameters stay out of FSDP2 (``scalar_parameters``): whole, in fp32, on every rank.
    """
    if dp_mesh.size() == 1:
        if precision != "bf16":
            return False
        zero = 0  # one rank: nothing to shard
    policy = mixed_precision(precision)
    ignored = scalar_parameters(module) or None
    blocks = list(module.get_submodule(container).children()) if container else []
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    present = {clean_fqn(name): sub for name, sub in module.named_modules()}  # through checkpoint wrappers
    for name in experts[1] if experts is not None else ():
        if name in present:
            mesh = experts[0]
            if zero == 0 or mesh.size() == 1:
                wrapped = replicate(present[name], mesh=mesh, mp_policy=policy, ignored_params=ignored)
            else:
                wrapped = fully_shard(present[name], mesh=mesh, reshard_after_forward=zero >= 3, mp_policy=policy,
                                      ignored_params=ignored)
                if mesh.device_type == "cpu":  # gloo has no pre-multiplied sum: divide beside a plain one
                    wrapped.set_force_sum_reduction_for_comms(True)
            wrapped.set_gradient_divide_factor(float(dp_mesh.size()))
    if zero == 0:
        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored)
        replicate(module, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored)
        return True
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=zero >= 3, mp_policy=policy, ignored_params=ignored)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero >= 3, mp_policy=policy, ignored_params=ignored)
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


MESH_DIMS = ("pp", "dp", "cp", "tp")


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks holding the same weights: ``dp``, flattened with ``cp`` when there is context parallelism
    (its gradients are reduced, and ZeRO shards, over both; torchtitan's ``dp_shard_cp``)."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def context_of(mesh: DeviceMesh, seq_len: int) -> ContextParallel | None:
    """This rank's context-parallel group on ``mesh``, ``None`` without context parallelism."""
    if mesh["cp"].size() == 1:
        return None
    return ContextParallel(mesh["cp"].get_group(), mesh["cp"].size(), mesh.get_local_rank("cp"), seq_len)


def parallelize(build: Callable[[], nn.Module], mesh: DeviceMesh, device: torch.device, seed: int, *,
                stage_layers: list[tuple[int, int]], chunks: list[int], container: str | None,
                tp_styles: Callable[[int, nn.Module], Mapping[str, ParallelStyle]], tied: list[tuple[str, str]],
                recompute: str, zero: int, precision: str, reference: MetaModel | None = None,
                context: ContextParallel | None = None, ends: Mapping[str, list[str]] | None = None,
                fp8_linears: Collection[str] = (), fp8_param_gather: bool = False, ep: int = 1,
                experts: Mapping[str, bool] | None = None, compile: bool = False) -> list[nn.Module]:
    """This rank's parts of the model (one per pipeline chunk it runs), split, tensor-parallel, checkpointed,
    data-parallel and only then allocated on ``device`` with the weights of ``seed``.

    ``tp_styles(chunk, module)`` gives the ``parallelize_module`` styles of a chunk.  ``reference``: the
    whole model on the meta device, if the caller has built one already (it is never sharded: the recipe of
    every parameter and buffer).  ``context``: this rank's context-parallel group (``context_of``).
    ``fp8_linears``: the Linears an FP8 plan trains in FP8 (``autopar.runtime.fp8``), swapped first;
    ``fp8_param_gather``: ZeRO-3 gathers their weights in FP8.  ``ep``: expert parallelism on the
    ``experts`` modules (name -> whether tp splits them too, ``autopar.runtime.expert_parallel``).
    ``compile``: each block runs ``torch.compile``d (``apply_compile``).
    """
    reference = reference or build_on_meta(build)
    if mesh["pp"].size() > 1:
        parts = apply_pp(build, stage_layers, chunks, container or "", ends)
    else:
        parts = [build_on_meta(build).model]
    aliases = {alias: src for src, alias in tied}
    dp_mesh = replica_mesh(mesh)
    ep_mesh = expert_mesh(mesh, ep) if ep > 1 else None
    for chunk, part in zip(chunks, parts):
        if fp8_linears:
            if mesh["tp"].size() > 1:
                check_fp8_regions(fp8_linears, [name for name, style in tp_styles(chunk, part).items()
                                                if type(style).__name__ == "PlacedParameters"])
            convert_linears_to_fp8(part, fp8_linears, gather_in_fp8=fp8_param_gather and zero >= 3)
        frozen = frozen_parameters(part)
        if mesh["tp"].size() > 1:
            apply_tp(part, mesh["tp"], tp_styles(chunk, part), tied)
        if ep_mesh is not None:
            apply_ep(part, ep_mesh, experts or {})
        freeze(part, frozen, torch.bfloat16 if precision == "bf16" else None)
        if compile and context is not None:
            # a compiled backward would recompute attention over this rank's keys only: checkpoint the compiled
            # blocks eagerly instead, recomputing in the context-parallel attention (autopar.runtime.recompute)
            check_compiled_recompute(recompute, compile)
            apply_compile(part, container)
            apply_ac(part, container, recompute)
        else:
            apply_ac(part, container, recompute, compile)
            if compile:
                apply_compile(part, container)
        apply_dp(part, dp_mesh, container, zero, precision,
                 (ep_mesh["dp_mod_ep"], list(experts or {})) if ep_mesh is not None else None)
        materialize(part, reference, device, seed, aliases)
        if context is not None:
            shard_sequence_buffers(part, context)
        part.train()
    return parts


__all__ = ["MESH_DIMS", "apply_ac", "apply_compile", "apply_dp", "apply_pp", "apply_tp", "compiled_blocks",
           "context_of", "mixed_precision", "parallelize", "reduce_scalar_grads", "replica_mesh", "scalar_parameters",
           "set_micro_batch"]
