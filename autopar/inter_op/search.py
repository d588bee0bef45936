"""The inter-op search: every layout of N devices, estimated on unit costs from the intra-op ILP.

Search space (each key can be pinned with ``fixed``): the registered techniques
(``autopar.inter_op.techniques``) set their knobs in turn, each under the rules of its module, the one source for
this space, for the errors of pinned values (``check_fixed``) and, where the runtime checks them too, for
``autopar.runtime.support``:

- ``tp`` (``autopar.inter_op.tensor_parallel``): tiling an NVLink domain, and dividing the attention heads;
- sequence parallelism on/off with ``tp > 1`` (``sequence_parallel``); recomputation none / selective / op / full
  (``recompute``);
- ``cp`` (``context_parallel``); ``pp`` at most the number of layers, and with it ``dp``, so that
  ``pp x dp x cp x tp = N`` (``pipelining.STAGES``);
- ``ep`` for a model with stacked experts (``expert_parallel``); the micro-batch size ``mbs`` (divisors of
  ``global_batch / dp`` up to 16) and so ``m = B / (dp * mbs)``, and the ZeRO level (``data_parallel``);
- the pipeline schedule, ``v`` and the micro-batch groups (``pipelining``);

each as the framework implements it.

Unit costs depend only on ``(tp, mbs, sp)``.  The intra-op ILP chooses strategies per ``(tp, sp)`` at a
few reference micro-batch sizes, twice (fastest, and fastest among the leanest in memory); every layout
reuses them, re-costed at its own micro-batch size; the rest is arithmetic plus the stage DP.  Layouts are
estimated best first, in the order of their lower bound (``autopar.inter_op.bound``), until that bound cannot
beat the last candidate kept; a layout whose memory bound exceeds the budget is not estimated.  The layouts that
differ only in the schedule's knobs wait as one family under a floor of their bounds until it comes up.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import Cluster, MeshSpec
from autopar.collector import collector_paused
from autopar.framework import DEFAULT_FRAMEWORK, Framework, load_framework
from autopar.hf_masks import kv_heads_as_run
from autopar.inter_op import techniques
from autopar.inter_op.bound import UnitTotals, memory_bound_bytes, time_bound_s, unit_totals
from autopar.inter_op.estimate import Estimate, ModelFlops, SharedWork, estimate_layout
from autopar.inter_op.layout import Layout
from autopar.inter_op.technique import Partial, SearchSpace, Technique
from autopar.inter_op.tensor_parallel import attention_heads
from autopar.inter_op.unit_costs import UnitCost, solve_tp, unit_costs, unit_sequence
from autopar.inter_op.units import loop_args, unit_chain
from autopar.intra_op.problem import IntraOpProblem, IntraOpSolution
from autopar.intra_op.strategies import R, Strategy, param_tp_placements
from autopar.ir import OpGraph
from autopar.passes import run_pipeline
from autopar.passes.context import PassContext
from autopar.passes.experts import expert_parallel_count
from autopar.solvers.ilp import Backend

#: The ILP picks strategies at these micro-batch sizes; other sizes reuse the nearest (in log scale) and
#: only re-cost it.  The choice between sharding weights and activations moves with the batch slowly.
REFERENCE_MBS = (1, 4, 16)
VARIANTS = ("fast", "lean")  # ILP without memory limit, and at the least memory (+2 %)
#: A pool of ILP solvers runs only for graphs of at least this many ops.  Its spawned workers import torch
#: first (2.8 s on 2 cores), while a graph of a few hundred ops (a transformer's traced layers and ends) solves
#: all its ILPs in about that time in one process; graphs of many small ops (a state-space scan unrolled over
#: the sequence: 822 ops for 2 Mamba layers of 32 steps) take seconds per solve.
POOL_MIN_OPS = 500


@dataclass(frozen=True, slots=True)
class Candidate:
    estimate: Estimate
    variant: str  # which intra-op solution the unit costs came from
    strategies: dict[str, Strategy] = field(compare=False, repr=False, default_factory=dict)
    alternatives: dict[str, list[tuple[Strategy, float, float]]] = field(compare=False, repr=False,
                                                                         default_factory=dict)
    """Op name -> the ILP's next cheapest strategies for it (``IntraOpSolution.alternatives``)."""


@dataclass(slots=True)
class SearchResult:
    candidates: list[Candidate]
    evaluated: int
    ilp_solves: int
    solve_time_s: float
    ilp_status: str = "optimal"
    """The weakest status of the intra-op solves: ``optimal``, or ``feasible`` when a time limit stopped
    one before it proved optimality (no ILP: ``optimal``, the replicated layout is the only one)."""
    ilp_gap: float = 0.0
    """With ``feasible``: the largest relative gap between a stopped solve's answer and its lower bound."""
    enumerated: int = 0
    """Layouts (with their intra-op variants) the search space holds for this search."""
    pruned_bound: int = 0
    """Of those, the ones whose time bound could not beat the best found (never estimated)."""
    pruned_memory: int = 0
    """... and the ones whose memory bound exceeds the budget (never estimated, unless nothing fits)."""
    leanest: Candidate | None = None
    """When nothing fits: the layout that needs the least memory per device (``candidates`` hold the fastest)."""

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def same_fabric(a: Cluster, b: Cluster | None) -> bool:
    """Whether clusters ``a`` and ``b`` differ at most in their number of devices."""
    return b is not None and a.fabric_key() == b.fabric_key()


class UnitCostCache:
    """Unit costs per (tp, mbs, sp, variant), each from one intra-op solve."""

    def __init__(self, graph: OpGraph, cluster: Cluster, ctx: PassContext, backend: Backend,
                 time_limit_s: float) -> None:
        self.graph, self.cluster, self.ctx = graph, cluster, ctx
        self.backend, self.time_limit_s = backend, time_limit_s
        self._cache: dict[tuple, tuple[dict[str, UnitCost], dict[str, Strategy]]] = {}
        self._solved: dict[tuple, tuple[MeshSpec, dict[str, Strategy]]] = {}
        self._records: dict[tuple, tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]] = {}
        self._built: dict[tuple, IntraOpProblem] = {}  # the ILPs, shared by their fast and lean solves
        self._shards: dict[int, bool] = {}
        self.solves = 0
        self.statuses: set[str] = set()
        self.gap = 0.0  # the largest relative optimality gap of a solve a time limit stopped
        self._alternatives: dict[int, dict[str, list[tuple[Strategy, float, float]]]] = {}
        self.progress: Callable[[str], None] | None = None  # told of each intra-op solve as it starts
        self._untensored: OpGraph | None = None

    def serves(self, graph: OpGraph, cluster: Cluster, ctx: PassContext) -> bool:
        """Whether these unit costs hold for ``graph`` on ``cluster`` under ``ctx``: the same graph (by its
        fingerprint: the model traced again, or in another process) and context on a cluster that differs at most
        in its size (a tp group's links depend on its nodes, not on how many there are)."""
        return ((graph is self.graph or graph.fingerprint() == self.graph.fingerprint())
                and same_fabric(cluster, self.cluster)
                and (ctx.cluster is None) == (self.ctx.cluster is None)
                and (ctx.cluster is None or same_fabric(ctx.cluster, self.ctx.cluster))
                and dataclasses.replace(ctx, cluster=None) == dataclasses.replace(self.ctx, cluster=None))

    def solved(self) -> dict[tuple, tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]]:
        """The intra-op solves done so far, by ``solve_key``: what ``seed`` gives another cache of the same graph,
        cluster fabric and context (in another process: they pickle)."""
        return dict(self._records)

    def seed(self, solved: dict[tuple, tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]]) -> None:
        """Take solves another cache made (``solved``) as if this one had made them (they are not counted as
        this cache's solves)."""
        for key, entry in sorted(solved.items()):
            if key not in self._solved:
                solves = self.solves
                self._record(key, entry)
                self.solves = solves

    @staticmethod
    def solve_key(tp: int, mbs: int, sp: bool, variant: str) -> tuple[int, int, bool, str]:
        """The intra-op solve that serves ``(tp, mbs, sp, variant)``: the reference micro-batch nearest ``mbs``."""
        ref = min(REFERENCE_MBS, key=lambda r: (abs(math.log2(r) - math.log2(mbs)), r))
        return (tp, ref, sp, variant if tp > 1 else "fast")

    def strategies(self, tp: int, mbs: int, sp: bool, variant: str) -> tuple[MeshSpec, dict[str, Strategy]]:
        """The ILP's strategies, solved at the reference micro-batch nearest ``mbs``."""
        key = self.solve_key(tp, mbs, sp, variant)
        if key not in self._solved:
            if self.progress is not None and tp > 1:
                self.progress(f"solving the intra-op ILP: tp={tp}, micro-batch {key[1]}, sp={'on' if sp else 'off'}, "
                              f"{variant}")
            self._record(key, _solve(self.graph, self.cluster, self.ctx, self.backend, self.time_limit_s, key,
                                     self._built))
        return self._solved[key]

    def solve_all(self, keys: list[tuple[int, int, bool, str]], jobs: int) -> None:
        """Solve the intra-op ILPs of ``keys`` (``solve_key``s) that are not solved yet in a pool of ``jobs``
        processes; each answer is the one a solve in this process gives (the solves are deterministic)."""
        todo = sorted({k for k in keys if k not in self._solved and k[0] > 1})
        if jobs <= 1 or len(todo) <= 1 or sum(1 for _ in self.graph.ops()) < POOL_MIN_OPS:
            return
        if self.progress is not None:
            self.progress(f"solving {len(todo)} intra-op ILPs in {min(jobs, len(todo))} processes")
        context = multiprocessing.get_context("spawn")  # a forked worker may inherit a lock torch's threads held
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context, initializer=_pool_init,
                                 initargs=(self.graph, self.cluster, self.ctx, self.backend,
                                           self.time_limit_s)) as pool:
            for key, solved in zip(todo, pool.map(_pool_solve, todo), strict=True):
                self._record(key, solved)

    def _record(self, key: tuple, solved: tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]) -> None:
        mesh, strategies, sol = solved
        self._records[key] = solved
        if sol is not None:
            self._alternatives[id(strategies)] = sol.alternatives
            self.solves += 1
            self.statuses.add(sol.result.status)
            r = sol.result
            if r.status != "optimal" and r.objective_s and r.bound_s is not None:
                self.gap = max(self.gap, (r.objective_s - r.bound_s) / r.objective_s)
        self._solved[key] = (mesh, strategies)

    def alternatives(self, strategies: dict[str, Strategy]) -> dict[str, list[tuple[Strategy, float, float]]]:
        """The next cheapest strategies of each op of one of this cache's solutions (none for tp = 1)."""
        return self._alternatives.get(id(strategies), {})

    def shards_parameters(self, strategies: dict[str, Strategy]) -> bool:
        """``shards_parameters_on_tp`` of one of this cache's solutions, walked once per solution."""
        key = id(strategies)  # the solutions live as long as the cache
        if key not in self._shards:
            self._shards[key] = shards_parameters_on_tp(self.graph, strategies)
        return self._shards[key]

    def get(self, tp: int, mbs: int, sp: bool, variant: str) -> tuple[dict[str, UnitCost], dict[str, Strategy]]:
        """Unit costs and the strategies of every op of the graph at ``(tp, mbs, sp, variant)``.  Without tp the
        costs are read off the graph the model runs then (``untensored_graph``)."""
        key = (tp, mbs, sp, variant if tp > 1 else "fast")
        if key not in self._cache:
            mesh, strategies = self.strategies(tp, mbs, sp, variant)
            graph = self.untensored_graph() if tp == 1 else self.graph
            costed = strategies if graph is self.graph else solve_tp(graph, self.cluster, self.ctx, 1, mbs, sp)[1]
            self._cache[key] = (unit_costs(graph, costed, mesh, mbs, self.cluster, self.ctx), strategies)
        return self._cache[key]

    def untensored_graph(self) -> OpGraph:
        """The graph as the model runs without tensor-parallel regions, annotated: HuggingFace's grouped-query
        attention on the fewer key/value heads (``autopar.hf_masks.kv_heads_as_run``); else the graph itself."""
        if self._untensored is None:
            rewritten = kv_heads_as_run(self.graph)
            self._untensored = self.graph if rewritten is None else run_pipeline(rewritten, self.ctx)
        return self._untensored


def _solve(graph: OpGraph, cluster: Cluster, ctx: PassContext, backend: Backend, time_limit_s: float,
           key: tuple[int, int, bool, str], built: dict[tuple, IntraOpProblem] | None = None,
           ) -> tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]:
    tp, ref, sp, variant = key
    return solve_tp(graph, cluster, ctx, tp, ref, sp, backend, time_limit_s, grad_sync_weight=1 / 16,
                    memory_slack=0.02 if variant == "lean" else None, built=built)


_POOL: dict[str, Any] = {}  # a pool worker's graph, cluster, context, backend and time limit


def _pool_init(graph: OpGraph, cluster: Cluster, ctx: PassContext, backend: Backend, time_limit_s: float) -> None:
    _POOL.update(args=(graph, cluster, ctx, backend, time_limit_s))


def _pool_solve(key: tuple[int, int, bool, str]) -> tuple[MeshSpec, dict[str, Strategy], IntraOpSolution | None]:
    return _solve(*_POOL["args"], key)


def default_jobs() -> int:
    """Processes ``--jobs`` defaults to: the cores this process may use, less one, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def search_space(graph: OpGraph, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
                 fw: Framework | None = None) -> SearchSpace:
    """What the techniques' options read for this model, cluster, batch and pinned values."""
    return SearchSpace(gpus=cluster.gpus, layers=max(1, unit_chain(graph).blocks), global_batch=global_batch,
                       seq_len=graph.seq_len, heads=tuple(attention_heads(graph)),
                       experts=expert_parallel_count(graph), cluster=cluster,
                       fw=fw or load_framework(DEFAULT_FRAMEWORK), fixed=dict(fixed),
                       one_microbatch=graph.loss_gathers_batch,
                       layer_loop=any(loop_args(graph, s.container) for s in unit_chain(graph).stacks))


def check_fixed(graph: OpGraph, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
                fw: Framework | None = None) -> None:
    """Clear errors for pinned values that cannot work, each technique's in the registry's order."""
    space = search_space(graph, cluster, global_batch, fixed, fw)
    for technique in techniques.TECHNIQUES:
        if technique.check_fixed is not None:
            technique.check_fixed(space, graph)


def expert_parallel_runs(layout: Layout, costs: dict[str, UnitCost]) -> bool:
    """Whether the runtime's ``ExpertParallel`` runs ``layout.ep`` on these unit costs' tp strategies: every
    expert weight whole or split on the expert dimension on tp, its experts per tp rank divisible by ep."""
    if layout.ep <= 1:
        return True
    counts = [c for u in costs.values() for c in u.expert_counts]
    alike = all(len(set(u.expert_counts)) <= 1 for u in costs.values())  # a module's weights split alike
    return bool(counts) and alike and all(c > 0 and c % layout.ep == 0 for c in counts)


def layouts(graph: OpGraph, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
            fw: Framework | None = None) -> Iterator[Layout]:
    """Every layout of the search space that satisfies ``fixed`` (and, for unpinned knobs, that the framework
    implements): each technique, in the registry's order, sets its knobs on the partial layouts before it."""
    for family in layout_families(graph, cluster, global_batch, fixed, fw):
        for p in family:
            yield Layout.of(p)


def layout_families(graph: OpGraph, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
                    fw: Framework | None = None) -> list[list[Partial]]:
    """``layouts``' knob values (in their order), grouped by all but the last registered technique's knobs: the
    layouts of one family differ only in those (the pipeline schedule, ``v`` and groups).  No empty family."""
    space = search_space(graph, cluster, global_batch, fixed, fw)
    partials: list[Partial] = [{}]
    last = last_expanding_technique()
    for technique in techniques.TECHNIQUES:
        if technique.expand is not None and technique is not last:
            partials = [q for p in partials for q in technique.expand(space, p)]
    families = [list(last.expand(space, p)) for p in partials]  # type: ignore[misc]
    return [f for f in families if f]


def last_expanding_technique() -> Technique:
    """The registered technique that sets its knobs last: the one whose knobs tell a family's layouts apart."""
    return [t for t in techniques.TECHNIQUES if t.expand is not None][-1]


def shards_parameters_on_tp(graph: OpGraph, strategies: dict[str, Strategy]) -> bool:
    """Whether an intra-op solution places any parameter other than replicated on tp."""
    return any(p != R for p in param_tp_placements(graph, strategies).values())


def runtime_runs(layout: Layout, shards_parameters: bool) -> bool:
    """Whether autopar's runtime can run an intra-op solution (``shards_parameters``: whether it shards any
    parameter on tp) as the plan would price it.  A solution that replicates every parameter on tp is run
    with that axis as data parallelism (``autopar.runtime.apply.run_shape``), which needs the micro-batch
    to split over tp."""
    return layout.tp == 1 or layout.mbs % layout.tp == 0 or shards_parameters


def _totals(costs: dict[str, UnitCost], counts: dict[str, int], layout: Layout, cluster: Cluster, ctx: PassContext,
            shared: SharedWork, memo: dict[tuple, UnitTotals]) -> UnitTotals:
    """The unit totals ``layout``'s bounds read (``autopar.inter_op.bound``), once per unit costs and the layout
    keys they depend on."""
    costs = shared.shares(costs, layout, cluster)
    key = (id(costs), layout.recompute, layout.sp, layout.ep)  # ``shared`` keeps ``costs`` alive
    if key not in memo:
        memo[key] = unit_totals(costs, counts, layout, ctx)
    return memo[key]


@dataclass(slots=True)
class _Family:
    """Layouts of one variant that differ only in the deferred technique's knobs, with their unit costs' totals."""

    members: list[Partial]
    variant: str
    totals: UnitTotals


class _Queue:
    """A search's layouts, best first in their time bound.  A family of layouts that differ only in the last
    registered technique's knobs (``layout_families``) waits under its floor (``time_bound_s`` with that technique
    ``deferred``), which no member's bound is under, and is opened into its layouts when it comes up: a family whose
    floor cannot beat the cut-off is never looked at layout by layout.  Pops are in the order of the bounds, ties
    by the layout's knobs and the variant; ``exhaustive`` (or a last technique with no floor) opens every family at
    once."""

    def __init__(self, cluster: Cluster, ctx: PassContext, shared: SharedWork, counts: dict[str, int],
                 exhaustive: bool) -> None:
        self.cluster, self.ctx, self.shared, self.counts = cluster, ctx, shared, counts
        last = last_expanding_technique()
        self.deferred = last if last.time_bound_floor_s is not None and not exhaustive else None
        self.enumerated = 0
        self._heap: list[tuple[float, tuple, str, int, Any]] = []
        self._order = itertools.count()  # the last tie-break: a family and its layout may tie on all else
        self._families: list[_Family] = []
        self._totals_memo: dict[tuple, UnitTotals] = {}
        self._bound_memo: dict[tuple, float] = {}  # keyed on ids of ``_totals_memo``'s totals and ``shared``'s links

    def add_family(self, members: list[Partial], first: Layout, variant: str, costs: dict[str, UnitCost]) -> None:
        """Queue ``members`` (``first``: the first one's layout) on ``costs``, one variant's."""
        family = _Family(members, variant, self._totals(costs, first))
        self._families.append(family)
        self.enumerated += len(members)
        if self.deferred is None or len(members) == 1:
            self.open(family, first)
            return
        links = self.shared.links(self.cluster, first)
        floor = time_bound_s(family.totals, first, self.cluster, self.ctx, links, self._bound_memo, self.deferred)
        heapq.heappush(self._heap, (floor, _layout_key(first), variant, next(self._order), family))

    def open(self, family: _Family, first: Layout | None = None) -> None:
        """Queue each of ``family``'s layouts under its own bound."""
        for i, p in enumerate(family.members):
            layout = first if i == 0 and first is not None else Layout.of(p)
            bound = time_bound_s(family.totals, layout, self.cluster, self.ctx, self.shared.links(self.cluster, layout),
                                 self._bound_memo)
            heapq.heappush(self._heap, (bound, _layout_key(layout), family.variant, next(self._order),
                                        (layout, family.totals)))

    def pop(self) -> tuple[float, str, Layout | None, Any] | None:
        """The next ``(bound, variant, layout, totals)``, or ``(bound, variant, None, family)`` for a family to
        ``open``; ``None`` when the queue is empty."""
        if not self._heap:
            return None
        bound, _, variant, _, item = heapq.heappop(self._heap)
        if isinstance(item, _Family):
            return bound, variant, None, item
        return bound, variant, item[0], item[1]

    def every_layout(self) -> list[tuple[float, tuple, str, Layout, UnitTotals]]:
        """Every queued layout with its bound, sorted as the pops would come (for a search where nothing fits)."""
        out = []
        for family in self._families:
            for p in family.members:
                layout = Layout.of(p)
                bound = time_bound_s(family.totals, layout, self.cluster, self.ctx,
                                     self.shared.links(self.cluster, layout), self._bound_memo)
                out.append((bound, _layout_key(layout), family.variant, layout, family.totals))
        return sorted(out, key=lambda q: q[:3])

    def _totals(self, costs: dict[str, UnitCost], layout: Layout) -> UnitTotals:
        return _totals(costs, self.counts, layout, self.cluster, self.ctx, self.shared, self._totals_memo)


@dataclass
class _Estimator:
    """One search's way from a queued layout to a candidate: the unit costs of its tp solve, the runtime's
    verdict, the estimate and the runtime's check of it.  ``evaluated`` counts the estimates made."""

    graph: OpGraph
    cache: UnitCostCache
    global_batch: int
    cluster: Cluster
    ctx: PassContext
    memory_budget_bytes: float
    flops: ModelFlops
    sequence: list[str]
    shared: SharedWork
    accept: Callable[[Estimate, dict[str, Strategy]], bool] | None
    may_accept: Callable[[Layout, dict[str, Strategy]], bool] | None
    exhaustive: bool
    evaluated: int = 0

    def candidate(self, layout: Layout, variant: str, fitting: bool = False, **options: Any) -> Candidate | None:
        """``layout``'s candidate, or ``None`` where the runtime refuses it, ``estimate_layout`` (given
        ``options``) prunes it, or ``fitting`` asks for one that fits and it does not."""
        costs, strategies = self.cache.get(layout.tp, layout.mbs, layout.sp, variant)
        if self.may_accept is not None and not self.exhaustive and not self.may_accept(layout, strategies):
            return None  # the runtime cannot run it: it would not be kept
        est = estimate_layout(self.graph, costs, layout, self.global_batch, self.cluster, self.ctx,
                              self.memory_budget_bytes, self.flops, keys=self.sequence, shared=self.shared, **options)
        self.evaluated += 1
        if est is None or (fitting and not est.fits) or (self.accept is not None and not self.accept(est, strategies)):
            return None
        return Candidate(est, variant, strategies, self.cache.alternatives(strategies))


@collector_paused()
def search(graph: OpGraph, cluster: Cluster, ctx: PassContext, global_batch: int, fixed: dict[str, Any],
           memory_budget_bytes: float, backend: Backend = "cbc", time_limit_s: float = 60.0, top_k: int = 1,
           progress: Callable[[str], None] | None = None, cache: UnitCostCache | None = None,
           accept: Callable[[Estimate, dict[str, Strategy]], bool] | None = None,
           exhaustive: bool = False, jobs: int = 1,
           may_accept: Callable[[Layout, dict[str, Strategy]], bool] | None = None) -> SearchResult:
    """The ``top_k`` fastest layouts that fit (or, if none fits, the closest ones marked ``fits=False``).

    ``cache``: unit costs (and the intra-op solves behind them) to reuse across searches of the same graph,
    tensor-parallel fabric and context; its solves are counted from zero here either way.  ``accept``: a
    candidate is kept only if it says so (the runtime that will train the plan can run it); ``may_accept``: False
    for a layout ``accept`` is known to refuse, which is then not estimated.  ``exhaustive``:
    estimate every layout in full, with no lower bound or cut-off (slow: it checks that they prune nothing
    that would win).  ``jobs``: processes that solve the intra-op ILPs (the same answers as one process)."""
    t0 = time.perf_counter()
    check_fixed(graph, cluster, global_batch, fixed, ctx.framework)
    if cache is None or not cache.serves(graph, cluster, ctx):
        cache = UnitCostCache(graph, cluster, ctx, backend, time_limit_s)
    cache.progress = progress
    solves_before = cache.solves
    sequence = unit_sequence(graph)
    flops = ModelFlops.of(graph)
    shared = SharedWork()
    fitting: list[Candidate] = []
    spill: list[Candidate] = []  # filled only when nothing fits
    pruned_bound = pruned_memory = 0
    estimator = _Estimator(graph, cache, global_batch, cluster, ctx, memory_budget_bytes, flops, sequence, shared,
                           accept, may_accept, exhaustive)
    # best first: every layout's lower bound, then the layouts in its order, until the bound of the next one
    # cannot beat the K-th best found (the rest cannot either); a layout whose memory bound exceeds the budget
    # cannot fit and is not estimated (unless nothing fits).  The layouts that differ only in the last technique's
    # knobs (the schedule's) wait as one family, under the least bound any of them can have, until it comes up
    counts = {k: sequence.count(k) for k in dict.fromkeys(sequence)}
    queue = _Queue(cluster, ctx, shared, counts, exhaustive)
    families = layout_families(graph, cluster, global_batch, fixed, ctx.framework)
    if jobs > 1:  # one process solves each ILP when the queue first asks for it
        firsts = [Layout.of(f[0]) for f in families]
        cache.solve_all(sorted({cache.solve_key(lay.tp, lay.mbs, lay.sp, v) for lay in firsts for v in VARIANTS}),
                        jobs)
    for family in families:
        first = Layout.of(family[0])  # the family's tp, mbs, sp, cp, ep, recomputation, ZeRO level and stages
        for variant in VARIANTS if first.tp > 1 else VARIANTS[:1]:
            costs, strategies = cache.get(first.tp, first.mbs, first.sp, variant)
            if runtime_runs(first, cache.shards_parameters(strategies)) and expert_parallel_runs(first, costs):
                queue.add_family(family, first, variant, costs)
    popped = 0
    while (item := queue.pop()) is not None:
        bound, variant, layout, held = item
        # the cut-off is the last of the bucket kept, not the K-th best: the kept candidates are re-estimated with
        # their bubbles simulated and ranked again, so the bucket must hold what an exhaustive search's holds
        full = len(fitting) >= _bucket_size(top_k) and not exhaustive
        cutoff = fitting[-1].estimate.iteration_time_s if full else None
        if cutoff is not None and bound > cutoff:  # a tie may still win on memory (``_rank``)
            break
        if layout is None:  # a family: its layouts join the queue, each under its own bound
            queue.open(held)
            continue
        popped += 1
        if not exhaustive and memory_bound_bytes(held, layout, ctx) > memory_budget_bytes:
            pruned_memory += 1
            continue
        before = estimator.evaluated
        cand = estimator.candidate(layout, variant, fitting=True, allow_spill=False, prune_above_s=cutoff)
        if progress is not None and estimator.evaluated > before:
            progress(f"searching layouts: {estimator.evaluated} evaluated")
        if cand is not None:
            _keep(fitting, cand, top_k, _rank)
    pruned_bound = queue.enumerated - popped
    evaluated = estimator.evaluated  # the estimates of the search proper (not those made after nothing fit)
    leanest = None
    if not fitting:
        # nothing fits: the fastest layouts, marked as not fitting (best first in their time bound, as above), and
        # apart from them the leanest one (best first in its memory bound): what the error says a layout needs
        everything = queue.every_layout()
        for bound, _, variant, layout, _ in everything:
            cutoff = spill[-1].estimate.iteration_time_s if len(spill) >= _bucket_size(top_k) else None
            if cutoff is not None and bound > cutoff and not exhaustive:
                break
            cand = estimator.candidate(layout, variant, prune_above_s=None if exhaustive else cutoff)
            if cand is not None:
                _keep(spill, cand, top_k, _rank)
        leanest = _leanest(everything, estimator)
    # the closed-form bubble is exact only for equal stages: the candidates kept are re-estimated with their
    # schedules simulated op by op (as the timeline draws them) and ranked again
    fitting = sorted(_exact(fitting, graph, cache, global_batch, cluster, ctx, memory_budget_bytes, flops),
                     key=_rank)
    spill = _exact(spill, graph, cache, global_batch, cluster, ctx, memory_budget_bytes, flops)
    chosen = _distinct(fitting, top_k) if fitting else _distinct(sorted(spill, key=_spill_rank), top_k)
    status = "feasible" if cache.statuses - {"optimal"} else "optimal"
    return SearchResult(chosen, evaluated, cache.solves - solves_before, time.perf_counter() - t0, status,
                        cache.gap if status != "optimal" else 0.0, enumerated=queue.enumerated,
                        pruned_bound=pruned_bound, pruned_memory=pruned_memory, leanest=leanest)


def _leanest(queue: list[tuple[float, tuple, str, Layout, UnitTotals]], estimator: _Estimator) -> Candidate | None:
    """The layout that needs the least memory per device: the layouts in the order of their memory bound, until
    the next bound exceeds the least found (``exhaustive``: all of them)."""
    best: Candidate | None = None
    ctx = estimator.ctx
    for bound, _, variant, layout in sorted((memory_bound_bytes(t, lay, ctx), key, variant, lay)
                                            for _, key, variant, lay, t in queue):
        if best is not None and bound > best.estimate.peak_memory_bytes and not estimator.exhaustive:
            break  # no layout left can need less
        cand = estimator.candidate(layout, variant)
        if cand is not None and (best is None or _spill_rank(cand) < _spill_rank(best)):
            best = cand
    return best


def _exact(cands: list[Candidate], graph: OpGraph, cache: UnitCostCache, global_batch: int, cluster: Cluster,
           ctx: PassContext, memory_budget_bytes: float, flops: ModelFlops) -> list[Candidate]:
    """``cands`` with the pipelined ones re-estimated with their bubble simulated (``exact_bubble``)."""
    out = []
    for c in cands:
        lay = c.estimate.layout
        if lay.pp > 1:
            costs, _ = cache.get(lay.tp, lay.mbs, lay.sp, c.variant)
            est = estimate_layout(graph, costs, lay, global_batch, cluster, ctx, memory_budget_bytes, flops,
                                  exact_bubble=True)
            c = dataclasses.replace(c, estimate=est) if est is not None else c
        out.append(c)
    return out


def _bucket_size(top_k: int) -> int:
    """Candidates a search keeps for the final ranking: a few times ``top_k``, as the variants of one layout and
    the simulated bubbles may reorder them."""
    return max(top_k, 1) * 4


def _keep(bucket: list[Candidate], candidate: Candidate, top_k: int, rank: Callable[[Candidate], tuple]) -> None:
    """Add ``candidate`` to ``bucket``, kept sorted by ``rank`` and ``_bucket_size(top_k)`` long."""
    bucket.append(candidate)
    bucket.sort(key=rank)
    del bucket[_bucket_size(top_k):]


def _layout_key(layout: Layout) -> tuple:
    return (layout.dp, layout.tp, layout.cp, layout.ep, layout.pp, layout.mbs, layout.num_microbatches,
            layout.schedule, layout.v, layout.group, layout.recompute, layout.sp, layout.zero)


def _rank(c: Candidate) -> tuple:
    e = c.estimate
    return (e.iteration_time_s, e.peak_memory_bytes, _layout_key(e.layout), c.variant)


def _spill_rank(c: Candidate) -> tuple:
    e = c.estimate
    return (e.peak_memory_bytes, e.iteration_time_s, _layout_key(e.layout))


def _distinct(cands: list[Candidate], k: int) -> list[Candidate]:
    out, seen = [], set()
    for c in cands:
        key = c.estimate.layout
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == k:
            break
    return out


__all__ = ["Candidate", "SearchResult", "UnitCostCache", "check_fixed", "default_jobs", "expert_parallel_runs",
           "layouts", "runtime_runs", "same_fabric", "search", "shards_parameters_on_tp"]
