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
sliding or chunked window that the sequence exceeds still gets its mask, as in the run.  Grouped-query attention
keeps its key/value heads repeated, as beside a mask (``repeated_kv_heads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from autopar.inputs import ModelInputs


def is_transformers_object(obj: object) -> bool:
    """Whether ``obj`` is an instance of a HuggingFace class (a model, a module, a config) or of a subclass of one,
    without importing transformers."""
    return any(cls.__module__.startswith("transformers.") for cls in type(obj).__mro__)


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a HuggingFace module (a PEFT wrapper holds one)."""
    return any(is_transformers_object(m) for m in model.modules())


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
    patches = {"_ignore_causal_mask_sdpa": _causal_skip, "_ignore_bidirectional_mask_sdpa": _bidirectional_skip}
    if "position_ids" not in inputs.kwargs:
        patches["find_packed_sequence_indices"] = lambda _original: lambda position_ids: None
    originals = {name: getattr(masking_utils, name) for name in patches if hasattr(masking_utils, name)}
    if len(originals) < len(patches):
        yield
        return
    try:
        for name, make in patches.items():
            setattr(masking_utils, name, make(originals[name]))
        # without a mask, SDPA would get fewer key/value heads (enable_gqa); the trace keeps them repeated
        with repeated_kv_heads():
            yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)


@contextlib.contextmanager
def repeated_kv_heads() -> Iterator[None]:
    """HuggingFace's SDPA integration repeats grouped-query attention's key/value heads (``repeat_kv``) as it does
    beside a mask, instead of handing attention fewer of them (``enable_gqa``).  The planner's trace and the
    runtime's tensor-parallel attention regions (``autopar.runtime.region_graph``) both take this path: it splits
    the heads evenly over tp whatever their number, also where tp exceeds the key/value heads."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        yield
        return
    saved = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if saved is None:
        yield
        return
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = saved


__all__ = ["is_transformers_model", "is_transformers_object", "masks_as_run", "repeated_kv_heads"]
