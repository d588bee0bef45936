"""The Python API: ``autopar.plan(...)`` does what ``autopar plan`` does and returns the Plan.

    plan = autopar.plan("gpt", gpus=16, global_batch=64)        # a zoo name
    plan = autopar.plan("models/llama.py", config={"layers": 8})  # a model file
    plan = autopar.plan(MyModel, config={"hidden": 1024})        # a module-level class or factory
    plan = autopar.plan(MyModel(hidden=1024), config={"hidden": 1024})  # a built module
    plan.save("out/plan.json")

A factory (or a built module's class) must be defined at the top level of a module: the plan names it as
``module:QUALNAME`` (a package's) or ``FILE:QUALNAME`` (a script's), and every rank of the runtime imports it
from there and calls it with ``config``.  A built module is traced as it is (on fake copies of its tensors);
the runtime builds ``type(module)(**config)``: ``autopar.runtime.apply`` refuses it when its parameters'
names or shapes differ from the plan's, and ``autopar verify`` when its graph does (the fingerprint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from autopar.cluster import Cluster, cluster_from_args
from autopar.errors import AutoparError
from autopar.framework import DEFAULT_FRAMEWORK, load_framework
from autopar.frontend import TracedModel, trace_model
from autopar.inter_op.fp8 import training_precisions
from autopar.inter_op.search import SearchResult, UnitCostCache, search
from autopar.inter_op.techniques import normalize_fix, parse_fix
from autopar.inter_op.to_plan import build_plan
from autopar.ir import OpGraph
from autopar.modelfile import factory_ref
from autopar.passes import PassContext
from autopar.passes.context import PrecisionPolicy
from autopar.plan_file import Plan
from autopar.report import human_bytes
from autopar.runnable import RuntimeFilter, runtime_filter

DEFAULT_CLUSTER = "a100-80gb"
DEFAULT_TIME_LIMIT_S = 60.0

ModelLike = str | Callable[..., nn.Module] | nn.Module


@dataclass(frozen=True, slots=True)
class Planning:
    """A planning run: the best plan and what the search saw (the CLI prints all of it)."""

    plans: list[Plan]
    """The best plan first, then the next distinct layouts (``top``)."""
    result: SearchResult
    traced: TracedModel
    cluster: Cluster
    global_batch: int

    @property
    def plan(self) -> Plan:
        return self.plans[0]


def model_ref(model: ModelLike) -> tuple[str, nn.Module | None]:
    """The reference a plan records for ``model``, and the built module to trace (``None``: build from it)."""
    if isinstance(model, str):
        return model, None
    if isinstance(model, nn.Module):
        return factory_ref(type(model)), model
    if callable(model):
        return factory_ref(model), None
    raise AutoparError(f"model must be a zoo name, a model file path, an nn.Module class or factory, or a built "
                       f"nn.Module, not {type(model).__name__}")


def _fixed(fix: str | dict[str, Any] | None) -> dict[str, Any]:
    if fix is None or isinstance(fix, str):
        return parse_fix(fix)
    if isinstance(fix, dict):
        return normalize_fix(fix)
    raise AutoparError(f"fix must be a 'key=value,...' string or a dict, not {type(fix).__name__}")


def setup(cluster: str | Cluster, gpus: int | None, gpus_per_node: int | None, inter_node_gbps: float | None,
          global_batch: int | None, time_limit_s: float, memory_limit_gb: float | None, attention: str,
          framework: str, precision: str = "bf16", compile: bool | None = None,
          ) -> tuple[Cluster, PassContext, int, float]:
    """Check the planning options; the cluster, the pass context, the global batch (default max(256, GPUs))
    and the per-device memory budget in bytes (default the cluster's usable memory).  ``precision``: the
    training precision of the context (``bf16`` or ``fp8``; ``auto`` gives a bf16 context, and
    ``training_precisions`` says what to search).  ``compile``: whether the blocks run ``torch.compile``d
    (``None``: wherever the framework compiles them)."""
    if global_batch is not None and global_batch < 1:
        raise AutoparError("global batch (--global-batch) must be >= 1")
    if time_limit_s <= 0:
        raise AutoparError("time limit (--time-limit) must be positive")
    if memory_limit_gb is not None and memory_limit_gb <= 0:
        raise AutoparError("memory limit (--memory-limit) must be positive")
    if isinstance(cluster, Cluster):
        if (gpus is not None and gpus < 1) or (gpus_per_node is not None and gpus_per_node < 1):
            raise AutoparError("gpus and gpus_per_node must be >= 1")
        inter = inter_node_gbps * 1e9 / 8 if inter_node_gbps is not None else None
        spec = cluster.with_overrides(gpus=gpus, gpus_per_node=gpus_per_node, inter_node_bandwidth_bytes_per_s=inter)
    else:
        spec = cluster_from_args(cluster, gpus, gpus_per_node, inter_node_gbps)
    fw = load_framework(framework)
    training_precisions(precision, spec, fw)
    compiled = fw.compiles(compile, gpu=spec.inductor_backend == "triton")
    ctx = PassContext(cluster=spec, attention=attention, framework=fw, compile=compiled,
                      precision=PrecisionPolicy(training="bf16" if precision == "auto" else precision))
    batch = global_batch if global_batch is not None else max(256, spec.gpus)
    budget = memory_limit_gb * 2**30 if memory_limit_gb is not None else spec.usable_memory_bytes
    return spec, ctx, batch, budget


def plan_model(model: ModelLike, *, config: dict[str, Any] | None = None,
               example_inputs: Callable[..., Any] | None = None, cluster: str | Cluster = DEFAULT_CLUSTER,
               gpus: int | None = None, gpus_per_node: int | None = None, inter_node_gbps: float | None = None,
               global_batch: int | None = None, seq_len: int | None = None, fix: str | dict[str, Any] | None = None,
               memory_limit_gb: float | None = None, attention: str = "flash", solver: str = "cbc",
               time_limit_s: float | None = None, top: int = 1, framework: str = DEFAULT_FRAMEWORK,
               every_layer: bool = False, on_progress: Callable[[str], None] | None = None,
               precision: str = "bf16", exhaustive: bool = False, jobs: int = 1,
               compile: bool | None = None) -> Planning:
    """Trace ``model``, search its layouts on ``cluster`` and build the plan(s); raises ``AutoparError`` with
    a one-line message when the input is bad or nothing fits.  ``on_progress`` is told what runs now (the
    trace, each intra-op solve, the search's count).  ``precision`` ``auto`` searches bf16 and, where the
    cluster and framework can, fp8, and keeps the faster.  ``exhaustive``: estimate every layout, with no bound
    or cut-off (slow; the same plan).  ``jobs``: processes that solve the intra-op ILPs (the same plan).
    ``compile``: plan for blocks run ``torch.compile``d (``None``: wherever the framework compiles them)."""
    if jobs < 1:
        raise AutoparError("jobs (--jobs) must be >= 1")
    fixed = _fixed(fix)
    if top < 1:
        raise AutoparError("top (--top) must be >= 1")
    time_limit_s = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    spec, ctx, batch, budget = setup(cluster, gpus, gpus_per_node, inter_node_gbps, global_batch, time_limit_s,
                                     memory_limit_gb, attention, framework, precision, compile)
    ref, built = model_ref(model)
    inputs_ref = factory_ref(example_inputs) if example_inputs is not None else None
    if on_progress is not None:
        on_progress(f"tracing {ref}")
    traced = trace_model(ref, config, seq_len, ctx, every_layer, example_inputs=inputs_ref, built=built)
    pinned = (fix if isinstance(fix, str) else ",".join(f"{k}={v}" for k, v in sorted(fixed.items()))) or "none"
    plans, res, _ = plan_graph(traced.graph, ref, traced.config, spec, ctx, batch, budget, precision=precision,
                               fixed=fixed, pinned=pinned, solver=solver, time_limit_s=time_limit_s, top=top,
                               on_progress=on_progress, exhaustive=exhaustive, jobs=jobs, example_inputs=inputs_ref)
    return Planning(plans, res, traced, spec, batch)


class NoFitError(AutoparError):
    """No layout fits in the memory budget; ``leanest_bytes`` is what the leanest one needs per device."""

    def __init__(self, message: str, leanest_bytes: float) -> None:
        super().__init__(message)
        self.leanest_bytes = leanest_bytes


def plan_graph(graph: OpGraph, ref: str, config: dict[str, Any], spec: Cluster, ctx: PassContext, batch: int,
               budget: float, *, precision: str = "bf16", fixed: dict[str, Any] | None = None, pinned: str = "none",
               solver: str = "cbc", time_limit_s: float = DEFAULT_TIME_LIMIT_S, top: int = 1,
               on_progress: Callable[[str], None] | None = None, exhaustive: bool = False, jobs: int = 1,
               example_inputs: str | None = None, caches: dict[str, UnitCostCache] | None = None,
               runnable: RuntimeFilter | None = None) -> tuple[list[Plan], SearchResult, PassContext]:
    """Search a traced ``graph`` on ``spec`` (as ``setup`` made it) and build the ``top`` plans: what
    ``plan_model`` does after tracing.  ``caches``: per training precision, the intra-op solves and unit costs to
    reuse (a sweep's, across cluster sizes); ``runnable``: the runtime's filter to reuse (its verdicts depend on
    the intra-op solution, not on the cluster's size; default: a new one where autopar's runtime trains the plan);
    ``pinned``: the ``--fix`` text errors quote.  Raises ``NoFitError`` when no layout fits, ``AutoparError`` when
    none divides the cluster or the runtime runs none."""
    fixed = fixed or {}
    if graph.params and not graph.num_trainable_parameters:
        raise AutoparError(f"{ref}: no parameter trains (every one has requires_grad=False): nothing to plan")
    if runnable is None:
        runnable = runtime_filter(graph, ref, config, spec, ctx, batch, example_inputs)
    res = None
    for training in training_precisions(precision, spec, ctx.framework):
        tried = dataclasses.replace(ctx, precision=dataclasses.replace(ctx.precision, training=training))
        found = search(graph, spec, tried, batch, fixed, budget, solver, time_limit_s, top, on_progress,
                       cache=(caches or {}).get(training), accept=runnable.accept if runnable else None,
                       exhaustive=exhaustive, jobs=jobs, may_accept=runnable.may_accept if runnable else None)
        if res is None or _faster(found, res):
            res, ctx = found, tried
    assert res is not None
    best = res.best
    if best is None and res.enumerated and runnable is not None and runnable.reasons:
        raise AutoparError(f"no layout autopar's runtime can run (--fix {pinned}): {runnable.reasons[0]}")
    if best is None:
        raise AutoparError("no layout of the search space divides the cluster and the global batch "
                           f"({spec.gpus} devices, global batch {batch}, --fix {pinned})")
    if not best.estimate.fits:
        leanest = (res.leanest or best).estimate.peak_memory_bytes
        raise NoFitError(
            f"no layout fits in {human_bytes(budget)} per device: the leanest needs "
            f"{human_bytes(leanest)} (try more GPUs, --memory-limit, or --fix recompute=full,zero=3)", leanest)
    plans = [build_plan(graph=graph, model_ref=ref, config=config, cluster=spec, ctx=ctx,
                        global_batch=batch, estimate=c.estimate, strategies=c.strategies, example_inputs=example_inputs,
                        memory_limit_bytes=budget, alternatives=c.alternatives)
             for c in res.candidates[:top] if c.estimate.fits]
    return plans, res, ctx


def _faster(a: SearchResult, b: SearchResult) -> bool:
    """Whether ``a``'s best layout beats ``b``'s: one that fits beats one that does not, then the faster."""
    if a.best is None or b.best is None:
        return b.best is None and a.best is not None
    ka = (not a.best.estimate.fits, a.best.estimate.iteration_time_s)
    kb = (not b.best.estimate.fits, b.best.estimate.iteration_time_s)
    return ka < kb


def plan(model: ModelLike, *, config: dict[str, Any] | None = None,
         example_inputs: Callable[..., Any] | None = None, cluster: str | Cluster = DEFAULT_CLUSTER,
         gpus: int | None = None, gpus_per_node: int | None = None, global_batch: int | None = None,
         seq_len: int | None = None, fix: str | dict[str, Any] | None = None, memory_limit_gb: float | None = None,
         attention: str = "flash", solver: str = "cbc", time_limit_s: float | None = None, top: int = 1,
         framework: str = DEFAULT_FRAMEWORK, precision: str = "bf16", compile: bool | None = None,
         ) -> Plan | list[Plan]:
    """Plan ``model`` (a zoo name, a model file, an ``nn.Module`` class or factory, or a built module) as
    ``autopar plan`` does: the best Plan, or with ``top > 1`` a list of the best distinct ones, best first.

    ``config`` goes to the factory (or ``build_model``); ``example_inputs(batch_size, seq_len, **config)``,
    a top-level function, replaces the model's own; ``fix`` pins layout keys (``"tp=8,pp=2"`` or a dict);
    ``precision`` is the training precision: ``bf16`` (default), ``fp8`` (the layers' Linears, on devices
    with FP8 tensor cores) or ``auto`` (the faster of the two); ``compile`` runs each block ``torch.compile``d
    (default: wherever the framework does, as ``torch`` and ``torchtitan`` do);
    the defaults are those of the CLI (``a100-80gb``, all its GPUs, a global batch of max(256, GPUs))."""
    planning = plan_model(model, config=config, example_inputs=example_inputs, cluster=cluster, gpus=gpus,
                          gpus_per_node=gpus_per_node, global_batch=global_batch, seq_len=seq_len, fix=fix,
                          memory_limit_gb=memory_limit_gb, attention=attention, solver=solver,
                          time_limit_s=time_limit_s, top=top, framework=framework, precision=precision,
                          compile=compile)
    return planning.plan if top == 1 else planning.plans


__all__ = ["DEFAULT_CLUSTER", "ModelLike", "NoFitError", "Planning", "model_ref", "plan", "plan_graph", "plan_model",
           "setup"]
