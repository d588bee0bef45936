"""HuggingFace attention masks traced as the model runs them.

A HuggingFace model given token ids alone builds no attention mask when it trains: ``masking_utils`` sees no
padding and contiguous positions and lets SDPA run with ``is_causal=True`` (or with no mask at all, for a
bidirectional encoder), which on a GPU is FlashAttention's kernel skipping the blocks above the diagonal.  Under
``torch.export`` it cannot look at tensors' values, so it materializes the mask instead (``[b, 1, s, s]``
booleans), and a trace of it would price attention over every score, with the kernel that takes a mask.

``masks_as_run`` makes the trace take the branch the run takes, where the run's answer follows from what the
example inputs do not hold: with no padding mask among them, the padding mask is ``None`` in training too; with
no ``position_ids`` among them, the model makes its own ``arange`` positions, which never read as packed
sequences.  What depends on values the inputs do hold (a padding mask passed in) is traced as before.  A
sliding or chunked window that the sequence exceeds still gets its mask, as in the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from autopar.inputs import ModelInputs


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a HuggingFace module (a PEFT wrapper holds one), without importing
    transformers."""
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


def _causal_skip(original: Any) -> Any:
    """``_ignore_causal_mask_sdpa`` as it answers at run time where no padding mask is given (its checks in
    transformers' ``masking_utils``, without the one that refuses while exporting)."""

    def skip(padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any,
             local_attention_size: int | None = None) -> bool:
        if padding_mask is not None:
            return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False  # the window cuts into the sequence: a real mask
        return q_length == 1 or kv_length == q_length or (isinstance(q_offset, int) and q_offset == 0)

    return skip


def _bidirectional_skip(original: Any) -> Any:
    """``_ignore_bidirectional_mask_sdpa`` as it answers at run time where no padding mask is given."""

    def skip(padding_mask: Any, kv_length: int, local_attention_size: int | None = None) -> bool:
        if padding_mask is not None:
            return original(padding_mask, kv_length, local_attention_size)
        return local_attention_size is None or kv_length < local_attention_size

    return skip


@contextlib.contextmanager
def masks_as_run(model: nn.Module, inputs: ModelInputs) -> Iterator[None]:
    """While tracing ``model`` on ``inputs``, build HuggingFace's attention masks as a training run on those inputs
    does (module docstring).  Does nothing for other models, or where transformers' mask module lacks the
    functions it answers for (another version: the trace keeps its masks)."""
    if not is_transformers_model(model):
        yield
        return
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        sdpa_attention = None
    names = set(inputs.kwargs)
    patches = {(masking_utils, "_ignore_causal_mask_sdpa"): _causal_skip,
               (masking_utils, "_ignore_bidirectional_mask_sdpa"): _bidirectional_skip}
    if "position_ids" not in names:
        patches[masking_utils, "find_packed_sequence_indices"] = lambda _original: lambda position_ids: None
    if sdpa_attention is not None:
        # Without a mask, the SDPA integration would hand attention fewer key/value heads (enable_gqa); with the
        # mask it repeated them (repeat_kv), which is the path tensor parallelism runs (the heads split evenly
        # over tp even where tp exceeds the key/value heads: autopar.runtime.region_graph._attention_as_traced),
        # and the one the trace keeps.
        patches[sdpa_attention, "use_gqa_in_sdpa"] = lambda _original: lambda *args, **kwargs: False
    originals = {key: getattr(*key) for key in patches if hasattr(*key)}
    if len(originals) < len(patches):
        yield
        return
    try:
        for (owner, name), make in patches.items():
            setattr(owner, name, make(originals[owner, name]))
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


__all__ = ["is_transformers_model", "masks_as_run"]
