"""The ILP's exact reductions (``autopar.solvers.presolve``) keep the optimum: brute force on the reduced problem,
mapped back, costs what brute force on the original costs."""

from __future__ import annotations

import pytest
from autopar.solvers.brute import solve_brute_force
from autopar.solvers.evaluate import objective_s, violations
from autopar.solvers.presolve import presolve
from autopar.solvers.request import SolverRequest
from hypothesis import HealthCheck, given, settings
from solver_requests import solver_requests

#: chains, ladders and hubs of up to 9 nodes (what element-wise ops and unrolled scans give the ILP)
sparse_requests = lambda: solver_requests(nodes=(2, 9), strategies=3, memory=3, extra_edges=4,
                                          chain=True, budget=lambda n: 2 * n)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_requests())
def test_the_reduced_problem_has_the_same_optimum(request):
    whole = solve_brute_force(request)
    reduced = presolve(request)
    part = solve_brute_force(reduced.request)
    assert (whole.status == "infeasible") == (part.status == "infeasible")
    if whole.status == "infeasible":
        return
    choice = reduced.expand(part.choice, len(request.node_names))
    assert violations(request, choice) == []
    assert objective_s(request, choice) == pytest.approx(whole.objective_s, abs=1e-9)


def test_a_chain_without_a_budget_collapses_to_one_node():
    n = 12
    request = SolverRequest(node_names=tuple(f"n{i}" for i in range(n)),
                            node_cost_s=tuple((1.0, 2.0, 0.5) for _ in range(n)),
                            memory_bytes=tuple((0.0, 1.0, 2.0) for _ in range(n)),
                            edges=tuple((i, i + 1) for i in range(n - 1)),
                            edge_cost_s=tuple(((0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0))
                                              for _ in range(n - 1)))
    reduced = presolve(request)
    assert len(reduced.request.node_names) == 1
    row = reduced.request.node_cost_s[0]
    best = min(range(len(row)), key=row.__getitem__)
    assert reduced.expand((best,), n) == (2,) * n  # all at the cheapest strategy, no resharding
