"""From a model reference (zoo name or file) to an annotated ``OpGraph``: build on fake tensors, trace, run passes."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.overrides import TorchFunctionMode

from autopar import modelfile
from autopar.collector import collector_paused
from autopar.errors import ModelFileError
from autopar.inputs import ModelInputs
from autopar.ir import OpGraph
from autopar.passes import PassContext, run_pipeline
from autopar.tracing import trace

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TracedModel:
    """A model file's module, the fake-tensor model built from it, and its annotated graph."""

    ref: str
    config: dict[str, Any]
    module: ModuleType
    model: nn.Module
    graph: OpGraph
    seq_len: int
    exported: OpGraph | None = None
    """The graph as traced, before the passes annotated it (``annotated`` runs them again under another
    context)."""

    def annotated(self, ctx: PassContext) -> OpGraph:
        """The traced graph annotated under ``ctx`` (another cluster or precision) without tracing again."""
        if self.exported is None:
            raise ValueError("this TracedModel keeps no exported graph")
        return run_pipeline(self.exported.copy(), ctx)


def build_fake(module: ModuleType, config: dict[str, Any], ref: str,
               seq_len: int | None) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model with fake parameters.  A ``--seq-len`` the config does not set is passed on as
    ``seq_len`` when ``build_model`` accepts it (it sizes position tables).

    A model whose initialization reads values (``tensor.item()``, a data-dependent branch), which fake
    tensors cannot give, or moves its modules with ``Module.to`` (PEFT's adapters follow their base layer's
    device), which cannot swap fake parameters, is built on the meta device instead and its tensors made
    fake of the same shapes and dtypes (``fake_from_meta``); a warning says so."""
    if seq_len is not None and "seq_len" not in config:
        try:
            with_seq = {**config, "seq_len": seq_len}
            return _build_fake_or_meta(module, with_seq, ref), with_seq
        except ModelFileError as exc:
            if "'seq_len'" not in str(exc):
                raise
    return _build_fake_or_meta(module, config, ref), config


class _SkipInitialization(TorchFunctionMode):
    """Skips the fills that initialize weights (``nn.init``'s functions, ``Tensor.normal_`` and its kin): a fake
    tensor holds no values for them to set, and each would cost a fake dispatch (a third of building GPT-3 175B)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INITIALIZING_FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor):
                return target
        return func(*args, **kwargs)


#: In-place fills whose only effect is on values: ``torch.nn.init``'s functions and the ``Tensor`` methods they
#: and model code call.
_INITIALIZING_FILLS = frozenset({
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "fill_", "zero_",
    "random_", "exponential_", "geometric_", "log_normal_", "cauchy_", "bernoulli_"})


def _build_fake_or_meta(module: ModuleType, config: dict[str, Any], ref: str) -> nn.Module:
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _SkipInitialization():
            return modelfile.build(module, config, ref)
    except ModelFileError as exc:
        if not _fake_tensors_cannot(exc.__cause__):
            raise
        reason = exc.__cause__
    what = ("moves its modules (Module.to), which cannot swap fake parameters" if "Couldn't swap" in str(reason)
            else "reads values as it initializes, which fake tensors cannot give")
    log.warning("%s: build_model %s (%s): built on the meta device and traced on fake tensors of its shapes",
                ref, what, reason)
    with torch.device("meta"):
        model = modelfile.build(module, config, ref)
    return fake_from_meta(model)


def _fake_tensors_cannot(exc: BaseException | None) -> bool:
    """Whether a build failed on what fake tensors cannot do, which the meta device can: read a value, or be
    swapped by ``Module._apply`` (a RuntimeError only for that one: fake tensors are weakly referenced by
    their mode)."""
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        return True
    return isinstance(exc, RuntimeError) and "Couldn't swap" in str(exc)


def fake_from_meta(model: nn.Module, device: str = "cpu") -> nn.Module:
    """``model`` (built on the meta device) with each parameter and buffer a fake ``device`` tensor of its
    shape, stride and dtype, in place; tied tensors stay tied."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}  # by the id of the meta tensor, which the model keeps alive

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for owner in model.modules():
        for kind in (owner._parameters, owner._buffers):
            for name, t in list(kind.items()):
                if t is not None:
                    kind[name] = fake(t)
    return model


#: Models are traced in the 16-bit precision they train in, so that the fp32 upcasts their code makes
#: (an fp32 RMSNorm, rotary tables, a loss on ``logits.float()``) show as 4-byte tensors.
TRACE_DTYPE = torch.bfloat16


def _to_trace_dtype(model: nn.Module) -> nn.Module:
    """Cast a fake model's floating parameters and buffers to ``TRACE_DTYPE`` in place, in its own fake mode.
    (``Module.to`` would swap fake tensors, which their mode's weak references forbid.)  A fake tensor has no
    values to convert: each becomes an empty one of its shape and strides, one fake op rather than a detach and a
    copy, and a parameter takes it as its ``data`` (it stays the same object: tied parameters stay tied)."""
    fake = next((t.fake_mode for t in [*model.parameters(), *model.buffers()] if hasattr(t, "fake_mode")), None)
    if fake is None:
        raise ValueError("_to_trace_dtype casts fake models only")

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=TRACE_DTYPE, device=t.device)

    with fake:
        for p in model.parameters():  # each once, however many modules share it
            if p.is_floating_point() and p.dtype != TRACE_DTYPE:
                p.data = empty(p)
        for module in model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_floating_point():
                    module._buffers[name] = empty(b)
    return model


def inputs_in_trace_dtype(inputs: ModelInputs) -> ModelInputs:
    """Floating inputs (images, audio features) in ``TRACE_DTYPE``, as the runtime's bf16 mixed precision
    casts them (FSDP2's ``MixedPrecisionPolicy`` casts forward inputs to the parameters' dtype)."""
    return inputs.map(lambda x: x.to(TRACE_DTYPE) if x.is_floating_point() else x)


def fake_copy(model: nn.Module) -> nn.Module:
    """A copy of a built module whose parameters and buffers are fake tensors of their shapes and dtypes:
    no real memory is copied, and the module itself is left as it is.  Tied tensors stay tied."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            fake = mode.from_tensor(t.detach())
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


@collector_paused()
def trace_model(ref: str, config: dict[str, Any] | None = None, seq_len: int | None = None,
                ctx: PassContext | None = None, every_layer: bool = False, *, example_inputs: str | None = None,
                built: nn.Module | None = None) -> TracedModel:
    """Load ``ref``, build it on fake tensors, trace one sample and run the default pass pipeline.

    ``every_layer``: export every block of the stack instead of repeating a few identical ones.
    ``example_inputs``: a ``SOURCE:FUNCTION`` that replaces the model's own.  ``built``: trace this module
    (a fake copy of it) instead of building one from ``ref``.
    """
    config = dict(config or {})
    module = modelfile.load_module(ref, example_inputs)
    if built is None:
        model, config = build_fake(module, config, ref, seq_len)
    else:
        model = fake_copy(built)
    model = _to_trace_dtype(model)
    seq = seq_len if seq_len is not None else modelfile.infer_seq_len(model, config)
    if seq < 1:
        raise ModelFileError(f"sequence length must be >= 1, got {seq}")
    for batch_size in (2, 1):  # the batch is dim 0: checked at two sizes, so that a batch of one is no accident
        drawn = modelfile.example_inputs(module, model, batch_size, seq, config)
        drawn.check_batch(batch_size)
    inputs = inputs_in_trace_dtype(drawn)
    tokens = seq_len if seq_len is not None else modelfile.declared_seq_len(model, config)
    exported = trace(model, inputs, modelfile.loss_fn_of(module), repeat_identical_layers=not every_layer,
                     tokens=tokens)
    graph = run_pipeline(exported.copy(), ctx or PassContext())
    return TracedModel(ref, config, module, model, graph, graph.seq_len, exported)
