"""Document masking: attention that keeps the documents packed into one sample apart.

Samples are windows of a token stream, documents packed end to end (``autopar.runtime.token_loader``).  With
``train.py --document-masking`` a token attends only to earlier tokens of its own document (block-causal),
as Llama 3 trained ("we use an attention mask that prevents self-attention between different documents
within the same sequence", The Llama 3 Herd of Models, sec. 3.4.1).

How it runs, on any model whose attention calls ``F.scaled_dot_product_attention`` with ``is_causal=True``
(the zoo's, HuggingFace's ``sdpa`` attention when it has no padding mask): a ``TorchFunctionMode`` holds the
micro-batch's mask and swaps it in for the causal flag while forward runs.  The mask is made before
forward, once per micro-batch; a checkpointed region made in its forward recomputes in it again
(``recompute_context``: a forward's torch function modes are not active when backward recomputes).

The kernel: SDPA with an explicit boolean mask, which on CUDA is the memory-efficient kernel computing every
block, not the flash kernel with causal block skipping that plans price; on the CPU the math kernel, as
without the mask.  Not under context parallelism (its attention has its own mask) or compiled blocks.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from autopar.errors import AutoparError
from autopar.runtime.attention_mode import AttentionMode


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, seq, seq]``: whether query ``i`` may see key ``j`` (``j <= i``, one document)."""
    if document_ids.dim() != 2:
        raise AutoparError(f"document ids are [batch, seq], not of shape {tuple(document_ids.shape)}")
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


class DocumentMask(AttentionMode):
    """While active, causal ``F.scaled_dot_product_attention`` is block-causal over the micro-batch's
    documents."""

    def __init__(self, document_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        super().__init__()
        self.mask = block_causal_mask(document_ids) if mask is None else mask

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                dropout_p: float = 0.0, is_causal: bool = False, **rest: Any) -> torch.Tensor:
        if not is_causal:
            raise AutoparError("document masking replaces the causal mask of attention called with "
                               "is_causal=True; this model's attention passes "
                               + ("its own attn_mask" if attn_mask is not None else "no causal flag"))
        b, t = query.shape[0], query.shape[-2]
        if self.mask.shape[0] != b or self.mask.shape[-1] != t or key.shape[-2] != t:
            raise AutoparError(f"document masking needs attention over the whole sample ({self.mask.shape[-1]} "
                               f"tokens, batch {self.mask.shape[0]}); this attention has {t} queries and "
                               f"{key.shape[-2]} keys in a batch of {b}")
        return F.scaled_dot_product_attention(query, key, value, attn_mask=self.mask, dropout_p=dropout_p, **rest)


def document_mask(document_ids: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """The document mask of a micro-batch's ids, or nothing when there are none."""
    return contextlib.nullcontext() if document_ids is None else DocumentMask(document_ids)


class RecomputeContext(contextlib.AbstractContextManager):
    """The document mask a checkpointed region recomputes in: the one active when its forward ran (this
    object is made then, by ``torch.utils.checkpoint``'s ``context_fn``), unless it is active already."""

    def __init__(self) -> None:
        self._mask = DocumentMask.active[-1].mask if DocumentMask.active else None
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        active = DocumentMask.active
        if self._mask is not None and not (active and active[-1].mask is self._mask):
            stack.enter_context(DocumentMask(mask=self._mask))
        self._entered.append(stack)

    def __exit__(self, *exc: object) -> bool | None:
        return self._entered.pop().__exit__(*exc)


def recompute_context() -> RecomputeContext:
    """A ``RecomputeContext`` holding the document mask active now."""
    return RecomputeContext()


__all__ = ["DocumentMask", "block_causal_mask", "document_mask", "recompute_context"]
