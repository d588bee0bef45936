"""Trace a model and its loss into an ``OpGraph`` with ``torch.export`` on fake tensors.

Route: the model is built (or already lives) under ``FakeTensorMode`` so no real memory is used, then
``torch.export.export(strict=False)`` traces ``loss_fn(model(*args, **kwargs), *args, **kwargs)`` (the model
file's inputs, ``autopar.inputs.ModelInputs``) into an aten graph
(the pre-dispatch training IR: ``aten.linear``, ``aten.scaled_dot_product_attention``, ...).

Backward: **derived per op**, not traced.  Only the forward graph is exported (joint-graph export costs
about 3x the time and is what made a 7B model miss the 10 s budget); the cost passes derive each op's
backward FLOPs, bytes and saved tensors from the forward op (``passes/flops.py``, ``passes/activations.py``).

Batch: inputs are re-made with a *sentinel* batch size, a prime no model dimension is a multiple of.
Every traced dimension that is a multiple of it scales with the batch, which lets the IR store shapes
per sample (``TensorInfo.batch_dim``) and lets one trace serve every micro-batch size.

Depth: export costs about 0.1 s per layer.  When every block of the layer stack is the same module
(class, parameter and buffer shapes, and every plain attribute but the layer's own index), only the
first ``TRACED_LAYERS`` blocks are exported and the graph is then extended to the whole stack by
repeating the last traced block, wired to its predecessor exactly as the traced block is wired to its
own (``_repeat_layers`` checks that, and a full export is made when it does not hold).  The result has
the node order, shapes, parameters and structural hashes of a full trace (only node names differ).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import operator
import os
import re
import sysconfig
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autopar.batch_loss import gathering_over
from autopar.errors import TraceError
from autopar.fused_kernels import traced_as_fused_kernels
from autopar.hf_masks import masks_as_run
from autopar.inputs import ModelInputs
from autopar.ir import (
    PERMUTING_VIEW_OPS,
    VIEW_IF_CONTIGUOUS_OPS,
    VIEW_OPS,
    BatchScaled,
    LayerInfo,
    Node,
    OpGraph,
    ParamInfo,
    Ref,
    TensorInfo,
    iter_refs,
    structural_hash,
)

LossFn = Callable[..., torch.Tensor]

#: Dtype conversions, which return their input unchanged when it already has the target dtype.
CONVERSION_OPS = frozenset({"aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.type_as.default",
                            "aten._to_copy.default"})

#: Blocks exported when the stack is repeated (the last is the template, the one before it checks its wiring).
TRACED_LAYERS = 3

#: Candidate sentinel batch sizes (primes); the first that divides no model dimension is used.
SENTINEL_BATCHES = (1009, 1013, 1019, 1021, 1031)


#: ``cross_entropy``'s default ``ignore_index``: the label of the last position, which has no next token.
IGNORE_INDEX = -100


def default_loss_fn(output: Any, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of logits ``[b, s, vocab]`` against the token ids, the first input (positional,
    else keyword), averaged over the ``b * (s - 1)`` positions that have a next token.

    The labels are shifted, not the logits (as Megatron-LM's and torchtitan's data, llm-foundry's rolled labels and
    HuggingFace's ``ForCausalLMLoss`` do): the loss reads the logits as the head wrote them, where slicing off their
    last position would copy all of them, forward and backward.  ``output`` may be a tensor or a HuggingFace
    ``ModelOutput`` (its ``logits`` are used).
    """
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    ids = ModelInputs(inputs, named).first
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


class LossWrapper(nn.Module):
    """``forward(*args, **kwargs) = loss_fn(model(*args, **kwargs), *args, **kwargs)``; the model is the ``model``
    child."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn or default_loss_fn

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*args, **kwargs), *args, **kwargs)


def trace(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | ModelInputs,
    loss_fn: LossFn | None = None,
    repeat_identical_layers: bool = True,
    tokens: int | None = None,
) -> OpGraph:
    """Trace ``loss_fn(model(*args, **kwargs), *args, **kwargs)`` into an ``OpGraph``.

    ``example_inputs`` (positional, or a ``ModelInputs`` with keyword ones) give dtype and per-sample shape;
    dim 0 of every tensor input is the batch.
    The model is traced in training mode.  Build it under ``FakeTensorMode`` to trace a model that
    does not fit in memory (``autopar.modelfile.load_model`` does).  ``repeat_identical_layers``: export
    a few blocks of an identical stack and repeat them (the module docstring says when); ``False``
    exports every block.  ``tokens``: the sequence length when no input is ``[batch, seq]`` token ids (a
    model that patchifies images states its own), else 1.
    """
    t0 = time.perf_counter()
    example_inputs = ModelInputs.of(example_inputs)
    fake_mode = _fake_mode_of(model) or FakeTensorMode(allow_non_fake_inputs=True)
    forbidden = _model_dims(model, example_inputs.tensors())
    sentinel = next((p for p in SENTINEL_BATCHES if not any(d % p == 0 for d in forbidden)), None)
    if sentinel is None:
        raise TraceError("could not find a sentinel batch size that divides no model dimension")
    inputs = _rebatch_inputs(example_inputs, sentinel, fake_mode)
    seq_len = _seq_len_of(example_inputs.tensors()) or tokens or 1
    container = _find_layer_container(model)
    graph = None
    stacks = ([container] if container else []) + _stacks_beside(model, container)
    # does the loss compare the batch's samples (autopar.gather_batch)?  Fused kernels as one op each
    # (HuggingFace models: their attention masks as a training run builds them, autopar.hf_masks)
    with gathering_over(None) as gathers, traced_as_fused_kernels(), masks_as_run(model, example_inputs) as repeats:
        if repeat_identical_layers and _identical_blocks(model, container):
            with _truncated_stack(model, container, TRACED_LAYERS), _layer_calls(model, stacks) as calls:
                ep = _export(model, inputs, loss_fn)
            graph = _repeat_layers(_to_opgraph(ep, model, sentinel, seq_len), container,
                                   len(list(model.get_submodule(container).children())))
        if graph is None:
            with _layer_calls(model, stacks) as calls:
                ep = _export(model, inputs, loss_fn)
            graph = _to_opgraph(ep, model, sentinel, seq_len)
    graph.loss_gathers_batch = bool(gathers)
    graph.repeats_kv_heads = repeats
    graph.layer_loop_args = _loop_args(calls.get(container or "", []))
    graph.stack_loop_args = {stack: args for stack in stacks[1:] if (args := _loop_args(calls.get(stack, [])))}
    graph.other_stacks = tuple(stacks[1:] if container else stacks)
    graph.trace_time_s = time.perf_counter() - t0
    return graph


@contextlib.contextmanager
def _layer_calls(model: nn.Module, containers: Sequence[str]) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """The arguments each stack's first two blocks are called with, by slot (a positional index as a string, or a
    keyword), as the export calls them: stack -> [first block's call, second block's call]."""
    calls: dict[str, list[dict[str, Any]]] = {}

    def record(stack: str, index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            mine = calls.setdefault(stack, [])
            if len(mine) == index:  # the first call of each (a model may call its layers again)
                mine.append({**{str(i): a for i, a in enumerate(args)}, **kwargs})
        return hook

    handles = []
    for stack in containers:
        blocks = list(model.get_submodule(stack).children())[:2]
        if len(blocks) == 2:
            handles += [block.register_forward_pre_hook(record(stack, i), with_kwargs=True)
                        for i, block in enumerate(blocks)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _stacks_beside(model: nn.Module, container: str | None) -> list[str]:
    """Stacks of blocks outside ``container`` (an encoder's beside the decoder's layers): module lists of two or
    more modules of one class, each with parameters."""
    found = []
    for name, module in model.named_modules():
        inside = container is not None and (name == container or name.startswith(container + "."))
        if inside or not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and all(
                next(c.parameters(), None) is not None for c in children):
            found.append(name)
    return found


def _loop_args(calls: list[dict[str, Any]]) -> tuple[str, ...]:
    """``OpGraph.layer_loop_args``: the slots the first layer gets as ``None`` (or not at all) and the second as a
    tensor with a gradient, which the stack's loop made from the layer before (never the hidden state, slot 0)."""
    if len(calls) < 2:
        return ()
    first, second = calls
    return tuple(slot for slot, value in second.items()
                 if slot not in ("0", "hidden_states") and first.get(slot) is None
                 and isinstance(value, torch.Tensor) and value.requires_grad)


def _sized_by(val: Any, sentinel: int) -> bool:
    """Whether a traced value has a dimension that is a multiple of the sentinel batch."""
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and any(int(d) and int(d) % sentinel == 0 for d in v.shape) for v in vals)


_RAISED_AT = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \w+\s*\n\s*(.+)')


def _model_source_line(exc: BaseException) -> str:
    """`` at FILE:LINE (`code`)``: the model's own line that torch.export stopped at, when it can be found (the
    call torch names in its message, else the innermost frame outside torch and autopar)."""
    found = _RAISED_AT.search(str(exc))
    if found:
        path, line, code = found.group(1), found.group(2), found.group(3).split("#")[0].strip()
        return f" at {path}:{line} ({code})"
    own = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parent) + os.sep)
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep

    def ours(name: str) -> bool:  # torch, autopar's own code (not its zoo models), the standard library
        if name.startswith("<") or (name.startswith(own) and f"{os.sep}models{os.sep}" not in name):
            return True
        return name.startswith(stdlib) and "site-packages" not in name and "dist-packages" not in name

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not ours(f.filename)]
    if frames:
        f = frames[-1]
        return f" at {f.filename}:{f.lineno} ({(f.line or '').strip()})"
    return ""


def _export(model: nn.Module, inputs: ModelInputs, loss_fn: LossFn | None) -> torch.export.ExportedProgram:
    wrapper = LossWrapper(model, loss_fn)
    was_training = model.training
    wrapper.train()
    try:
        with warnings.catch_warnings(), _quiet_torch_logs():
            warnings.simplefilter("ignore")
            return torch.export.export(wrapper, inputs.args, dict(inputs.kwargs), strict=False)
    except Exception as exc:  # torch.export raises many exception types; all mean "cannot trace"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = _model_source_line(exc)
        raise TraceError(f"torch.export could not trace the model{where}: {type(exc).__name__}: "
                         f"{first_line}") from exc
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs on failure; the error we raise says what went wrong."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _fake_mode_of(model: nn.Module) -> FakeTensorMode | None:
    for p in model.parameters():
        if isinstance(p, FakeTensor):
            return p.fake_mode
    return None


def _model_dims(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> set[int]:
    dims: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        dims.update(int(d) for d in t.shape if d > 1)
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            dims.update(int(d) for d in x.shape[1:] if d > 1)
    return dims


def _seq_len_of(example_inputs: Sequence[torch.Tensor]) -> int | None:
    """Tokens per sample: the length of the first ``[batch, seq]`` integer input, if any."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
            return int(x.shape[1])
    return None


def _rebatch_inputs(example_inputs: ModelInputs, batch: int, fake_mode: FakeTensorMode) -> ModelInputs:
    def rebatched(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise TraceError("example inputs must have a batch dimension (dim 0)")
        with fake_mode:
            return (torch.empty((batch, *x.shape[1:]), dtype=x.dtype).fill_(0) if x.is_floating_point()
                    else torch.zeros((batch, *x.shape[1:]), dtype=x.dtype))
    return example_inputs.map(rebatched)


# --------------------------------------------------------------------------------------------------
# torch.export graph -> OpGraph


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _strip_root(path: str) -> str:
    """Export paths are relative to the LossWrapper; drop its ``model.`` prefix."""
    if path == "model":
        return ""
    return path.removeprefix("model.")


def _find_layer_container(model: nn.Module) -> str | None:
    """The repeated block stack: a ModuleList/ModuleDict of >= 2 same-class children keyed 0..n-1.

    When several exist (experts inside blocks), the one holding the most parameters wins.
    """
    best, best_params = None, 0
    for name, mod in model.named_modules():
        children = list(mod.named_children())
        if len(children) < 2 or [c for c, _ in children] != [str(i) for i in range(len(children))]:
            continue
        if len({type(c) for _, c in children}) != 1:
            continue
        n_params = sum(p.numel() for p in mod.parameters())
        if n_params > best_params:
            best, best_params = name, n_params
    return best


def _layer_of(path: str, container: str | None) -> int | None:
    if container is None:
        return None
    prefix = container + "." if container else ""
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _param_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter FQN (tied ones included) -> the canonical FQN (first in registration order)."""
    canonical: dict[int, str] = {}
    out: dict[str, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        out[fqn] = canonical.setdefault(id(p), fqn)
    return out


def _to_opgraph(ep: torch.export.ExportedProgram, model: nn.Module, sentinel: int, seq_len: int) -> OpGraph:
    from torch.export.graph_signature import InputKind

    aliases = _param_aliases(model)
    trainable = {fqn: p.requires_grad for fqn, p in model.named_parameters(remove_duplicate=False)}
    container = _find_layer_container(model)
    spec_of = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}

    nodes: list[Node] = []
    # name -> (depends on a user input, depends on a parameter)
    flow: dict[str, tuple[bool, bool]] = {}
    # getitem nodes are folded into Refs with an index
    getitem: dict[str, Ref] = {}

    def convert(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return getitem.get(a.name, Ref(a.name))
        if isinstance(a, (list, tuple)):
            return type(a)(convert(x) for x in a)
        if isinstance(a, dict):
            return {k: convert(v) for k, v in a.items()}
        if isinstance(a, bool) or a is None or isinstance(a, (float, str)):
            return a
        if isinstance(a, int):
            return BatchScaled(a // sentinel) if a and a % sentinel == 0 else a
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(a)
        return repr(a)

    def tensor_info(val: Any, batch_dep: bool, grad: bool) -> TensorInfo | None:
        if not isinstance(val, torch.Tensor):
            return None
        shape = [int(d) for d in val.shape]
        batch_dim = None
        if batch_dep:
            batch_dim = next((i for i, d in enumerate(shape) if d and d % sentinel == 0), None)
            if batch_dim is not None:
                shape[batch_dim] //= sentinel
        return TensorInfo(tuple(shape), _dtype_name(val.dtype), batch_dim, grad and val.is_floating_point())

    for fx_node in ep.graph.nodes:
        name = fx_node.name
        val = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            spec = spec_of.get(name)
            kind = spec.kind if spec is not None else InputKind.USER_INPUT
            if kind == InputKind.PARAMETER:
                fqn = aliases.get(_strip_root(spec.target), _strip_root(spec.target))
                grad = trainable.get(_strip_root(spec.target), True)  # frozen (fine-tuning): no gradient
                nodes.append(Node(name, "param", "param", outputs=(tensor_info(val, False, grad),),
                                  target=fqn, params=(fqn,), layer=_layer_of(fqn, container)))
                flow[name] = (False, grad)
            elif kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                target = _strip_root(spec.target)
                k = "buffer" if kind == InputKind.BUFFER else "constant"
                nodes.append(Node(name, k, k, outputs=(tensor_info(val, False, False),), target=target,
                                  layer=_layer_of(target, container)))
                flow[name] = (False, False)
            else:
                nodes.append(Node(name, "input", "input", outputs=(tensor_info(val, True, False),), target=name))
                flow[name] = (True, False)
            continue
        if fx_node.op == "output":
            nodes.append(Node(name, "output", "output", args=convert(tuple(fx_node.args))))
            continue
        srcs = [a.name for a in fx_node.all_input_nodes]
        # batch-dependent: it reads a batch-dependent tensor, or it is sized by the batch (a mask expanded to
        # ``input_ids.shape[0]`` reads no input tensor, but the sentinel divides no model dimension)
        batch_dep = any(flow[s][0] for s in srcs) or _sized_by(val, sentinel)
        grad = any(flow[s][1] for s in srcs)
        flow[name] = (batch_dep, grad)
        if fx_node.target is operator.getitem:
            src, idx = fx_node.args
            getitem[name] = Ref(getitem.get(src.name, Ref(src.name)).name, int(idx))
            continue
        stack = fx_node.meta.get("nn_module_stack") or {}
        path, mtype = (list(stack.values())[-1] if stack else ("model", ""))
        module = _strip_root(str(path))
        vals = val if isinstance(val, (tuple, list)) else (val,)
        outputs = tuple(tensor_info(v, batch_dep, grad) for v in vals)
        args = convert(tuple(fx_node.args))
        kwargs = convert(dict(fx_node.kwargs))
        node = Node(name, "op", str(fx_node.target), args=args, kwargs=kwargs, outputs=outputs,
                    module=module, module_type=str(getattr(mtype, "__name__", mtype)).rsplit(".", 1)[-1],
                    layer=_layer_of(module, container), batch_scaled=batch_dep)
        alias = _alias_source(fx_node)
        node.alias_of = getitem[alias].name if alias in getitem else alias
        nodes.append(node)

    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if n.kind == "op":
            n.params = tuple(dict.fromkeys(by_name[r].target for r in n.inputs if by_name[r].kind == "param"))

    params = _param_table(nodes, aliases, container)
    layers = _layer_table(nodes, container, by_name)
    return OpGraph(nodes=nodes, params=params, layers=layers, layer_container=container, seq_len=seq_len)


def _alias_source(fx_node: torch.fx.Node) -> str | None:
    """The input whose storage a view op's output shares (activation memory is counted per storage)."""
    op = str(fx_node.target)
    src = next((a for a in fx_node.args if isinstance(a, torch.fx.Node)), None)
    if src is None:
        return None
    if op in VIEW_OPS:
        return src.name
    val = src.meta.get("val")
    if op in VIEW_IF_CONTIGUOUS_OPS and isinstance(val, torch.Tensor) and (val.is_contiguous()
                                                                          or _fused_attention_view(src)):
        return src.name
    out = fx_node.meta.get("val")
    if (op in CONVERSION_OPS and isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)
            and out.dtype == val.dtype and out.shape == val.shape and out.device == val.device):
        return src.name  # a conversion to the dtype it already has returns its input
    return None


def _fused_attention_view(fx_node: torch.fx.Node) -> bool:
    """Whether ``fx_node`` permutes an attention output that a fused kernel lays out so the permutation is
    contiguous.  PyTorch's flash and cuDNN kernels allocate the output like the query (``torch.empty_like(query)``,
    ``alloc_with_matching_layout``): a query handed in as a ``transpose(1, 2)`` of (batch, seq, heads, head_dim)
    gives an output whose ``transpose(1, 2)`` is contiguous.  The fake kernel the trace ran may be another (the CPU's
    math kernel under dropout returns a contiguous output), so the query decides.  Unfused attention, whose output
    is contiguous whatever the query, is ``autopar.passes.attention_layout``'s to undo."""
    permuted = False
    while str(fx_node.target) in VIEW_OPS:
        permuted = permuted or str(fx_node.target) in PERMUTING_VIEW_OPS
        fx_node = next((a for a in fx_node.args if isinstance(a, torch.fx.Node)), None)
        if fx_node is None:
            return False
    if not permuted or str(fx_node.target) != "aten.scaled_dot_product_attention.default":
        return False
    query = fx_node.args[0].meta.get("val") if isinstance(fx_node.args[0], torch.fx.Node) else None
    return isinstance(query, torch.Tensor) and query.dim() == 4 and query.transpose(1, 2).is_contiguous()


def _param_table(nodes: list[Node], aliases: dict[str, str], container: str | None) -> dict[str, ParamInfo]:
    others: dict[str, list[str]] = {}
    for fqn, canon in aliases.items():
        if fqn != canon:
            others.setdefault(canon, []).append(fqn)
    params = {}
    for n in nodes:
        if n.kind == "param":
            t = n.out
            params[n.target] = ParamInfo(n.target, t.shape, t.dtype, tuple(others.get(n.target, ())),
                                         _layer_of(n.target, container), trainable=t.requires_grad)
    return params


def _layer_table(nodes: list[Node], container: str | None, by_name: dict[str, Node]) -> list[LayerInfo]:
    """Group op nodes by layer index and hash each layer's structure (ops, shapes, relative wiring)."""
    if container is None:
        return []
    members: dict[int, list[Node]] = {}
    for n in nodes:
        if n.kind == "op" and n.layer is not None:
            members.setdefault(n.layer, []).append(n)
    layers = []
    for idx in sorted(members):
        my_prefix = f"{container}.{idx}" if container else str(idx)
        layers.append(LayerInfo(idx, my_prefix, structural_hash(members[idx], my_prefix, by_name)))
    return layers



# --------------------------------------------------------------------------------------------------
# Depth: export a few identical blocks, then repeat them

#: Attributes that hold a block's own position in the stack, the one way identical blocks may differ.
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index"})
_STACK_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _module_signature(block: nn.Module) -> tuple:
    """Everything about a block that can change what it computes, its own index aside."""
    sig = []
    for name, mod in block.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(mod).items()
                             if not k.startswith("_") and k not in _INDEX_ATTRS and k != "training" and _plain(v)))
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in mod.named_parameters(recurse=False))
        buffers = tuple((k, tuple(b.shape), b.dtype) for k, b in mod.named_buffers(recurse=False))
        sig.append((name, type(mod).__qualname__, attrs, params, buffers))
    return tuple(sig)


def _identical_blocks(model: nn.Module, container: str | None) -> bool:
    """Whether the stack is long enough to shorten and every block in it is the same module."""
    if container is None:
        return False
    stack = model.get_submodule(container)
    blocks = list(stack.children())
    if not isinstance(stack, _STACK_TYPES) or len(blocks) <= TRACED_LAYERS:
        return False
    first = _module_signature(blocks[0])
    return all(_module_signature(b) == first for b in blocks[1:])


@contextlib.contextmanager
def _truncated_stack(model: nn.Module, container: str, keep: int) -> Iterator[None]:
    """Swap the block stack for one holding its first ``keep`` blocks (the same module objects)."""
    parent_name, _, attr = container.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    full = getattr(parent, attr)
    if isinstance(full, nn.ModuleDict):
        short: nn.Module = nn.ModuleDict({k: full[k] for k in list(full.keys())[:keep]})
    elif isinstance(full, nn.Sequential):
        short = nn.Sequential(*list(full.children())[:keep])
    else:
        short = nn.ModuleList(list(full.children())[:keep])
    setattr(parent, attr, short)
    try:
        yield
    finally:
        setattr(parent, attr, full)


def _block_prefix(container: str, index: int) -> str:
    return f"{container}.{index}" if container else str(index)


def _renamed(path: str, old: str, new: str) -> str:
    if path == old:
        return new
    return new + path[len(old):] if path.startswith(old + ".") else path


def _repeat_layers(graph: OpGraph, container: str, total: int) -> OpGraph | None:
    """Extend a graph of the first ``TRACED_LAYERS`` blocks to ``total`` blocks; ``None`` when the last
    traced block is not wired to its predecessor as that one is to its own (then trace in full)."""
    last = TRACED_LAYERS - 1
    by_layer: dict[int, list[Node]] = {}
    for n in graph.nodes:
        if n.layer is not None:
            by_layer.setdefault(n.layer, []).append(n)
    if sorted(by_layer) != list(range(TRACED_LAYERS)):
        return None
    hashes = {layer.index: layer.structural_hash for layer in graph.layers}
    if hashes.get(last) != hashes.get(last - 1):
        return None
    position = {n.name: (n.layer, i) for layer, ns in by_layer.items() for i, n in enumerate(ns)}

    def wiring(n: Node) -> tuple:
        """How ``n`` reads its inputs, relative to its own block."""
        def where(name: str) -> tuple:
            if name not in position:
                return ("outside", name)
            layer, i = position[name]
            return ("self" if layer == n.layer else "prev" if layer == n.layer - 1 else "far", i)

        refs = tuple((where(r.name), r.index) for r in iter_refs((n.args, n.kwargs)))
        return (refs, where(n.alias_of) if n.alias_of else None)

    template, previous = by_layer[last], by_layer[last - 1]
    if len(template) != len(previous):
        return None
    for a, b in zip(template, previous):
        if a.kind != b.kind or a.op != b.op or wiring(a) != wiring(b) or any(w[0][0] == "far" for w in wiring(a)[0]):
            return None
    for n in graph.nodes:
        if n.layer is None and any(position.get(r, (last,))[0] != last for r in n.inputs):
            return None  # something after the stack reads a block other than the last one

    old_prefix = _block_prefix(container, last)
    names = [{n.name: n.name for n in template}]  # names[k - last]: template node -> its copy in block k
    copies: dict[int, list[Node]] = {last: template}
    for k in range(last + 1, total):
        prev_names, mine = names[-1], {n.name: f"{n.name}__b{k}" for n in template}
        names.append(mine)
        prefix = _block_prefix(container, k)

        def remap(name: str, mine: dict[str, str] = mine, prev_names: dict[str, str] = prev_names) -> str:
            if name in mine:
                return mine[name]
            if position.get(name, (None,))[0] == last - 1:  # the previous block: its copy in block k - 1
                return prev_names[template[position[name][1]].name]
            return name

        copies[k] = [_copy_node(n, k, remap, old_prefix, prefix) for n in template]
    final = names[-1]
    out: list[Node] = []
    last_of_kind = {n.kind: i for i, n in enumerate(graph.nodes) if n.layer == last}
    for i, n in enumerate(graph.nodes):
        if n.layer is None and n.kind in ("op", "output"):
            n = dataclasses.replace(n, args=_remap_refs(n.args, final.get), kwargs=_remap_refs(n.kwargs, final.get),
                                    alias_of=final.get(n.alias_of, n.alias_of), annotations={})
        out.append(n)
        if last_of_kind.get(n.kind) == i:
            for k in range(last + 1, total):
                out.extend(c for c in copies[k] if c.kind == n.kind)
    by_name = {n.name: n for n in out}
    params = _param_table(out, {}, container)
    for fqn, info in graph.params.items():  # keep the aliases of tied parameters found by the trace
        if fqn in params:
            params[fqn] = info
    return OpGraph(nodes=out, params=params, layers=_layer_table(out, container, by_name), layer_container=container,
                   seq_len=graph.seq_len)


def _remap_refs(obj: Any, rename: Callable[[str], str | None]) -> Any:
    if isinstance(obj, Ref):
        new = rename(obj.name)
        return Ref(new, obj.index) if new else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_remap_refs(x, rename) for x in obj)
    if isinstance(obj, dict):
        return {k: _remap_refs(v, rename) for k, v in obj.items()}
    return obj


def _copy_node(n: Node, k: int, remap: Callable[[str], str], old_prefix: str, prefix: str) -> Node:
    """Node ``n`` of the template block as it appears in block ``k``."""
    return dataclasses.replace(
        n, name=remap(n.name), args=_remap_refs(n.args, remap), kwargs=_remap_refs(n.kwargs, remap),
        module=_renamed(n.module, old_prefix, prefix), params=tuple(_renamed(p, old_prefix, prefix) for p in n.params),
        target=_renamed(n.target, old_prefix, prefix) if n.kind in ("param", "buffer", "constant") else n.target,
        layer=k, alias_of=remap(n.alias_of) if n.alias_of else None, annotations={})
