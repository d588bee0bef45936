"""Variable elimination with Pareto fronts (``autopar.solvers.elimination``) is exact: brute force on small random
problems, both ILP backends on an unrolled scan under a tight memory budget, and it declines what is too wide."""

from __future__ import annotations

import random

import pytest
from autopar.solvers.brute import solve_brute_force
from autopar.solvers.elimination import solve_by_elimination
from autopar.solvers.evaluate import memory_bytes, min_memory_bytes, objective_s, violations
from autopar.solvers.ilp import solve_ilp
from autopar.solvers.request import SolverRequest
from hypothesis import HealthCheck, given, settings
from solver_requests import solver_requests

#: up to 8 nodes, chains with random extra edges (dense ones included), tight or no budgets
requests = lambda: solver_requests(nodes=(1, 8), strategies=3, memory=4, extra_edges=10, chain=True,
                                   budget=lambda n: 3 * n)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_elimination_finds_the_brute_force_optimum(request):
    brute = solve_brute_force(request)
    choice = solve_by_elimination(request)
    if brute.status == "infeasible":
        assert choice is None
        return
    assert choice is not None
    assert violations(request, choice) == []
    assert objective_s(request, choice) == pytest.approx(brute.objective_s, abs=1e-9)


def _scan(steps: int, seed: int) -> SolverRequest:
    """A selective scan unrolled over ``steps``: a chain of states, each step also reading three hub tensors (the
    decay, the input and the output projection), each op with a memory choice, under 2 % over the least memory."""
    rng = random.Random(seed)
    names, cost, memory, edges, mats = [], [], [], [], []

    def node(name: str, k: int) -> int:
        names.append(name)
        cost.append(tuple(round(rng.uniform(0, 5), 3) for _ in range(k)))
        memory.append(tuple(float(rng.choice((1024, 2048, 4096, 8192))) for _ in range(k)))
        return len(names) - 1

    def edge(u: int, v: int) -> None:
        edges.append((u, v))
        mats.append(tuple(tuple(0.0 if s == t else round(rng.uniform(0.5, 3), 3) for t in range(len(cost[v])))
                          for s in range(len(cost[u]))))

    hubs = [node(f"hub{h}", 2) for h in range(3)]
    state = node("state0", 3)
    for t in range(steps):
        mul, add, out = node(f"mul{t}", 3), node(f"add{t}", 3), node(f"out{t}", 3)
        edge(hubs[0], mul), edge(state, mul), edge(mul, add), edge(hubs[1], add), edge(add, out), edge(hubs[2], out)
        state = add
    request = SolverRequest(node_names=tuple(names), node_cost_s=tuple(cost), memory_bytes=tuple(memory),
                            edges=tuple(edges), edge_cost_s=tuple(mats), time_limit_s=60)
    return SolverRequest(**{**_fields(request), "memory_budget_bytes": 1.02 * min_memory_bytes(request)})


def _fields(request: SolverRequest) -> dict:
    return {name: getattr(request, name) for name in request.__dataclass_fields__}


@pytest.mark.parametrize("seed", [0, 1])
def test_an_unrolled_scan_under_a_tight_budget_matches_both_ilp_backends(seed):
    request = _scan(steps=12, seed=seed)
    eliminated = solve_ilp(request)
    assert eliminated.solver == "elimination" and eliminated.status == "optimal"
    assert memory_bytes(request, eliminated.choice) <= request.memory_budget_bytes
    for backend in ("cbc", "cpsat"):
        ilp = solve_ilp(request, backend, eliminate=False)
        assert ilp.status == "optimal", backend
        assert eliminated.objective_s == pytest.approx(ilp.objective_s, abs=1e-6), backend


def test_a_long_scan_eliminates_exactly():
    """200 steps (601 ops): too many memory choices for branch and bound to prove in seconds; elimination proves it,
    and its answer is no worse than any answer that changes one op's strategy (a local check of optimality)."""
    request = _scan(steps=200, seed=3)
    choice = solve_by_elimination(request)
    assert choice is not None
    best = objective_s(request, choice)
    for i, row in enumerate(request.node_cost_s):
        for s in range(len(row)):
            other = (*choice[:i], s, *choice[i + 1:])
            if memory_bytes(request, other) <= request.memory_budget_bytes:
                assert objective_s(request, other) >= best - 1e-9


def test_it_declines_a_graph_wider_than_its_limits():
    n = 6  # a clique: every elimination's table holds all the others' strategies, 3^5 = 243 entries
    request = SolverRequest(node_names=tuple(f"n{i}" for i in range(n)), node_cost_s=((1.0, 2.0, 3.0),) * n,
                            memory_bytes=((2.0, 1.0, 0.0),) * n,
                            edges=tuple((u, v) for u in range(n) for v in range(u + 1, n)),
                            edge_cost_s=(((0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0)),) * (n * (n - 1) // 2),
                            memory_budget_bytes=6.0)  # binds: all at strategy 0 would need 12
    assert solve_by_elimination(request, max_table_entries=242) is None
    assert solve_by_elimination(request, max_points=100) is None  # the fronts under the budget
    best = solve_brute_force(request)
    assert solve_by_elimination(request) == best.choice == (1,) * n
    assert solve_ilp(request, eliminate=False).choice == best.choice


def test_a_two_layer_hf_mamba_plans_with_every_intra_op_solve_proved_optimal():
    """The unrolled scan left CBC at its time limit, 61 % from optimal; elimination proves every solve."""
    from pathlib import Path

    from autopar.passes import PassContext

    from autopar.cluster import load_cluster
    from autopar.frontend import trace_model
    from autopar.inter_op.search import search

    cluster = load_cluster("cpu").with_overrides(gpus=4)
    ctx = PassContext(cluster=cluster)
    traced = trace_model(str(Path(__file__).parent / "fixtures" / "hf_mamba.py"), {"seq_len": 32}, ctx=ctx)
    res = search(traced.graph, cluster, ctx, 256, {"tp": 4}, cluster.usable_memory_bytes)
    assert res.ilp_solves >= 2 and res.ilp_status == "optimal" and res.ilp_gap == 0.0
    assert res.best.estimate.layout.tp == 4
