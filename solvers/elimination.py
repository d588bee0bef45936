"""Exact solution of the intra-op problem by variable elimination with (memory, cost) Pareto fronts.  No torch.

The intra-op problem is a pairwise min-sum problem with one knapsack constraint (memory).  Where its
interaction graph has a small induced width, as graphs of element-wise ops and unrolled scans do, bucket
elimination solves it exactly in time linear in the number of nodes, where branch and bound over a knapsack
of a hundred memory choices can stall.  Memory enters as each strategy's excess over its node's least
(``excess``); a table entry holds, instead of one best cost, the Pareto front of (excess, cost) pairs, and any
pair whose excess exceeds the budget's slack is dropped.  Plain min-sum elimination on arrays (``_min_sum``) runs
first: without a budget, or where its cheapest choice fits the budget anyway, that choice is the answer.

Nodes are eliminated in a greedy min-fill order (ties: the smaller table, then the lower index).  Before any
work, the order's largest table is checked against ``max_table_entries``; while eliminating, the number of
front points formed is checked against ``max_points``.  Past either, :func:`solve_by_elimination` returns
``None`` and the caller solves the ILP instead.  Both limits count, they do not time, so the outcome does not
depend on the machine.
"""

from __future__ import annotations

import gc
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from autopar.solvers.request import SolverRequest

#: Relative rounding allowed against the budget (sums of floats in another order than the ILP's).
_MEMORY_RTOL = 1e-12
#: Largest table (product of the domain sizes of one elimination's scope) the solver builds.
MAX_TABLE_ENTRIES = 4096
#: Most front points formed in one solve.
MAX_POINTS = 2_000_000


#: A front point: (excess_bytes, cost_s, var, value, parts).  ``var`` is the variable eliminated to form it (-1
#: for a point of an original factor or a partial sum), ``value`` its strategy, ``parts`` the points it combined.
_Point = tuple[float, float, int, int, tuple]
_BY_EXCESS_COST = operator.itemgetter(0, 1)


@dataclass(slots=True)
class _Factor:
    scope: tuple[int, ...]
    table: dict[tuple[int, ...], list[_Point]]


class _TooLarge(Exception):
    pass


def solve_by_elimination(request: SolverRequest, max_table_entries: int = MAX_TABLE_ENTRIES,
                         max_points: int = MAX_POINTS) -> tuple[int, ...] | None:
    """An optimal choice for ``request``, or ``None`` if the elimination would exceed its limits or no choice fits
    the memory budget.  Ties go to the answer found first in a fixed order, so the same request gives the same
    answer."""
    n = len(request.node_names)
    least = [min(row) for row in request.memory_bytes]
    budget = request.memory_budget_bytes
    slack = float("inf") if budget is None else budget - sum(least) + _MEMORY_RTOL * abs(budget)
    if slack < 0:
        return None
    domains = request.strategy_counts
    order = _min_fill_order(n, [(i,) for i in range(n)] + list(request.edges), domains, max_table_entries)
    if order is None:
        return None
    unconstrained = _min_sum(request, order)
    if budget is None or sum(request.memory_bytes[i][s] for i, s in enumerate(unconstrained)) - sum(least) <= slack:
        return unconstrained  # the budget does not bind
    factors: list[_Factor] = []
    for i in range(n):
        table = {}
        for s, (c, m) in enumerate(zip(request.node_cost_s[i], request.memory_bytes[i], strict=True)):
            excess = m - least[i]
            table[(s,)] = [(excess, c, -1, 0, ())] if excess <= slack else []
        factors.append(_Factor((i,), table))
    for (u, v), mat in zip(request.edges, request.edge_cost_s, strict=True):
        factors.append(_Factor((u, v), {(s, t): [(0.0, c, -1, 0, ())] for s, row in enumerate(mat)
                                        for t, c in enumerate(row)}))
    collecting = gc.isenabled()
    gc.disable()  # the fronts are acyclic tuples that reference counting frees; the collector's passes cost 30 %
    try:
        done = _eliminate_all(order, factors, domains, slack, max_points)
    except _TooLarge:
        return None
    finally:
        if collecting:
            gc.enable()
    front = _sum_fronts([f.table[()] for f in done], slack, [0])
    if not front:
        return None
    best = min(front, key=operator.itemgetter(1))  # the front is sorted by excess: the first of equal costs wins
    return _read_back(best, n)


def _min_fill_order(n: int, scopes: list[tuple[int, ...]], domains: tuple[int, ...],
                    max_table_entries: int) -> list[int] | None:
    """A greedy min-fill elimination order, or ``None`` if one of its tables would exceed ``max_table_entries``."""
    adj: list[set[int]] = [set() for _ in range(n)]
    for scope in scopes:
        for a, b in itertools.combinations(scope, 2):
            adj[a].add(b)
            adj[b].add(a)

    def key(i: int) -> tuple[float, int, int]:
        size = math.prod(domains[j] for j in adj[i])
        if size > max_table_entries:  # not eliminable now: skip counting its fill (a hub's is quadratic)
            return math.inf, size, i
        return sum(1 for a, b in itertools.combinations(adj[i], 2) if b not in adj[a]), size, i

    keys = {i: key(i) for i in range(n)}
    order = []
    while keys:
        i = min(keys.values())[2]
        if keys.pop(i)[1] > max_table_entries:
            return None
        around = adj[i]
        changed = set(around)  # their neighbourhoods change; so does the fill of the common neighbours of a new edge
        for a, b in itertools.combinations(sorted(around), 2):
            if b not in adj[a]:
                changed |= adj[a] & adj[b]
                adj[a].add(b)
                adj[b].add(a)
        for j in around:
            adj[j].discard(i)
        changed.discard(i)
        for k in changed:
            keys[k] = key(k)
        order.append(i)
    return order


def _min_sum(request: SolverRequest, order: list[int]) -> tuple[int, ...]:
    """The cheapest choice without the memory budget: min-sum elimination on arrays (the first index wins ties)."""
    domains = request.strategy_counts
    holding: list[list[tuple[tuple[int, ...], np.ndarray]]] = [[] for _ in domains]
    for i, row in enumerate(request.node_cost_s):
        holding[i].append(((i,), np.asarray(row, dtype=np.float64)))
    for (u, v), mat in zip(request.edges, request.edge_cost_s, strict=True):
        factor = ((u, v), np.asarray(mat, dtype=np.float64))
        holding[u].append(factor)
        holding[v].append(factor)
    steps: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    for x in order:
        mine = holding[x]
        scope = tuple(sorted({j for f, _ in mine for j in f if j != x}))
        axes = (*scope, x)
        total = np.zeros([domains[j] for j in axes])
        for f, table in mine:
            total = total + _aligned(f, table, axes)
        steps.append((x, scope, total.argmin(axis=-1)))
        message = (scope, total.min(axis=-1))
        ids = {id(table) for _, table in mine}
        for j in scope:
            holding[j] = [g for g in holding[j] if id(g[1]) not in ids] + [message]
        holding[x] = []
    choice = [0] * len(domains)
    for x, scope, best in reversed(steps):
        choice[x] = int(best[tuple(choice[j] for j in scope)])
    return tuple(choice)


def _aligned(scope: tuple[int, ...], table: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """``table`` (over ``scope``) transposed and reshaped to broadcast over ``axes``."""
    position = {j: k for k, j in enumerate(axes)}
    perm = sorted(range(len(scope)), key=lambda k: position[scope[k]])
    shape = [1] * len(axes)
    for k in perm:
        shape[position[scope[k]]] = table.shape[k]
    return table.transpose(perm).reshape(shape)


def _eliminate_all(order: list[int], factors: list[_Factor], domains: tuple[int, ...], slack: float,
                   max_points: int) -> list[_Factor]:
    """Eliminate every variable in ``order``; returns the factors of empty scope left over."""
    holding: list[list[_Factor]] = [[] for _ in domains]  # the live factors that hold each variable
    done: list[_Factor] = []
    for f in factors:
        holding[f.scope[0]].append(f)
        for j in f.scope[1:]:
            holding[j].append(f)
    counter = [0]
    for x in order:
        mine = holding[x]
        scope = tuple(sorted({j for f in mine for j in f.scope if j != x}))
        where = {j: k for k, j in enumerate((*scope, x))}
        lookups = [(f.table, _projector(tuple(where[j] for j in f.scope))) for f in mine]
        table: dict[tuple[int, ...], list[_Point]] = {}
        for assign in itertools.product(*(range(domains[j]) for j in scope)):
            merged: list[_Point] = []
            for value in range(domains[x]):
                full = (*assign, value)
                for e, c, _, _, parts in _sum_fronts([t[get(full)] for t, get in lookups], slack, counter):
                    merged.append((e, c, x, value, parts))
            table[assign] = _pareto(merged) if len(merged) > 1 else merged
            if counter[0] > max_points:
                raise _TooLarge
        new = _Factor(scope, table)
        for f in mine:
            for j in f.scope:
                if j != x:
                    holding[j] = [g for g in holding[j] if g is not f]
        if scope:
            for j in scope:
                holding[j].append(new)
        else:
            done.append(new)
        holding[x] = []
    return done


def _projector(positions: tuple[int, ...]) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    """A function taking a full assignment to the entries at ``positions``, as a tuple."""
    if len(positions) == 1:
        k = positions[0]
        return lambda full: (full[k],)
    return operator.itemgetter(*positions)


def _sum_fronts(fronts: list[list[_Point]], slack: float, counter: list[int]) -> list[_Point]:
    """The Pareto front of every way to take one point of each front (each sorted by excess), within the slack; a
    point of the result keeps the pair it was summed from in ``parts``.  ``counter`` counts the pairs formed."""
    acc: list[_Point] = [(0.0, 0.0, -1, 0, ())]
    for front in fronts:
        if len(front) == 1 and len(acc) == 1:  # the common case: no memory choice left open
            p, q = acc[0], front[0]
            if p[0] + q[0] > slack:
                return []
            acc = [(p[0] + q[0], p[1] + q[1], -1, 0, (p, q))]
            counter[0] += 1
            continue
        counter[0] += len(acc) * len(front)
        sums = []
        for p in acc:
            room = slack - p[0]
            for q in front:
                if q[0] > room:
                    break  # the rest of the front holds more
                sums.append((p[0] + q[0], p[1] + q[1], -1, 0, (p, q)))
        acc = _pareto(sums)
        if not acc:
            return []
    return acc


def _pareto(points: list[_Point]) -> list[_Point]:
    """The points no other point beats in both excess and cost, by excess ascending (stable on ties)."""
    out: list[_Point] = []
    best = float("inf")
    for p in sorted(points, key=_BY_EXCESS_COST):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


def _read_back(point: _Point, n: int) -> tuple[int, ...]:
    """The strategies behind ``point``: each eliminated variable's value, from the points it was built on."""
    choice: list[int | None] = [None] * n
    stack = [point]
    while stack:
        _, _, var, value, parts = stack.pop()
        if var >= 0:
            choice[var] = value
        stack.extend(parts)
    assert all(c is not None for c in choice)
    return tuple(choice)  # type: ignore[arg-type]


__all__ = ["MAX_POINTS", "MAX_TABLE_ENTRIES", "solve_by_elimination"]
