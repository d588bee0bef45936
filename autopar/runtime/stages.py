"""Pipeline stages from a plan: this rank's copy of the model, pruned to its layers, and how it runs.

Stages are built the way torchtitan builds them: every rank builds the whole model on the meta device
(no memory), once per chunk it runs, and drops what the chunk does not own. Blocks outside the stage's
layer range leave the block stack (a ``ModuleList`` becomes a ``ModuleDict`` keyed by the original
indices, so parameter FQNs survive the split). Along the path to the stack, modules with parameters
registered before it (embeddings) stay on the first stage only, those after it (final norm, head) on the
last only; parameter-free modules (dropout, rotary tables) stay everywhere. With several chunks per rank
the layers are cut into chunks the plan lists, placed on ranks by the schedule's stage-to-rank mapping
(``autopar.runtime.pipeline``).

How a stage runs:

- models of the zoo run their own ``forward``, which takes hidden states when the embedding is missing
  and skips a missing norm or head;
- HuggingFace decoders, whatever the architecture, run their own ``forward`` too (``hf_stage``): the
  stage's layers in a stack that iterates like the ``ModuleList`` it replaces, parameter-free
  placeholders for the embeddings of later stages (the first layer takes the stage's input instead) and
  for the final norm and head of earlier ones (where the stage ends with its hidden states); of an
  encoder-decoder, the encoder's blocks then the decoder's layers, the stage that ends the encoder handing
  its output on to the later ones (with whatever a stack's loop passes from block to block: T5's position
  bias).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from autopar.errors import AutoparError
from autopar.hf_masks import is_transformers_object
from autopar.plan_file import Plan


def layer_chunks(num_layers: int, pp: int, v: int) -> list[tuple[int, int]]:
    """Layer ranges of the ``pp * v`` chunks (as even as possible, earlier chunks one longer)."""
    n = pp * v
    base, extra = divmod(num_layers, n)
    out, start = [], 0
    for j in range(n):
        size = base + (1 if j < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def stage_layer_ranges(plan: Plan) -> list[tuple[int, int]]:
    """Layer range of every chunk, in pipeline order (the plan's stages when ``v == 1``)."""
    lay = plan.layout
    if lay["v"] == 1:
        return [tuple(s["layers"]) for s in plan.stages]
    if "chunks" in plan.schedule:
        return [tuple(c) for c in plan.schedule["chunks"]]
    return layer_chunks(plan.model["num_layers"], lay["pp"], lay["v"])


def is_huggingface(model: nn.Module) -> bool:
    return is_transformers_object(model)


def wrapped_model(model: nn.Module) -> nn.Module:
    """The HuggingFace model a PEFT model wraps (``get_base_model``, whose forward the wrapper's passes its
    inputs on to), else ``model`` itself."""
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else None
    return inner if isinstance(inner, nn.Module) else model


def _block_dict(stage: nn.Module, container: str) -> nn.ModuleDict:
    """The block stack as a ``ModuleDict`` keyed by layer index (a ``ModuleList`` is converted in place)."""
    blocks = stage.get_submodule(container)
    if isinstance(blocks, nn.ModuleList):
        owner, _, attr = container.rpartition(".")
        blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        setattr(stage.get_submodule(owner) if owner else stage, attr, blocks)
    if not isinstance(blocks, nn.ModuleDict):
        raise AutoparError(f"pipeline stages need the block stack {container!r} to be a ModuleDict or "
                           f"ModuleList; it is a {type(blocks).__name__}")
    return blocks


def _drop_ends(stage: nn.Module, container: str, first: bool, last: bool) -> None:
    """Remove the parameterized modules before the stack (unless first) and after it (unless last)."""
    parent = stage
    for name in container.split("."):
        names = [n for n, _ in parent.named_children()]
        i = names.index(name)
        for other in (names[:i] if not first else []) + (names[i + 1:] if not last else []):
            if next(getattr(parent, other).parameters(), None) is not None:
                setattr(parent, other, None)
        parent = getattr(parent, name)


class StageLayers(nn.ModuleDict):
    """A HuggingFace decoder's layers on one pipeline stage, keyed by their original indices (so FQNs survive),
    iterated, indexed and sliced like the ``ModuleList`` they replace: the decoder's own loop
    (``for layer in self.layers[:n]``) runs just these.  ``inject``: the stage's input, handed to its first
    layer in place of what the (placeholder) embeddings made, with ``inject_slots``: what the loop hands from
    layer to layer (``OpGraph.layer_loop_args``), as the stage received it.  ``probe``: on a stage before
    another, ``_LoopProbe`` stands in for the next stage's first layer and ends the stage with what the loop
    would pass it."""

    inject: torch.Tensor | None = None
    inject_slots: dict[str, torch.Tensor] | None = None
    probe: _LoopProbe | None = None

    def _layers(self) -> list[nn.Module]:
        layers = list(self.values())
        if self.inject is not None and layers:
            layers[0] = _Injected(layers[0], self.inject, self.inject_slots or {})
        if self.probe is not None and layers:
            self.probe.last = layers[-1]
            layers.append(self.probe)
        return layers

    def __iter__(self):
        return iter(self._layers())

    def __getitem__(self, index):
        if isinstance(index, (int, slice)):
            return self._layers()[index]
        return super().__getitem__(index)


class _Injected:
    """A layer called with the stage's input as its hidden states (its first argument), so that activation
    checkpointing saves and recomputes from that input, and with what the stage received of the arguments the
    stack's loop hands from layer to layer (``slots``: positional index or keyword -> tensor); attributes are the
    layer's."""

    def __init__(self, layer: nn.Module, hidden: torch.Tensor, slots: Mapping[str, torch.Tensor]) -> None:
        self._layer, self._hidden, self._slots = layer, hidden, slots

    def __call__(self, *args: object, **kwargs: object) -> object:
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": self._hidden}
        else:
            args = (self._hidden, *args[1:])
        args, kwargs = _filled(args, kwargs, self._slots)
        return self._layer(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._layer, name)


def _filled(args: tuple, kwargs: dict[str, object], slots: Mapping[str, torch.Tensor]
            ) -> tuple[tuple, dict[str, object]]:
    """``args`` and ``kwargs`` with ``slots`` (positional index or keyword -> value) put in."""
    listed, named = list(args), dict(kwargs)
    for slot, value in slots.items():
        if not slot.isdigit():
            named[slot] = value
        elif int(slot) < len(listed):
            listed[int(slot)] = value
        else:
            raise AutoparError(f"the layer stack's loop calls its layers with {len(listed)} positional arguments; "
                               f"the plan's stages hand on argument {slot}: plan again with --fix pp=1")
    return tuple(listed), named


class _LoopProbe:
    """Where the next stage's first layer would run: takes what the stack's loop passes it and ends the stage
    with the hidden state and the loop's ``slots`` (``OpGraph.layer_loop_args``); attributes are the stage's last
    layer's (a loop may read a layer's type before calling it)."""

    def __init__(self, slots: list[str]) -> None:
        self.slots, self.last = slots, None

    def __call__(self, *args: object, **kwargs: object) -> object:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        values = [kwargs[s] if s in kwargs else args[int(s)] if s.isdigit() and int(s) < len(args) else None
                  for s in self.slots]
        if not all(isinstance(v, torch.Tensor) for v in values):
            missing = [s for s, v in zip(self.slots, values, strict=True) if not isinstance(v, torch.Tensor)]
            raise AutoparError(f"the layer stack's loop passes no tensor in argument {missing[0]} to its next layer, "
                               "which the plan's stages hand on: plan again with --fix pp=1")
        raise _StageEnd(hidden, values)

    def __getattr__(self, name: str) -> object:
        last = self.__dict__.get("last")
        if last is None or name.startswith("__"):  # copying and pickling find no dunders here
            raise AttributeError(name)
        return getattr(last, name)


#: The keyword under which every stage of a model that reads images first (not token ids) gets the micro-batch's
#: first input too: a later stage runs the model's own forward on it, its embeddings placeholders.
FIRST_INPUT_KWARG = "_autopar_first_input"


class _StageEnd(Exception):
    def __init__(self, hidden: torch.Tensor, loop: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.hidden, self.loop = hidden, loop


class _Placeholder(nn.Module):
    """A decoder module this stage does not hold, without parameters.  Before the layers (embeddings on a
    later stage) it returns zeros shaped as the module's output (found by running it on the meta device),
    which the first layer then ignores; after them (final norm, head on an earlier stage) the decoder's
    forward never gets past it: it ends the stage with its input, the last layer's output."""

    def __init__(self, module: nn.Module, before: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_shape", copy.deepcopy(module).to("meta") if before else None)
        self.dtype = torch.float32  # the stage input's (set by the stage forward)
        self.carried: list[torch.Tensor] | None = None  # a carried module's outputs, as the stage received them

    def __getattr__(self, name: str) -> object:
        """Attributes of the module it stands in for (ViT's forward reads its patch embedding's weight dtype)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            shape = self.__dict__.get("_shape")
            if shape is None:
                raise
            return getattr(shape, name)

    def forward(self, *args: object, **kwargs: object) -> object:
        if self._shape is None:
            raise _StageEnd(args[0] if args else next(iter(kwargs.values())))
        device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        shaped = self._shape(*meta_args, **meta_kwargs)
        if self.carried is not None:  # what the first stage's module made, handed on: in its output's structure
            received = iter(self.carried)
            return tree_map_only(torch.Tensor, lambda t: next(received), shaped)
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(
            t.shape, device=device, dtype=self.dtype if t.is_floating_point() else t.dtype), shaped)


class _JoinedToInput(torch.autograd.Function):
    """``output`` (copied), joined in the autograd graph to the stage's input ``anchor``, to which it passes no
    gradient.  torch's split backward (the zero-bubble schedules' input step, ``stage_backward_input``) finds a
    stage's weights only where their autograd path meets the path from the stage's inputs: an output made from
    weights and token ids alone (an encoder-decoder's decoder embedding, on the stage that ends the encoder) would
    get its gradient from the next stage and pass it to no weight.  The join is the meeting point; a copy, as a
    view would refuse the split backward's in-place detach of the outputs."""

    @staticmethod
    def forward(ctx: object, output: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return output.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@dataclass(frozen=True, slots=True)
class _StackSpan:
    """One stack of a stage's chain: its module path, its first layer's position in the chain, its blocks, what
    its loop hands from block to block, and the blocks ``[lo, hi)`` of it the stage holds."""

    container: str
    offset: int
    size: int
    loop: tuple[str, ...]
    lo: int
    hi: int


def _stack_spans(container: str, lo: int, hi: int, ends: Mapping[str, object]) -> list[_StackSpan]:
    """The stacks a stage's layers ``[lo, hi)`` run over: the plan's ``stack_ends["stacks"]`` (an encoder's, then
    the decoder's), else the one stack ``container``."""
    stacks = ends.get("stacks") or [{"container": container, "layers": None, "layer_args": ends.get("layer_args", ())}]
    spans, offset = [], 0
    for stack in stacks:
        size = stack["layers"]
        spans.append(_StackSpan(stack["container"], offset, size, tuple(stack.get("layer_args", ())),
                                max(lo - offset, 0), hi - offset if size is None else min(hi - offset, size)))
        offset += size or 0
    return spans


def _cut_stack(model: nn.Module, span: _StackSpan) -> tuple[StageLayers, int]:
    """Swap ``span``'s stack for the blocks the stage holds; returns them and the stack's length."""
    owner_name, _, attr = span.container.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    stack = list(getattr(owner, attr))
    kept = {str(i): layer for i, layer in enumerate(stack) if span.lo <= i < span.hi}
    layers = StageLayers(kept)
    setattr(owner, attr, layers)
    config = getattr(owner, "config", None)
    if getattr(config, "layer_types", None) and not isinstance(getattr(type(config), "layer_types", None), property):
        # the loop looks a layer's type up by its position in the stack (Mamba's config derives it: no setter)
        owner.config = copy.copy(config)
        owner.config.layer_types = [config.layer_types[int(i)] for i in kept]
    return layers, len(stack)


def hf_stage(model: nn.Module, container: str, lo: int, hi: int, first: bool, last: bool,
             ends: Mapping[str, list[str]] | None) -> nn.Module:
    """A HuggingFace model cut down to layers ``[lo, hi)``, running its own ``forward``: the other layers
    leave the stack; the embeddings of a later stage and the final norm and head of an earlier one become
    parameter-free placeholders.  A later stage takes hidden states (token ids of their shape drive the
    positions and masks, as in the whole model; a model that reads images first gets the micro-batch's images,
    ``FIRST_INPUT_KWARG``) and hands them to its first layer; an earlier one stops at
    the final norm and returns what it was about to normalize.  Every stage takes the model's other inputs
    by keyword (``attention_mask=...``); the last returns the logits and records the model's output type.
    No per-architecture code: whatever the model does around its layers (masks, rotary or learned
    positions, ALiBi, scaling) it does itself.
    What it needs: the hidden states are all the layers carry from the embeddings, but for the outputs of one
    module run before the stack (an encoder, ``ends["carried"]``): the stage that makes them hands them on beside
    its hidden states, and later stages take them, passed on, in place of that module; and for what a stack's
    loop hands from layer to layer (``layer_args``: T5's position bias), which a stage ending before the stack's
    last layer sends as its loop would pass it to the next layer (``_LoopProbe``), and a stage starting after the
    stack's first layer puts into its first layer's call.  An encoder-decoder's layers run over both stacks
    (``ends["stacks"]``, ``autopar.inter_op.units``): the encoder's blocks, then the decoder's; what runs between
    them (``ends["between"]``: the encoder's final norm, the decoder's embedding) runs on the stage that ends the
    encoder, which hands on the decoder's embedded input beside the encoder's output (made there).  Anything else
    the later layers read from earlier stages is refused at plan time
    (``autopar.inter_op.pipelining.pipeline_carry``)."""
    if ends is None:
        raise AutoparError("this plan does not say which modules run before and after the layers "
                           "(model.stack_ends, written since plan schema 3): plan it again")
    spans = _stack_spans(container, lo, hi, ends)
    cut = [_cut_stack(model, span) for span in spans]
    sizes = [n for _, n in cut]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    # the stack the stage starts in (its input goes to that stack's first layer here) and the one it ends in
    start = max((i for i in range(len(spans)) if offsets[i] <= lo), default=0)
    end = max((i for i in range(len(spans)) if offsets[i] < hi), default=0)
    # the modules around the stacks, by segment: before the first, between two, after the last; each runs on the
    # stage that holds that point of the chain, else is a placeholder (zeros before the stage, its end after it)
    segments = [ends.get("before", []), *([ends.get("between", [])] * (len(spans) - 1)), ends.get("after", [])]
    holds = [first, *(lo < offsets[k] <= hi for k in range(1, len(spans))), last]
    # parameters of the model itself (CLIP's temperature) stay on the stage that reads them: elsewhere an unused
    # copy would go stale, and a checkpoint would hold two of one name
    for fqn in [*(ends.get("params_before", []) if not first else []), *(ends.get("params_after", []) if not last
                                                                          else [])]:
        owner_name, _, name = fqn.rpartition(".")
        del model.get_submodule(owner_name)._parameters[name]
    carried_names = list(ends.get("carried", ()))
    if len(spans) > 1:  # the encoder's output is made on the stage that ends the encoder, taken by every later one
        makes, takes = lo < offsets[1] <= hi, lo >= offsets[1]
    else:  # the carried module runs before the stack: made on the first stage
        makes, takes = first, not first
    makes, takes = makes and bool(carried_names), takes and bool(carried_names)
    # what a stack's loop hands from block to block crosses the cuts inside that stack: a chunk takes it where it
    # starts after the stack's first block, and hands it on where it ends before the stack's last
    takes_loop = list(spans[start].loop) if 0 < lo - offsets[start] < sizes[start] else []
    sends_loop = bool(spans[end].loop) and 0 < hi - offsets[end] < sizes[end]
    probe_layers = cut[end][0]
    # a stage ending inside an encoder stops where its next block would run (the rest of the forward would go on to
    # the decoder), as one whose loop hands on more than the hidden state
    ends_early = end < len(spans) - 1 and hi - offsets[end] < sizes[end]
    if (sends_loop or ends_early) and len(probe_layers):
        probe_layers.probe = _LoopProbe(list(spans[end].loop) if sends_loop else [])
    hands_on = (makes and not last) or takes or sends_loop  # more than the hidden state
    captured: list[torch.Tensor] = []  # where the carried modules run: their outputs, to hand on
    if makes and not last:
        for fqn in carried_names:
            model.get_submodule(fqn).register_forward_hook(
                lambda _module, _args, output: captured.extend(
                    t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)))
    placeholders = []
    carriers: list[_Placeholder] = []  # later stages: the carried modules, taking what the stage received
    if takes:
        for fqn in carried_names:
            parent, name = _parent_of(model, fqn)
            carriers.append(_Placeholder(getattr(parent, name), True))
            setattr(parent, name, carriers[-1])
    for k, segment in enumerate(segments):
        if holds[k]:
            continue
        at = offsets[k] if k < len(spans) else total  # where the segment runs in the chain
        # a carried module already stands in for what it holds
        names = [m for m in segment if not (takes and any(m == c or m.startswith(c + ".") for c in carried_names))]
        for parent, name in _owned(model, names):
            placeholders.append(_Placeholder(getattr(parent, name), at <= lo))  # before the stage: zeros
            setattr(parent, name, placeholders[-1])
    called = [*carried_names, *(m for segment in segments for m in segment)]
    _drop_unused_ties(model, [span.container for span in spans], called)
    entry = cut[start][0]
    holds_between = any(holds[1:len(spans)])
    empty = not any(len(layers) for layers, _ in cut)
    cls_forward = type(model).forward
    # what the model reads first, token ids or images (a PEFT model's: the model it wraps, which gets its inputs)
    params = list(inspect.signature(type(wrapped_model(model)).forward).parameters.values())[1:]
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    lead = params[0].name if params and params[0].kind in by_name else "input_ids"
    # no KV cache in training (a PEFT model passes it on through **kwargs); an image model may take no such key
    takes_cache = any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    cache = {"use_cache": False} if takes_cache else {}
    if lead != "input_ids":  # a later stage drives its placeholder embeddings with the images' shape
        model.wants_first_input = True
    stage_input: list[torch.Tensor] = []
    after = _owned(model, ends.get("after", []))
    if empty and not first and last and after:  # a head-only chunk: its input goes to the final norm
        parent, name = after[0]
        getattr(parent, name).register_forward_pre_hook(lambda _module, args: (stage_input[-1], *args[1:]))

    def forward(x: torch.Tensor, *received: torch.Tensor, **inputs: torch.Tensor) -> object:
        original = inputs.pop(FIRST_INPUT_KWARG, None)
        # a copy (a view would refuse the split backward's detach_), whose gradient flows back to the received one
        handed = [t.clone() for t in received]
        if empty and not first and not last and not holds_between:
            return (x, *handed) if hands_on else x  # a chunk without layers between two others
        from_carried = len(received) - len(takes_loop)
        for placeholder in carriers:  # the carried module takes what the stage received beside the hidden state
            placeholder.carried = list(received[:from_carried])
        if first:
            ids = x
        elif lead == "input_ids":
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        else:  # the first input itself (images): only its shape reaches the placeholder embeddings
            ids = original
        entry.inject = None if first else x
        entry.inject_slots = dict(zip(takes_loop, handed[from_carried:], strict=True))
        stage_input[:] = [x]
        for placeholder in (*placeholders, *carriers):
            placeholder.dtype = x.dtype if x.is_floating_point() else torch.float32
        captured.clear()
        try:
            out = cls_forward(model, **{lead: ids}, **cache, **inputs)
        except _StageEnd as stop:  # a view (OPT's layers return one) would refuse the split backward's detach_
            hidden = stop.hidden
            if holds_between and not first and x.requires_grad:  # the decoder's embedded input may not read x
                hidden = _JoinedToInput.apply(hidden, x)
            elif hidden._base is not None:
                hidden = hidden.clone()
            if not hands_on:
                return hidden
            if probe_layers.probe is not None and stop.loop is None:
                raise AutoparError("the layer stack's loop ended without calling a next layer, to which the plan's "
                                   "stages hand on what it passes: plan again with --fix pp=1") from None
            # the carried outputs made here leave as copies too: the stage's own layers saved them for backward
            carried = [t.clone() for t in captured] if makes else handed[:from_carried] if takes else []
            return (hidden, *carried, *[t.clone() for t in stop.loop or ()])
        finally:
            entry.inject = entry.inject_slots = None
            stage_input.clear()
        if not hasattr(out, "logits"):  # tensors (CLIP's embeddings and temperature): the loss takes them as they are
            model.output_type = None
            return out
        model.output_type = type(out)  # the loss gets one again (autopar.runtime.pipeline.model_output)
        return out.logits

    model.forward = forward
    return model


def _drop_unused_ties(model: nn.Module, containers: list[str], called: list[str]) -> None:
    """Stand in for the modules beside the stacks that the forward never calls itself (an encoder-decoder's
    ``shared`` embedding, which the encoder's, the decoder's and the head's names tie), where no module the stage
    keeps holds their parameters: a middle stage would otherwise keep a copy that no step updates."""
    on_path = {".".join(c.split(".")[:i]) for c in containers for i in range(len(c.split(".")))}
    candidates = [f"{owner}.{name}" if owner else name for owner in sorted(on_path)
                  for name, child in model.get_submodule(owner).named_children()
                  if not isinstance(child, _Placeholder) and next(child.parameters(), None) is not None]
    candidates = [c for c in candidates if c not in on_path and c not in containers and c not in called]
    if not candidates:
        return
    kept = {id(p) for name, module in model.named_modules() if name not in candidates
            and not any(name.startswith(c + ".") for c in candidates) for p in module.parameters(recurse=False)}
    for fqn in candidates:
        parent, name = _parent_of(model, fqn)
        if not any(id(p) in kept for p in getattr(parent, name).parameters()):
            setattr(parent, name, _Placeholder(getattr(parent, name), False))


def _parent_of(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner, _, name = fqn.rpartition(".")
    return (model.get_submodule(owner) if owner else model), name


def _owned(model: nn.Module, names: list[str]) -> list[tuple[nn.Module, str]]:
    """(parent, name) of the modules ``names`` that hold parameters."""
    out = []
    for fqn in names:
        parent, name = _parent_of(model, fqn)
        if next(getattr(parent, name).parameters(), None) is not None:
            out.append((parent, name))
    return out


def _fqn_of(model: nn.Module, module: nn.Module) -> str:
    """``module``'s name in ``model`` (``""`` for the model itself)."""
    return next(name for name, m in model.named_modules(remove_duplicate=False) if m is module)


def prune(model: nn.Module, lo: int, hi: int, first: bool, last: bool, container: str,
          ends: Mapping[str, list[str]] | None = None) -> nn.Module:
    """``model`` itself, cut down to the layers ``[lo, hi)`` (plus the embeddings when ``first``, the head
    when ``last``); HuggingFace decoders run their own ``forward`` on the pieces (``hf_stage``, given the
    plan's ``stack_ends``)."""
    if is_huggingface(model):
        return hf_stage(model, container, lo, hi, first, last, ends)
    blocks = _block_dict(model, container)
    for key in list(blocks.keys()):
        if not lo <= int(key) < hi:
            del blocks[key]
    _drop_ends(model, container, first, last)
    return model


def prune_to_stage(model: nn.Module, plan: Plan, chunk: int) -> nn.Module:
    """A pruned deep copy of ``model`` for chunk ``chunk`` of the plan (for inspecting the stages of a model
    at hand; the runtime builds each chunk afresh on the meta device, ``autopar.runtime.parallelize.apply_pp``)."""
    lo, hi = stage_layer_ranges(plan)[chunk]
    last = len(stage_layer_ranges(plan)) - 1
    return prune(copy.deepcopy(model), lo, hi, chunk == 0, chunk == last, plan.model["layer_container"],
                 plan.model.get("stack_ends"))
