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

Grouped-query attention keeps its key/value heads repeated in the trace, as beside a mask (``repeated_kv_heads``):
the path the runtime's tensor-parallel attention regions take, whatever tp.  Run without them (tp = 1),
HuggingFace hands attention the fewer heads instead (``enable_gqa``); ``kv_heads_as_run`` gives the graph of that
run, which the planner prices such layouts on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autopar.inputs import ModelInputs
from autopar.ir import Node, OpGraph, Ref
from autopar.passes.flops import attention_mask


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
def masks_as_run(model: nn.Module, inputs: ModelInputs) -> Iterator[bool]:
    """While tracing ``model`` on ``inputs``, build HuggingFace's attention masks as a training run on those inputs
    does (module docstring).  Does nothing for other models, or where transformers' mask module lacks the
    functions it answers for (another version: the trace keeps its masks).  Yields whether grouped-query
    attention's key/value heads are repeated where the model, run alone, would not (``OpGraph.repeats_kv_heads``)."""
    if not is_transformers_model(model):
        yield False
        return
    try:
        from transformers import masking_utils
    except ImportError:
        yield False
        return
    patches = {"_ignore_causal_mask_sdpa": _causal_skip, "_ignore_bidirectional_mask_sdpa": _bidirectional_skip}
    if "position_ids" not in inputs.kwargs:
        patches["find_packed_sequence_indices"] = lambda _original: lambda position_ids: None
    originals = {name: getattr(masking_utils, name) for name in patches if hasattr(masking_utils, name)}
    if len(originals) < len(patches):
        yield False
        return
    try:
        for name, make in patches.items():
            setattr(masking_utils, name, make(originals[name]))
        # without a mask, SDPA would get fewer key/value heads (enable_gqa); the trace keeps them repeated
        with repeated_kv_heads() as repeated:
            yield repeated
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)


@contextlib.contextmanager
def repeated_kv_heads() -> Iterator[bool]:
    """HuggingFace's SDPA integration repeats grouped-query attention's key/value heads (``repeat_kv``) as it does
    beside a mask, instead of handing attention fewer of them (``enable_gqa``).  The planner's trace and the
    runtime's tensor-parallel attention regions (``autopar.runtime.region_graph``) both take this path: it splits
    the heads evenly over tp whatever their number, also where tp exceeds the key/value heads.  Yields whether it
    could (this transformers has the switch)."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        yield False
        return
    saved = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if saved is None:
        yield False
        return
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False
    try:
        yield True
    finally:
        sdpa_attention.use_gqa_in_sdpa = saved


#: ``repeat_kv``'s ops, last first: ``x[:, :, None]`` (``unsqueeze``), ``expand`` to ``n_rep`` copies, ``reshape``
_REPEAT_CHAIN = ("aten.reshape.default", "aten.expand.default", "aten.unsqueeze.default")


def _repeated_source(graph: OpGraph, ref: object, users: dict[str, list[str]]) -> tuple[Ref, list[str]] | None:
    """The tensor ``repeat_kv`` repeated into ``ref`` (``[b, kv, s, d]`` into ``[b, kv * n_rep, s, d]``) and its ops,
    where they feed nothing else; None where ``ref`` is not such a repeat."""
    if not isinstance(ref, Ref):
        return None
    chain: list[str] = []
    node: Node = graph[ref.name]
    for op in _REPEAT_CHAIN:
        if node.kind != "op" or node.op != op or len(users[node.name]) != 1 or not node.args:
            return None
        chain.append(node.name)
        if op == "aten.unsqueeze.default" and node.args[1:2] != (2,):
            return None
        src = node.args[0]
        if not isinstance(src, Ref):
            return None
        node = graph[src.name]
    source = graph.tensor(src)
    repeated = graph.tensor(ref)
    if source is None or repeated is None or len(source.shape) != 4 or len(repeated.shape) != 4:
        return None
    b, kv, s, d = source.shape
    if repeated.shape[0] != b or repeated.shape[2:] != (s, d) or repeated.shape[1] % kv:
        return None
    return src, chain


def _takes_fewer_heads(key_shape: tuple[int, ...], value_shape: tuple[int, ...]) -> bool:
    """HuggingFace's own answer (``use_gqa_in_sdpa``) for attention without a mask on keys and values of these
    shapes: whether it hands SDPA the fewer key/value heads."""
    from transformers.integrations import sdpa_attention

    meta = [torch.empty(shape, device="meta") for shape in (key_shape, value_shape)]
    return bool(sdpa_attention.use_gqa_in_sdpa(None, *meta))


def kv_heads_as_run(graph: OpGraph) -> OpGraph | None:
    """``graph`` (traced with ``repeats_kv_heads``) as HuggingFace runs it without tensor-parallel regions: every
    attention without a mask whose keys and values ``repeat_kv`` made, and which HuggingFace would hand the fewer
    heads, reads the unrepeated ones with ``enable_gqa`` and the repeats are gone.  The copy is not annotated (run
    the passes on it).  None where nothing changes."""
    if not graph.repeats_kv_heads:
        return None
    users = graph.users()
    rewired: dict[str, tuple[Ref, Ref]] = {}
    dropped: set[str] = set()
    for node in graph.ops():
        if node.op != "aten.scaled_dot_product_attention.default" or len(node.args) < 3:
            continue
        if attention_mask(node) is not None:
            continue
        found = [_repeated_source(graph, node.args[i], users) for i in (1, 2)]
        if found[0] is None or found[1] is None:
            continue
        (k, k_ops), (v, v_ops) = found
        if not _takes_fewer_heads(graph.tensor(k).shape, graph.tensor(v).shape):
            continue
        rewired[node.name] = (k, v)
        dropped.update(k_ops, v_ops)
    if not rewired:
        return None
    out = graph.copy()
    nodes = []
    for node in out.nodes:
        if node.name in dropped:
            continue
        if node.name in rewired:
            node.args = (node.args[0], *rewired[node.name], *node.args[3:])
            node.kwargs = {**node.kwargs, "enable_gqa": True}
            node._tensor_refs = None
        nodes.append(node)
    return dataclasses.replace(out, nodes=nodes, annotations={}, repeats_kv_heads=False, _users=None,
                               _fingerprint="", _derived={}, _compute_itemsize=0)


__all__ = ["is_transformers_model", "is_transformers_object", "kv_heads_as_run", "masks_as_run",
           "repeated_kv_heads"]
