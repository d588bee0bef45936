r"""The intra-op sharding ILP, with two interchangeable backends: PuLP (CBC or HiGHS) and OR-Tools CP-SAT.

Problem (one model for both backends; :class:`SolverRequest` holds the arrays)::

    minimize    sum_i sum_s c[i][s] x[i][s]  +  sum_(u,v) sum_(s,t) M[uv][s][t] y[uv][s][t]
    subject to  sum_s x[i][s] = 1                              for every node i        (_one_hot)
                sum_t y[uv][s][t] = x[u][s]                     for every edge, s       (_edge_marginals)
                sum_s y[uv][s][t] = x[v][t]                     for every edge, t       (_edge_marginals)
                sum_i sum_s m[i][s] x[i][s] <= budget                                    (_memory)
                x binary, y >= 0

The marginal ("joint distribution per edge") linearization is exact: with binary ``x`` the constraints
force ``y[uv][s][t] = x[u][s] x[v][t]``, and it solves far faster than ``y >= x_u + x_v - 1``.  Before
building, edges whose matrix is additive (``M[s][t] = a[s] + b[t]``, e.g. all-zero) are folded into the
node costs (:func:`fold_additive_edges`); they need no ``y`` at all.  Before that, exact reductions
(``autopar.solvers.presolve``: strategies the memory budget rules out or another dominates, leaf nodes folded
into their neighbour) shrink the problem; the answer is mapped back onto the original nodes.

CBC works on costs scaled to microseconds; CP-SAT on integers (nanoseconds, bytes).  Both run with one
thread and a fixed seed.  That alone does not make the answer unique: where several choices cost exactly
the same (symmetric shardings), CBC returned one or another from run to run, and their unit costs (which
price more than the ILP does) differ.  So every strategy pays ``TIE_BREAK_S`` per step of its index: ties go
to the lower index, and the same request gives the same answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import Literal

from autopar.solvers.elimination import solve_by_elimination
from autopar.solvers.evaluate import min_memory_bytes, objective_s
from autopar.solvers.presolve import presolve
from autopar.solvers.request import SolverRequest, SolverResult

Backend = Literal["cbc", "highs", "cpsat"]
BACKENDS: tuple[Backend, ...] = ("cbc", "highs", "cpsat")

_US = 1e6  # CBC objective scale: seconds -> microseconds
_NS = 1e9  # CP-SAT integer scale: seconds -> nanoseconds
_ADDITIVE_TOL = 1e-12  # seconds; below this an edge matrix counts as additive
#: Seconds a strategy pays per step of its index, to break exact ties.  One nanosecond: CP-SAT's unit, above
#: CBC's cut-off increment (1e-5 of its microsecond objective), and far below any difference that matters
#: (a few hundred nodes x a few dozen strategies: microseconds per solve at most).
TIE_BREAK_S = 1e-9


def fold_additive_edges(request: SolverRequest) -> tuple[list[list[float]], list[int]]:
    """Node costs with additive edges folded in, and the indices of the edges that stay."""
    cost = [list(row) for row in request.node_cost_s]
    kept = []
    for e, ((u, v), mat) in enumerate(zip(request.edges, request.edge_cost_s)):
        base = mat[0][0]
        additive = all(abs(mat[s][t] - mat[s][0] - mat[0][t] + base) <= _ADDITIVE_TOL
                       for s in range(len(mat)) for t in range(len(mat[0])))
        if not additive:
            kept.append(e)
            continue
        for s in range(len(mat)):
            cost[u][s] += mat[s][0]
        for t in range(len(mat[0])):
            cost[v][t] += mat[0][t] - base
    return cost, kept


def solve_ilp(request: SolverRequest, backend: Backend = "cbc", eliminate: bool = True) -> SolverResult:
    """Solve ``request`` exactly, by elimination where it is narrow enough (``eliminate``), else with ``backend``;
    infeasible memory budgets report the minimum memory needed."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r} (choose from {', '.join(BACKENDS)})")
    need = min_memory_bytes(request)
    if request.memory_budget_bytes is not None and need > request.memory_budget_bytes:
        return SolverResult(status="infeasible", solver=backend, min_memory_bytes=need,
                            num_variables=request.num_variables, num_constraints=request.num_constraints)
    broken = dataclasses.replace(request, node_cost_s=[[c + TIE_BREAK_S * k for k, c in enumerate(row)]
                                                       for row in request.node_cost_s])
    reduced = presolve(broken)
    result = _solve_by_elimination(reduced.request) if eliminate else None
    if result is None:
        result = _solve_cpsat(reduced.request) if backend == "cpsat" else _solve_pulp(reduced.request, backend)
    if not result.choice:
        return result
    result = dataclasses.replace(result, choice=reduced.expand(result.choice, len(request.node_names)))
    obj = objective_s(request, result.choice)  # reported without the tie-break
    # a solve stopped by its time limit: the solver's own bound where it gives one (CP-SAT), else the bound
    # every answer respects (each node at its cheapest strategy, edges at their cheapest pair)
    floor = sum(min(row) for row in request.node_cost_s) + sum(min(min(r) for r in mat) for mat in request.edge_cost_s)
    bound = max(result.bound_s or floor, floor) if result.status != "optimal" else result.bound_s
    bound = None if bound is None else min(bound, obj)
    return dataclasses.replace(result, objective_s=obj, bound_s=bound)


def _solve_by_elimination(request: SolverRequest) -> SolverResult | None:
    t0 = time.perf_counter()
    choice = solve_by_elimination(request)
    if choice is None:
        return None
    obj = objective_s(request, choice)
    return SolverResult(status="optimal", solver="elimination", choice=choice, objective_s=obj, bound_s=obj,
                        solve_time_s=time.perf_counter() - t0, num_variables=request.num_variables,
                        num_constraints=request.num_constraints)


def starting_choice(request: SolverRequest) -> tuple[int, ...]:
    """A choice that meets the memory budget, to start a solver from (CBC's warm start), so that a solve its time
    limit stops still has an answer: under a budget each node at its least memory (the cheaper on a tie), which
    ``solve_ilp`` has checked fits; without one, each at its cheapest."""
    if request.memory_budget_bytes is None:
        return tuple(min(range(len(row)), key=row.__getitem__) for row in request.node_cost_s)
    return tuple(min(range(len(mem)), key=lambda s, mem=mem, cost=cost: (mem[s], cost[s]))
                 for mem, cost in zip(request.memory_bytes, request.node_cost_s, strict=True))


def _solve_pulp(request: SolverRequest, backend: Backend) -> SolverResult:
    import pulp

    t0 = time.perf_counter()
    cost, kept = fold_additive_edges(request)
    prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
    x = [[pulp.LpVariable(f"x_{i}_{s}", cat="Binary") for s in range(len(row))] for i, row in enumerate(cost)]
    terms = [(x[i][s], c * _US) for i, row in enumerate(cost) for s, c in enumerate(row)]
    n_vars = sum(len(r) for r in x)
    n_cons = 0
    for i, row in enumerate(x):  # _one_hot
        prob += pulp.lpSum(row) == 1, f"one_hot_{i}"
        n_cons += 1
    for e in kept:  # _edge_marginals
        (u, v), mat = request.edges[e], request.edge_cost_s[e]
        y = [[pulp.LpVariable(f"y_{e}_{s}_{t}", lowBound=0) for t in range(len(mat[0]))] for s in range(len(mat))]
        n_vars += len(mat) * len(mat[0])
        for s in range(len(mat)):
            prob += pulp.lpSum(y[s]) == x[u][s], f"m_{e}_u_{s}"
        for t in range(len(mat[0])):
            prob += pulp.lpSum(y[s][t] for s in range(len(mat))) == x[v][t], f"m_{e}_v_{t}"
        n_cons += len(mat) + len(mat[0])
        terms += [(y[s][t], mat[s][t] * _US) for s in range(len(mat)) for t in range(len(mat[0])) if mat[s][t]]
    if request.memory_budget_bytes is not None:  # _memory
        prob += pulp.lpSum(m * x[i][s] for i, row in enumerate(request.memory_bytes)
                           for s, m in enumerate(row)) <= request.memory_budget_bytes, "memory"
        n_cons += 1
    prob += pulp.LpAffineExpression(terms)
    start = starting_choice(request)
    for i, row in enumerate(x):
        for s, var in enumerate(row):
            var.setInitialValue(1 if s == start[i] else 0)
    limit = max(1, int(request.time_limit_s))
    if backend == "highs":
        solver = pulp.HiGHS(msg=False, timeLimit=limit, threads=1, random_seed=0)
        with _quiet_stdout():  # highspy prints a banner from C++ even with msg=False
            prob.solve(solver)
    else:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, threads=1, warmStart=True,
                                   options=["randomSeed 0", "randomCbcSeed 0"])
        prob.solve(solver)
    elapsed = time.perf_counter() - t0
    sol = prob.sol_status
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        status = "infeasible" if sol == pulp.LpSolutionInfeasible else "timeout"
        return SolverResult(status=status, solver=backend, solve_time_s=elapsed, num_variables=n_vars,
                            num_constraints=n_cons, min_memory_bytes=min_memory_bytes(request))
    choice = tuple(max(range(len(row)), key=lambda s, row=row: row[s].value() or 0.0) for row in x)
    obj = objective_s(request, choice)
    optimal = sol == pulp.LpSolutionOptimal
    return SolverResult(status="optimal" if optimal else "feasible", solver=backend, choice=choice, objective_s=obj,
                        bound_s=obj if optimal else None, solve_time_s=elapsed, num_variables=n_vars,
                        num_constraints=n_cons)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1 (native libraries write to it directly, past ``sys.stdout``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solve_cpsat(request: SolverRequest) -> SolverResult:
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    cost, kept = fold_additive_edges(request)
    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x_{i}_{s}") for s in range(len(row))] for i, row in enumerate(cost)]
    n_vars = sum(len(r) for r in x)
    n_cons = 0
    objective = []
    offset = 0.0
    for i, row in enumerate(x):  # _one_hot
        model.AddExactlyOne(row)
        n_cons += 1
        lo = min(cost[i])  # shift each row so the integers stay small; add it back afterwards
        offset += lo
        objective += [round((c - lo) * _NS) * x[i][s] for s, c in enumerate(cost[i]) if c - lo > 0]
    for e in kept:  # _edge_marginals
        (u, v), mat = request.edges[e], request.edge_cost_s[e]
        y = [[model.NewBoolVar(f"y_{e}_{s}_{t}") for t in range(len(mat[0]))] for s in range(len(mat))]
        n_vars += len(mat) * len(mat[0])
        for s in range(len(mat)):
            model.Add(sum(y[s]) == x[u][s])
        for t in range(len(mat[0])):
            model.Add(sum(y[s][t] for s in range(len(mat))) == x[v][t])
        n_cons += len(mat) + len(mat[0])
        objective += [round(mat[s][t] * _NS) * y[s][t] for s in range(len(mat)) for t in range(len(mat[0]))
                      if round(mat[s][t] * _NS)]
    if request.memory_budget_bytes is not None:  # _memory
        model.Add(sum(round(m) * x[i][s] for i, row in enumerate(request.memory_bytes) for s, m in enumerate(row))
                  <= int(request.memory_budget_bytes))
        n_cons += 1
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = request.time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    elapsed = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        kind = "infeasible" if status == cp_model.INFEASIBLE else "timeout"
        return SolverResult(status=kind, solver="cpsat", solve_time_s=elapsed, num_variables=n_vars,
                            num_constraints=n_cons, min_memory_bytes=min_memory_bytes(request))
    choice = tuple(next(s for s, var in enumerate(row) if solver.Value(var)) for row in x)
    obj = objective_s(request, choice)
    bound = solver.BestObjectiveBound() / _NS + offset
    return SolverResult(status="optimal" if status == cp_model.OPTIMAL else "feasible", solver="cpsat",
                        choice=choice, objective_s=obj, bound_s=min(bound, obj), solve_time_s=elapsed,
                        num_variables=n_vars, num_constraints=n_cons)
