"""What each ``recompute`` mode of a plan checkpoints: shared by the runtime that applies it
(``autopar.runtime.recompute``, which generated scripts run too) and the cost model that prices it
(``autopar.inter_op.unit_costs``), so the two cannot drift apart.  No torch here.
"""

from __future__ import annotations

#: ``recompute=selective`` checkpoints the child of every block with one of these names, or whose type's
#: name says attention.
ATTENTION_NAMES = ("attn", "self_attn", "attention")
#: ``recompute=op`` (torchtitan's per-op selective checkpointing, built on
#: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps the outputs of attention and of one
#: matrix product in every ``SAVE_EVERY`` (the first, third, ...), and recomputes everything else in
#: backward (torchtitan ``_save_list``: aten.mm and the SDPA kernels; "save every other mm").
SAVE_EVERY = 2


def is_attention_module(name: str, type_name: str) -> bool:
    """Whether a block's child ``name`` of class ``type_name`` is the attention ``selective`` checkpoints."""
    return "attention" in type_name.lower() or name in ATTENTION_NAMES


def product_is_saved(product_index: int) -> bool:
    """Whether ``recompute=op`` keeps the output of a block's ``product_index``-th matrix product (from 1)."""
    return product_index % SAVE_EVERY == 1


__all__ = ["ATTENTION_NAMES", "SAVE_EVERY", "is_attention_module", "product_is_saved"]
