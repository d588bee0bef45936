"""Planning every point of a sweep: trace once, share the intra-op solves, run the points in a pool or on Ray.

The parent traces the model once and annotates the graph once per GPU type (the passes read the cluster).  Each
point is a task that plans one cluster size with ``autopar.api.plan_graph``.  The intra-op ILPs depend on the
GPU type, not on the count (``UnitCostCache.serves``), so a type's smallest point runs first and solves them;
its solves (``UnitCostCache.solved``) travel with every later task of that type, and a worker keeps one cache
per type for the points it runs.  The solves are deterministic, so a point's plan is the same whichever process
solved its ILPs: the pool, Ray and one process give the same sweep.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from autopar.passes.context import PassContext

from autopar.api import NoFitError, plan_graph, setup
from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.inter_op.fp8 import training_precisions
from autopar.inter_op.search import UnitCostCache
from autopar.ir import OpGraph
from autopar.runnable import runtime_filter
from autopar.sweep.grid import Point

Solved = dict[tuple, Any]  # UnitCostCache.solved(): solve key -> (mesh, strategies, solution)
Shared = dict[str, dict[tuple[str, str], Solved]]  # GPU type -> (training precision, Cluster.fabric_key) -> solves


@dataclass(frozen=True, slots=True)
class PlanningOptions:
    """What every point plans with (the ``autopar plan`` options a sweep passes on)."""

    model_ref: str
    config: dict[str, Any]
    global_batch: int
    framework: str
    precision: str = "bf16"
    attention: str = "flash"
    solver: str = "cbc"
    time_limit_s: float = 60.0
    memory_limit_gb: float | None = None
    compile: bool | None = None

    def setup(self, cluster: str | Cluster, gpus: int) -> tuple[Cluster, PassContext, int, float]:
        """``autopar.api.setup`` for ``gpus`` devices of ``cluster``."""
        return setup(cluster, gpus, None, None, self.global_batch, self.time_limit_s, self.memory_limit_gb,
                     self.attention, self.framework, self.precision, self.compile)


@dataclass(frozen=True, slots=True)
class TypeGraph:
    """A GPU type's annotated graph (the model traced once, annotated under the type's context)."""

    cluster: str
    graph: OpGraph


@dataclass(slots=True)
class PointResult:
    """One point planned: ``status`` ``ok`` (``estimate``, ``layout``, ``plan_json``), ``no-fit`` (``leanest_bytes``,
    what the leanest layout needs per device) or ``no-layout`` (``message`` says why)."""

    point: Point
    cluster_name: str
    device: str
    status: str
    message: str = ""
    estimate: dict[str, Any] | None = None
    layout: dict[str, Any] | None = None
    plan_json: str | None = None
    leanest_bytes: float | None = None
    memory_budget_bytes: float = 0.0
    elapsed_s: float = 0.0
    """How long planning the point took (not part of the sweep's answer: it varies run to run)."""
    solved: dict[tuple[str, str], Solved] = field(default_factory=dict, repr=False)
    """Per training precision and ``Cluster.fabric_key``, the intra-op solves this point's caches hold (for the tasks
    after it)."""


#: A process's options and annotated graphs, its caches per (type, precision, fabric) and runtime filters.
_WORKER: dict[str, Any] = {"caches": {}, "filters": {}}


def _worker_init(options: PlanningOptions, graphs: dict[str, TypeGraph]) -> None:
    _WORKER.update(options=options, graphs=graphs, caches={}, filters={})


def plan_point(point: Point, solved: dict[tuple[str, str], Solved], options: PlanningOptions | None = None,
               graphs: dict[str, TypeGraph] | None = None) -> PointResult:
    """Plan ``point`` (in a worker: with the options and graphs its pool was started with), seeding this
    process's cache of the point's GPU type with ``solved``."""
    if options is not None and graphs is not None and _WORKER.get("graphs") is not graphs:
        _worker_init(options, graphs)
    options, graphs = _WORKER["options"], _WORKER["graphs"]
    start = time.perf_counter()
    graph = graphs[point.cluster].graph
    spec, ctx, batch, budget = options.setup(point.cluster, point.gpus)
    caches: dict[str, UnitCostCache] = {}
    fabric = spec.fabric_key()
    for training in training_precisions(options.precision, spec, ctx.framework):
        tried = dataclasses.replace(ctx, precision=dataclasses.replace(ctx.precision, training=training))
        key = (point.cluster, training, fabric)
        cache = _WORKER["caches"].get(key)
        if cache is None or not cache.serves(graph, spec, tried):
            cache = UnitCostCache(graph, spec, tried, options.solver, options.time_limit_s)
            _WORKER["caches"][key] = cache
        cache.seed(solved.get((training, fabric), {}))
        caches[training] = cache
    # the runtime's verdicts on an intra-op solution hold at every size: one filter per type and fabric
    runnable = _WORKER["filters"].get((point.cluster, fabric))
    if runnable is None:
        runnable = runtime_filter(graph, options.model_ref, options.config, spec, ctx, batch)
        _WORKER["filters"][(point.cluster, fabric)] = runnable
    result = PointResult(point, spec.name, spec.device, "ok", memory_budget_bytes=budget)
    try:
        plans, _, _ = plan_graph(graph, options.model_ref, options.config, spec, ctx, batch, budget,
                                 precision=options.precision, solver=options.solver,
                                 time_limit_s=options.time_limit_s, caches=caches, runnable=runnable)
        plan = plans[0]
        result.estimate, result.layout = plan.estimate, plan.layout
        result.plan_json = plan.to_json()
    except NoFitError as exc:
        result.status, result.message, result.leanest_bytes = "no-fit", str(exc), exc.leanest_bytes
    except AutoparError as exc:
        result.status, result.message = "no-layout", str(exc)
    result.solved = {(training, fabric): cache.solved() for training, cache in caches.items()}
    result.elapsed_s = time.perf_counter() - start
    return result


def run_points(points: list[Point], options: PlanningOptions, graphs: dict[str, TypeGraph], jobs: int = 1,
               ray_address: str | None = None, on_done: Callable[[PointResult], None] | None = None,
               ) -> list[PointResult]:
    """Plan every point, in this process (``jobs`` 1), a local pool of ``jobs`` processes, or as Ray tasks
    (``ray_address``: ``auto``, ``local`` or a cluster's address); results in the order of ``points``.  Each GPU
    type's smallest point goes first; the solves it returns go with the type's other points, largest first (the
    longest searches start early)."""
    firsts = {}
    for p in points:
        if p.cluster not in firsts or p.gpus < firsts[p.cluster].gpus:
            firsts[p.cluster] = p
    rest = sorted((p for p in points if p not in firsts.values()), key=lambda p: (-p.gpus, p.cluster))
    shared: Shared = {}
    done: dict[Point, PointResult] = {}

    def finished(result: PointResult) -> None:
        mine = shared.setdefault(result.point.cluster, {})
        for key, solves in result.solved.items():
            mine.setdefault(key, {}).update(solves)
        done[result.point] = result
        if on_done is not None:
            on_done(result)

    if ray_address is not None:
        _run_on_ray(list(firsts.values()), rest, options, graphs, ray_address, shared, finished)
    elif jobs <= 1 or len(points) <= 1:
        _worker_init(options, graphs)
        for p in [*firsts.values(), *rest]:
            finished(plan_point(p, shared.get(p.cluster, {})))
    else:
        _run_in_pool(list(firsts.values()), rest, options, graphs, jobs, shared, finished)
    return [done[p] for p in points]


def _run_in_pool(firsts: list[Point], rest: list[Point], options: PlanningOptions, graphs: dict[str, TypeGraph],
                 jobs: int, shared: Shared, finished: Callable[[PointResult], None]) -> None:
    context = multiprocessing.get_context("spawn")  # a forked worker may inherit a lock torch's threads held
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_worker_init,
                             initargs=(options, graphs)) as pool:
        for ready in _as_ready(firsts, rest, lambda p: pool.submit(plan_point, p, shared.get(p.cluster, {})),
                               jobs):
            finished(ready)


def _as_ready(firsts: list[Point], rest: list[Point], submit: Callable[[Point], Future], width: int,
              ) -> Iterator[PointResult]:
    """Run the first points, then each other point once its type's first point is done, ``width`` at a time."""
    waiting = list(rest)
    first_done: set[str] = set()
    running: dict[Future, Point] = {submit(p): p for p in firsts}
    while running:
        ready, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in sorted(ready, key=lambda f: (running[f].cluster, running[f].gpus)):
            point = running.pop(future)
            first_done.add(point.cluster)
            yield future.result()
        while waiting and len(running) < width:
            nxt = next((p for p in waiting if p.cluster in first_done), None)
            if nxt is None:
                break
            waiting.remove(nxt)
            running[submit(nxt)] = nxt
        if not running and waiting:  # cannot happen: every type's first point is submitted first
            raise RuntimeError("sweep points wait on a type that never ran")


def _run_on_ray(firsts: list[Point], rest: list[Point], options: PlanningOptions, graphs: dict[str, TypeGraph],
                address: str, shared: Shared, finished: Callable[[PointResult], None]) -> None:
    try:
        import ray
    except ModuleNotFoundError as exc:
        raise AutoparError("--ray needs Ray: pip install -c constraints.txt -e '.[ray]'") from exc
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=None if address == "local" else address, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise AutoparError(f"--ray {address}: no Ray cluster to join ({str(exc).splitlines()[0]}); start one "
                               "with 'ray start --head', or use --ray local") from exc
    try:
        options_ref, graphs_ref = ray.put(options), ray.put(graphs)  # once, through the object store
        remote = ray.remote(plan_point)
        width = max(1, int(ray.cluster_resources().get("CPU", 1)))
        refs: dict[Any, Future] = {}

        def submit(p: Point) -> Future:
            ref = remote.remote(p, ray.put(shared.get(p.cluster, {})), options_ref, graphs_ref)
            future = ref.future()
            refs[future] = ref
            return future

        for ready in _as_ready(firsts, rest, submit, width):
            finished(ready)
    finally:
        if started:
            ray.shutdown()


__all__ = ["PlanningOptions", "PointResult", "TypeGraph", "plan_point", "run_points"]
