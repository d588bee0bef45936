"""Activation checkpointing of the block stack, per the plan's ``recompute`` mode.

- ``full``: every block is checkpointed; backward re-runs its forward from its input.
- ``selective``: the attention module of every block is checkpointed.
- ``op``: per-op selective checkpointing of every block, as torchtitan does it
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of matrix products are
  kept, except every second one, and so are attention's; everything else is recomputed.  This is what the
  cost model prices as ``recompute=op`` (``autopar.inter_op.unit_costs``).

Which children and products each mode keeps is ``autopar.recompute_policy``'s.  Every eager recomputation
runs in ``autopar.runtime.context_parallel.recompute_context`` (under context parallelism, attention is
recomputed over the whole sequence's keys and values, as it ran in forward) and in the document mask its
forward ran in (``autopar.runtime.document_masking.recompute_context``).  Checkpointing inside a
compiled block (``compiled``, torchtitan's order: checkpoint, then compile) is traced with the block, and
``torch.compile`` takes only the selective-checkpointing dispatch modes as ``context_fn``; under context
parallelism the runtime checkpoints compiled blocks eagerly instead (``autopar.runtime.parallelize``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.recompute_policy import is_attention_module, product_is_saved
from autopar.runtime import context_parallel, document_masking


def _saved_by_op_checkpointing() -> tuple[set, set]:
    """(products, attention kernels) whose outputs per-op checkpointing keeps."""
    aten = torch.ops.aten
    products = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    if hasattr(aten, "_scaled_mm"):  # an FP8 Linear's product (torchao's Float8Linear)
        products.add(aten._scaled_mm.default)
    if hasattr(aten, "_grouped_mm"):  # dropless experts
        products.add(aten._grouped_mm.default)
    attention = {getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        if hasattr(aten, name)}
    return products, attention


def op_checkpoint_contexts():
    """``torch.utils.checkpoint``'s selective-checkpointing modes: keep every other product's output and
    attention's."""
    products, attention = _saved_by_op_checkpointing()
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in products:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if product_is_saved(counts[key]) else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def op_checkpoint_context():
    """Contexts for eager ``torch.utils.checkpoint``: ``op_checkpoint_contexts``, recomputing in the
    context-parallel attention."""
    forward, recompute = op_checkpoint_contexts()
    return forward, _Both(recompute, _recompute_in())


class _Both(contextlib.AbstractContextManager):
    """Two contexts entered together, as often as the recomputation enters them (a split backward, in the
    zero-bubble schedules, recomputes a region for its input step and again for its weight step)."""

    def __init__(self, first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> None:
        self._contexts = (first, second)
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for context in self._contexts:
            stack.enter_context(context)
        self._entered.append(stack)

    def __exit__(self, *exc: object) -> bool | None:
        return self._entered.pop().__exit__(*exc)


def _recompute_in() -> contextlib.AbstractContextManager:
    """What a region made now recomputes in: the context-parallel attention, the document mask of now."""
    return _Both(context_parallel.recompute_context(), document_masking.recompute_context())


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Forward as it is; recomputation as ``_recompute_in``."""
    return contextlib.nullcontext(), _recompute_in()


def apply_recompute(module: nn.Module, container: str | None, mode: str, compiled: bool = False) -> None:
    """Checkpoint the blocks of ``module``'s stack ``container`` per ``mode`` (none/selective/op/full);
    ``compiled``: the blocks will run ``torch.compile``d (see the module docstring)."""
    if mode == "none" or not container:
        return
    whole = {} if compiled else {"context_fn": _contexts}
    blocks = module.get_submodule(container)
    for key, block in list(blocks.named_children()):
        if mode == "full":
            blocks.register_module(key, checkpoint_wrapper(block, **whole))
        elif mode == "op":
            contexts = op_checkpoint_contexts if compiled else op_checkpoint_context
            blocks.register_module(key, checkpoint_wrapper(block, context_fn=contexts))
        else:  # selective: the attention of every block
            for name, child in list(block.named_children()):
                if is_attention_module(name, type(child).__name__):
                    block.register_module(name, checkpoint_wrapper(child, **whole))


__all__ = ["apply_recompute", "op_checkpoint_context", "op_checkpoint_contexts"]
