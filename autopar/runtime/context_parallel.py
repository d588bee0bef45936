"""Context parallelism: ``cp`` ranks share every sample, each holding a load-balanced slice of its sequence.

The sequence is cut into ``2 * cp`` chunks and rank ``i`` takes chunks ``i`` and ``2 * cp - 1 - i``, so under a
causal mask every rank has the same share of the attention scores.  Every op but attention is token-wise and
runs on the slice as it is.  Attention all-gathers the keys and values of the whole sequence over the ``cp``
group (``all_gather_single_autograd``: its backward reduce-scatters their gradients back to their owners),
and each local chunk of queries attends to the keys before it under a causal mask aligned to its end
(``ContextParallelAttention``: FlashAttention's causal kernel on CUDA): the variant Llama 3 trained with, and
the one ``autopar.inter_op.context_parallel`` prices.  It runs on gloo and on NCCL (torch's own
``context_parallel`` covers only the CUDA SDPA kernels).

What the model must let the runtime see:

- attention through ``F.scaled_dot_product_attention`` with ``is_causal=True`` (or no mask at all): a
  ``TorchFunctionMode`` swaps in the context-parallel attention while forward runs, and activation
  checkpointing enters it again for its recomputation (``recompute_context``: a forward's torch function
  modes are not active when backward recomputes);
- the global positions of its tokens: either its position tables as buffers the model slices from the start
  (``rope_cos[:t]``), named with their sequence dim in the model class's ``cp_sequence_buffers``, which the
  runtime replaces with this rank's rows; or, for a HuggingFace model, ``position_ids`` (``takes_positions``),
  which each micro-batch then carries with an all-ones ``attention_mask``: given positions alone, HuggingFace
  would read a rank's two chunks as two packed sequences and mask each from the other, where the mask says
  there is no padding and SDPA runs with ``is_causal`` (``transformers.masking_utils``);
- the default next-token loss: the labels are shifted on the whole sequence before it is sliced.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from autopar.errors import AutoparError
from autopar.inputs import ModelInputs
from autopar.runtime.attention_mode import AttentionMode
from autopar.runtime.stages import is_huggingface, wrapped_model
from autopar.tracing import IGNORE_INDEX


def rank_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds: chunks ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp``."""
    if seq_len % (2 * cp):
        raise AutoparError(f"context parallelism cp={cp} needs the sequence ({seq_len} tokens) to split into "
                           f"{2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat((torch.arange(first, first + c), torch.arange(second, second + c)))


def gathered_positions(seq_len: int, cp: int) -> torch.Tensor:
    """The global positions of an all-gather of every rank's slice, in rank order."""
    return torch.cat([rank_positions(seq_len, cp, r) for r in range(cp)])


def takes_positions(model: nn.Module) -> bool:
    """Whether ``model`` is a HuggingFace model whose forward takes its tokens' positions (``position_ids``) and
    a padding mask (``attention_mask``): context parallelism hands it the global positions of a rank's slice."""
    inner = wrapped_model(model)
    if not is_huggingface(inner):
        return False
    params = inspect.signature(type(inner).forward).parameters
    return "position_ids" in params and "attention_mask" in params


@dataclass(frozen=True)
class ContextParallel:
    """One rank's place in its context-parallel group, and what it needs to shard a micro-batch."""

    group: Any  # the cp process group
    size: int
    rank: int
    seq_len: int
    positions_as_input: bool = False  # the model takes position_ids (a HuggingFace model: ``takes_positions``)

    def for_model(self, model: nn.Module) -> ContextParallel:
        """This context for ``model``: its positions passed as inputs where it takes them."""
        return replace(self, positions_as_input=takes_positions(model))

    def positions(self, device: torch.device) -> torch.Tensor:
        return rank_positions(self.seq_len, self.size, self.rank).to(device)

    def shard_inputs(self, inputs: ModelInputs) -> tuple[ModelInputs, torch.Tensor]:
        """This rank's slice of every input with the sequence at dim 1, and the next-token labels of its tokens
        (taken from the whole sequence of the first input, the token ids); with ``positions_as_input``, also the
        tokens' global ``position_ids`` and an all-ones ``attention_mask`` (module docstring)."""
        ids = inputs.first
        if ids.dim() < 2 or ids.shape[1] != self.seq_len:
            raise AutoparError(f"context parallelism needs token ids [batch, {self.seq_len}] as the first input, "
                               f"got shape {tuple(ids.shape)}")
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]
        pos = self.positions(ids.device)
        local = inputs.map(lambda x: x.index_select(1, pos) if x.dim() >= 2 and x.shape[1] == self.seq_len else x)
        if self.positions_as_input:
            position_ids = pos.unsqueeze(0).expand(ids.shape[0], -1)  # a row per sample: micro-batches split it
            local = ModelInputs(local.args, {**local.kwargs, "position_ids": position_ids,
                                             "attention_mask": torch.ones_like(position_ids)})
        return local, labels.index_select(1, pos)

    def loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the micro-batch's mean next-token loss, times ``cp``: the gradient reduction
        averages over ``dp x cp``, and the cp ranks' shares must add up, not average."""
        logits = output.logits if hasattr(output, "logits") else output
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        targets = labels.shape[0] * (self.seq_len - 1)
        return total * (self.size / targets)

    def key_order(self, device: torch.device) -> torch.Tensor:
        """Where each global position sits in an all-gather of every rank's slice: gathered keys indexed by this
        come in sequence order."""
        return torch.argsort(gathered_positions(self.seq_len, self.size)).to(device)

    def chunk_ends(self) -> tuple[int, int]:
        """Where this rank's two chunks of ``seq_len / (2 cp)`` queries end: chunk ``rank`` sees the keys up to
        the first, chunk ``2 cp - 1 - rank`` those up to the second."""
        c = self.seq_len // (2 * self.size)
        return (self.rank + 1) * c, (2 * self.size - self.rank) * c

    def attention(self, device: torch.device) -> ContextParallelAttention:
        return ContextParallelAttention(self, self.key_order(device))


class ContextParallelAttention(AttentionMode):
    """While active, ``F.scaled_dot_product_attention`` on this rank's slice attends over the whole sequence.

    The keys and values are all-gathered over the ``cp`` group (their gradients reduce-scattered back in
    backward) and put in sequence order.  Under a causal mask each of the rank's two query chunks then attends
    to the keys up to its own end with the mask aligned to that end (``_causal_to_end``): on CUDA that is
    FlashAttention's causal kernel, which skips the masked blocks, so a rank computes its causal share of the
    scores with the kernel the plan prices (``autopar.inter_op.context_parallel``); elsewhere SDPA runs on the
    mask made explicit.  Without a mask the gathered keys are used as they come."""

    def __init__(self, cp: ContextParallel, key_order: torch.Tensor) -> None:
        super().__init__()
        self.cp, self.key_order = cp, key_order  # made before forward: a recomputation must not run ops forward
        # did not

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                dropout_p: float = 0.0, is_causal: bool = False, **rest: Any) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        if attn_mask is not None:
            raise AutoparError("context parallelism supports attention with is_causal=True or without a mask; "
                               "this model passes an explicit attn_mask")
        group, seq = self.cp.group, query.dim() - 2
        key = all_gather_single_autograd(key.contiguous(), gather_dim=seq, group=group)
        value = all_gather_single_autograd(value.contiguous(), gather_dim=seq, group=group)
        if not is_causal:
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, **rest)
        if rest.pop("enable_gqa", False) and key.shape[-3] != query.shape[-3]:  # the causal-bias kernels take
            groups = query.shape[-3] // key.shape[-3]  # as many key/value heads as query heads
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        key, value = key.index_select(seq, self.key_order), value.index_select(seq, self.key_order)
        chunks = zip(query.split(self.cp.seq_len // (2 * self.cp.size), dim=seq), self.cp.chunk_ends(), strict=True)
        return torch.cat([_causal_to_end(q, key.narrow(seq, 0, seen), value.narrow(seq, 0, seen), dropout_p, rest)
                          for q, seen in chunks], dim=seq)


#: Head sizes FlashAttention takes as they are (``torch.nn.attention.bias.CausalBias`` pads the others).
_FLASH_HEAD_DIMS = range(8, 257, 8)


def runs_flash(query: torch.Tensor) -> bool:
    """Whether a rank's query chunk runs FlashAttention's causal kernel: on CUDA, in 16 bits, a head size it
    takes as it is."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] in _FLASH_HEAD_DIMS


def _causal_to_end(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                   rest: dict[str, Any]) -> torch.Tensor:
    """Attention of a block of queries that ends where the keys end, under a causal mask aligned to that end.
    On CUDA in 16 bits: FlashAttention's causal kernel, whose mask aligns a shorter query block to the end of
    the keys (FlashAttention-2's README, "causal"; ``torch.nn.attention.bias.causal_lower_right`` relies on it)
    and skips the masked blocks.  Elsewhere: SDPA with the mask made explicit."""
    length, seen = query.shape[-2], key.shape[-2]
    if runs_flash(query):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, True,
                                                                  scale=rest.get("scale"))[0]
    mask = torch.ones(length, seen, dtype=torch.bool, device=query.device).tril(seen - length)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, **rest)


class RecomputeContext(contextlib.AbstractContextManager):
    """The context a checkpointed region recomputes in (``torch.utils.checkpoint``'s ``context_fn``, made in
    forward and entered in backward): the context-parallel attention of the step whose backward runs, unless
    it is active already.  It may be entered more than once: a split backward (the zero-bubble pipeline
    schedules) recomputes a region for its input step and again for its weight step."""

    def __init__(self) -> None:
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        active = any(isinstance(m, ContextParallelAttention) for m in _get_current_function_mode_stack())
        entered = ContextParallelAttention.active
        outer = entered[-1] if entered and not active else None
        if outer is not None:
            stack.enter_context(ContextParallelAttention(outer.cp, outer.key_order))
        self._entered.append(stack)

    def __exit__(self, *exc: object) -> bool | None:
        return self._entered.pop().__exit__(*exc)


def recompute_context() -> RecomputeContext:
    """A fresh ``RecomputeContext``."""
    return RecomputeContext()


def shard_sequence_buffers(part: nn.Module, cp: ContextParallel) -> None:
    """Replace the position tables the model names in ``cp_sequence_buffers`` by this rank's rows (a model that
    takes its positions as an input, ``takes_positions``, holds none)."""
    tables = getattr(part, "cp_sequence_buffers", None)
    if tables is None and takes_positions(part):
        return
    if tables is None:
        raise AutoparError(f"context parallelism needs {type(part).__name__}.cp_sequence_buffers (its position "
                           "tables and their sequence dim, {} if it has none): the runtime slices them per rank")
    for name, dim in sorted(tables.items()):
        owner_name, _, leaf = name.rpartition(".")
        owner = part.get_submodule(owner_name) if owner_name else part
        table = getattr(owner, leaf)
        if table.shape[dim] < cp.seq_len:
            raise AutoparError(f"buffer {name} holds {table.shape[dim]} positions, fewer than the sequence "
                               f"({cp.seq_len})")
        local = table.narrow(dim, 0, cp.seq_len).index_select(dim, cp.positions(table.device))
        owner.register_buffer(leaf, local, persistent=False)


__all__ = ["ContextParallel", "ContextParallelAttention", "gathered_positions", "rank_positions",
           "recompute_context", "shard_sequence_buffers", "takes_positions"]
