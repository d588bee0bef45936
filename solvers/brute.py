"""Exhaustive search over all strategy combinations: the reference the ILP is tested against."""

from __future__ import annotations

import itertools
import math
import time

from autopar.solvers.evaluate import memory_bytes, min_memory_bytes, objective_s
from autopar.solvers.request import SolverRequest, SolverResult

MAX_COMBINATIONS = 2_000_000


def solve_brute_force(request: SolverRequest) -> SolverResult:
    """Try every combination (refuses problems with more than ``MAX_COMBINATIONS``)."""
    counts = request.strategy_counts
    if math.prod(counts) > MAX_COMBINATIONS:
        raise ValueError(f"{math.prod(counts)} combinations: too many for brute force")
    t0 = time.perf_counter()
    best, best_cost = None, math.inf
    for choice in itertools.product(*(range(c) for c in counts)):
        if request.memory_budget_bytes is not None and memory_bytes(request, choice) > request.memory_budget_bytes:
            continue
        cost = objective_s(request, choice)
        if cost < best_cost - 1e-15:
            best, best_cost = choice, cost
    elapsed = time.perf_counter() - t0
    if best is None:
        return SolverResult(status="infeasible", solver="brute", solve_time_s=elapsed,
                            min_memory_bytes=min_memory_bytes(request))
    return SolverResult(status="optimal", solver="brute", choice=tuple(best), objective_s=best_cost,
                        bound_s=best_cost, solve_time_s=elapsed)
