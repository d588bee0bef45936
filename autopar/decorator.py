"""``@autopar.parallelize``: plan a model class (or factory) where it is defined, and run the plan under torchrun.

    @autopar.parallelize(cluster="a100-80gb", gpus=64, global_batch=512, seq_len=4096, plan="plan.json")
    class MyModel(nn.Module):
        def __init__(self, layers=32, hidden=4096): ...

    MyModel.autopar_plan(layers=32)   # the Plan (cached), anywhere, no GPU needed
    model = MyModel(layers=32)        # outside torchrun: the plain model (an instance of MyModel)
    trainer = MyModel(layers=32)      # under torchrun: this rank's autopar.runtime Trainer, *not* a MyModel

Under torchrun, construction reads the plan file when it exists and is for this model (its fingerprint)
and this world size; otherwise rank 0 plans and saves it atomically and every rank then reads that same
file.  A plan file for another model or another world size is an error unless ``replan=True``.  Rank 0
prints one line saying which happened.  The class must be defined at the top level of its file: every
rank re-imports it from there (``autopar.modelfile``), and builds it with the keyword arguments given.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from autopar.api import DEFAULT_CLUSTER, plan_model
from autopar.errors import AutoparError
from autopar.framework import DEFAULT_FRAMEWORK
from autopar.frontend import trace_model
from autopar.modelfile import BUILDING, factory_ref
from autopar.passes import PassContext
from autopar.plan_file import Plan, PlanError


@dataclass(kw_only=True)
class _Options:
    cluster: str
    gpus: int | None
    gpus_per_node: int | None
    global_batch: int | None
    seq_len: int | None
    plan: str
    fix: str | dict[str, Any] | None
    memory_limit_gb: float | None
    attention: str
    framework: str
    replan: bool
    training: Any
    precision: str = "bf16"
    compile: bool | None = None
    cache: dict[str, Plan] = field(default_factory=dict)


def in_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or otherwise initialized) distributed job."""
    import torch.distributed as dist

    return dist.is_available() and (dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ))


def _planned(factory: Callable[..., nn.Module], config: dict[str, Any], opts: _Options, gpus: int | None) -> Plan:
    return plan_model(factory, config=config, cluster=opts.cluster, gpus=gpus, gpus_per_node=opts.gpus_per_node,
                      global_batch=opts.global_batch, seq_len=opts.seq_len, fix=opts.fix,
                      memory_limit_gb=opts.memory_limit_gb, attention=opts.attention,
                      framework=opts.framework, precision=opts.precision, compile=opts.compile).plan


def _mismatch(plan: Plan, factory: Callable[..., nn.Module], config: dict[str, Any], opts: _Options,
              world: int) -> str | None:
    """Why ``plan`` is not this model's plan on ``world`` ranks (``None``: it is)."""
    if plan.num_devices != world:
        return f"it is for {plan.num_devices} devices and this run has {world} ranks"
    traced = trace_model(factory_ref(factory), config, opts.seq_len, PassContext())
    try:
        plan.check_model(traced.graph, traced.config)
    except PlanError as exc:
        return f"it is for another model ({exc})"
    return None


def _rank0_plan_file(factory: Callable[..., nn.Module], config: dict[str, Any], opts: _Options,
                     world: int) -> str:
    """On rank 0: make sure the plan file holds this model's plan; returns the line to log."""
    if opts.gpus is not None and opts.gpus != world:
        raise AutoparError(f"@autopar.parallelize(gpus={opts.gpus}) but this run has {world} ranks (launch "
                           f"{opts.gpus}, or leave gpus out to plan for the ranks there are)")
    path = Path(opts.plan)
    if path.exists():
        try:
            plan = Plan.load(path)
            why = _mismatch(plan, factory, config, opts, world)
        except PlanError as exc:  # unreadable, another schema, edited
            why = str(exc)
        if why is None:
            return f"autopar: using {path} (fingerprint {plan.model['fingerprint']})"
        if not opts.replan:
            raise PlanError(f"{path} is not this run's plan: {why} (delete it, or pass replan=True)")
    _planned(factory, config, opts, world).save(path)  # atomic: a temporary file renamed
    return f"autopar: planned, saved {path}"


def _distributed_build(factory: Callable[..., nn.Module], config: dict[str, Any], opts: _Options) -> Any:
    """Every rank: agree on the plan file through rank 0, then ``autopar.runtime.apply`` it.  The plan file's
    path must be one every rank reads (a shared filesystem when the run spans nodes)."""
    import torch.distributed as dist

    from autopar.runtime.apply import apply, device_for_rank

    device = device_for_rank()  # sets this rank's GPU first: NCCL's object collectives use the current one
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    outcome: list[Any] = [None, None]  # [error, line to log]
    if rank == 0:
        try:
            outcome[1] = _rank0_plan_file(factory, config, opts, world)
        except Exception as exc:  # any failure must reach the other ranks, or they wait in the broadcast
            outcome[0] = str(exc) if isinstance(exc, AutoparError) else f"planning failed: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise AutoparError(outcome[0])
    if rank == 0:
        print(outcome[1], file=sys.stderr, flush=True)
    plan = Plan.load(opts.plan)
    return apply(plan, config=opts.training)


def _plan_once(factory: Callable[..., nn.Module], config: dict[str, Any], opts: _Options) -> Plan:
    key = json.dumps(config, sort_keys=True, default=repr)
    if key not in opts.cache:
        opts.cache[key] = _planned(factory, config, opts, opts.gpus)
    return opts.cache[key]


def _no_positional(name: str, args: tuple[Any, ...]) -> None:
    if args:
        raise AutoparError(f"{name}: a model under @autopar.parallelize takes its config as keyword arguments "
                           "(the plan records them)")


def _decorate_class(cls: type[nn.Module], opts: _Options) -> type[nn.Module]:
    """The class itself, given a ``__new__`` and ``autopar_plan`` (no subclass: ``super(Cls, self)`` and
    subclasses keep working).  While autopar builds the model (``modelfile.BUILDING``) it is the plain class."""
    base_new = cls.__new__

    def __new__(klass, *args: Any, **config: Any) -> Any:
        if in_torchrun() and not BUILDING.get():
            _no_positional(klass.__name__, args)
            return _distributed_build(klass, config, opts)  # not an instance: __init__ does not run on it
        return base_new(klass) if base_new is not object.__new__ else object.__new__(klass)

    def autopar_plan(klass, **config: Any) -> Plan:
        """The plan of this model built with ``config`` (planned once, then cached)."""
        return _plan_once(klass, config, opts)

    cls.__new__ = staticmethod(__new__)  # type: ignore[assignment]
    cls.autopar_plan = classmethod(autopar_plan)  # type: ignore[attr-defined]
    return cls


def _decorate_function(fn: Callable[..., nn.Module], opts: _Options) -> Callable[..., Any]:
    @functools.wraps(fn)
    def build(*args: Any, **config: Any) -> Any:
        if in_torchrun() and not BUILDING.get():
            _no_positional(fn.__name__, args)
            return _distributed_build(fn, config, opts)
        return fn(*args, **config)

    build.autopar_plan = lambda **config: _plan_once(fn, config, opts)  # type: ignore[attr-defined]
    build.__autopar_factory__ = fn  # type: ignore[attr-defined]
    return build


def parallelize(*, cluster: str = DEFAULT_CLUSTER, gpus: int | None = None, gpus_per_node: int | None = None,
                global_batch: int | None = None, seq_len: int | None = None, plan: str = "plan.json",
                fix: str | dict[str, Any] | None = None, memory_limit_gb: float | None = None,
                attention: str = "flash", framework: str = DEFAULT_FRAMEWORK, replan: bool = False,
                training: Any = None, precision: str = "bf16", compile: bool | None = None) -> Callable[[Any], Any]:
    """Decorate a model class or factory (see the module docstring).  The planning options are those of
    ``autopar.plan`` (``precision``: ``bf16``, ``fp8`` or ``auto``; ``compile``); ``plan`` is the plan file
    torchrun runs share; ``training`` an ``autopar.runtime.TrainingConfig`` for the Trainer."""
    opts = _Options(cluster=cluster, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
                    seq_len=seq_len, plan=plan, fix=fix, memory_limit_gb=memory_limit_gb, attention=attention,
                    framework=framework, replan=replan, training=training, precision=precision, compile=compile)

    def decorate(target: Any) -> Any:
        if isinstance(target, type) and issubclass(target, nn.Module):
            return _decorate_class(target, opts)
        if callable(target):
            return _decorate_function(target, opts)
        raise AutoparError(f"@autopar.parallelize decorates an nn.Module class or a factory, not "
                           f"{type(target).__name__}")

    return decorate


__all__ = ["in_torchrun", "parallelize"]
