"""Models built without memory, then filled in shard by shard with layout-independent initial weights.

Every rank builds the model with its parameters on the meta device (buffers, such as rotary tables, are
computed for real: they are small and the model's constructor is their only recipe), splits and shards it,
and only then allocates what it holds (``to_empty``).  Initial weights come from a seed per parameter FQN:
each parameter in turn is drawn whole on the CPU from its own generator state, and the rank keeps its
shard of it.  The weights therefore do not depend on the layout, the rank, the device or the order in
which modules were built, and one process gets the same ones.  A rank holds its own shards plus one whole
parameter at a time.  (DTensor's random ops are layout-independent only on CUDA; this works everywhere.)

How one parameter is drawn, first that applies:

- the model defines ``init_parameter(name, tensor)``, which fills ``tensor`` in place (the zoo models do);
- a HuggingFace model: its own ``_init_weights`` on a CPU copy of the module that owns the parameter;
- the owning module's ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, the norms ...).

Before either of the last two, a small parameter holds the value its constructor gave it: CLIP's
``logit_scale`` is ``nn.Parameter(torch.tensor(2.6592))`` in ``__init__``, and its ``_init_weights`` leaves
it alone (it would otherwise be whatever ``to_empty`` allocated).
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.errors import AutoparError

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


def clean_fqn(name: str) -> str:
    """The model FQN of a parameter or buffer seen through wrappers (activation checkpointing adds a level)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


SMALL_PARAMETER_NUMEL = 1 << 16
"""Parameters up to this size keep their constructor's value (``build_on_meta``): a few per model, where
``_init_weights`` and ``reset_parameters`` need not reach."""


@contextmanager
def parameters_on_meta(constructed: dict[int, tuple[nn.Parameter, torch.Tensor]] | None = None) -> Iterator[None]:
    """Register every new parameter on the meta device; buffers stay real (as accelerate's
    ``init_empty_weights(include_buffers=False)``).  Initialisation inside constructors then costs nothing.

    ``constructed`` collects the constructor's value of each small parameter (``SMALL_PARAMETER_NUMEL``),
    under the ``id`` of its meta parameter."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            value = param.detach()
            param = nn.Parameter(value.to("meta"), requires_grad=param.requires_grad)
            if constructed is not None and value.numel() <= SMALL_PARAMETER_NUMEL:
                constructed[id(param)] = (param, value.clone())
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass
class MetaModel:
    """A model whose parameters are on the meta device, the real values of its buffers, and the values its
    constructor gave its small parameters (by FQN)."""

    model: nn.Module
    buffers: dict[str, torch.Tensor]
    constructed: dict[str, torch.Tensor] = field(default_factory=dict)


def build_on_meta(build: Callable[[], nn.Module]) -> MetaModel:
    """Call ``build()`` with parameters on the meta device; keep its buffers' values and its small parameters'
    constructor values for ``materialize``."""
    made: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    with parameters_on_meta(made):
        model = build()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if b.device.type != "meta"}
    constructed = {name: made[id(p)][1] for name, p in model.named_parameters() if id(p) in made}
    return MetaModel(model, buffers, constructed)


def parameter_seed(seed: int, fqn: str) -> int:
    """The generator seed of parameter ``fqn``: stable across processes (``hash`` is salted per process)."""
    return (seed * 0x9E3779B1 + zlib.crc32(fqn.encode())) % (2**63)


def _owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner, _, name = fqn.rpartition(".")
    return (model.get_submodule(owner) if owner else model), name


def initial_value(reference: MetaModel, fqn: str, seed: int) -> torch.Tensor:
    """Parameter ``fqn`` of the reference model (never modified) as initialized from ``seed``, on the CPU."""
    model = reference.model
    module, name = _owner(model, fqn)
    meta = getattr(module, name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(parameter_seed(seed, fqn))
        hook = getattr(model, "init_parameter", None)
        if callable(hook):
            value = torch.empty(meta.shape, dtype=meta.dtype)
            with torch.no_grad():
                hook(fqn, value)
            return value
        shadow = copy.deepcopy(module).to_empty(device="cpu", recurse=False)
        prefix = fqn[:len(fqn) - len(name)]
        with torch.no_grad():
            for own, param in shadow.named_parameters(recurse=False):
                if prefix + own in reference.constructed:
                    param.copy_(reference.constructed[prefix + own])
        init_weights = getattr(model, "_init_weights", None)  # HuggingFace PreTrainedModel
        reset = getattr(shadow, "reset_parameters", None)
        with torch.no_grad():
            if callable(init_weights):
                init_weights(shadow)
            elif callable(reset):
                reset()
            elif fqn in reference.constructed:  # the constructor's value is its only recipe
                return reference.constructed[fqn].clone()
            else:
                raise AutoparError(f"cannot initialize {fqn}: its module {type(module).__name__} has no "
                                   "reset_parameters(); define init_parameter(name, tensor) on the model")
        return getattr(shadow, name).detach()


def _local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` as ``param`` holds it (a DTensor's local shard, or all of it)."""
    if not hasattr(param, "device_mesh"):
        return whole
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = param.device_mesh
    # Replicate -> the parameter's placements is local slicing (no communication), whatever the placements
    # (FSDP over a tp shard holds a _StridedShard).
    replicated = distribute_tensor(whole.to(param.device), mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
    return replicated.redistribute(mesh, param.placements).to_local()


def materialize(module: nn.Module, reference: MetaModel, device: torch.device, seed: int,
                canonical: dict[str, str] | None = None) -> None:
    """Allocate ``module`` (a meta-built model, split and sharded) on ``device`` and fill in its shards.

    ``reference`` is an unsharded meta build of the same model (its buffers and its ``init_parameter``);
    ``canonical`` maps a tied parameter's alias to the FQN it shares (a pipeline stage may hold only the alias).
    On the ``meta`` device the shards are laid out but neither allocated nor filled in.
    """
    canonical = canonical or {}
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None:
                shared.setdefault(id(p), []).append((owner, name))
    module.to_empty(device=device)
    if device.type == "meta":  # laid out, not allocated: nothing to fill in
        return
    for places in shared.values():  # to_empty replaces each module's parameters on its own: re-tie them
        (first, first_name), *rest = places
        for owner, name in rest:
            owner._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        for name, buf in module.named_buffers():
            fqn = clean_fqn(name)
            if fqn in reference.buffers:
                buf.copy_(reference.buffers[fqn])
        for name, param in module.named_parameters():
            fqn = canonical.get(clean_fqn(name), clean_fqn(name))
            whole = initial_value(reference, fqn, seed).to(param.dtype)
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(_local_part(param, whole))


__all__ = ["MetaModel", "build_on_meta", "clean_fqn", "initial_value", "materialize", "parameter_seed",
           "parameters_on_meta"]
