"""Independent checker: recompute a choice's objective and list the constraints it violates."""

from __future__ import annotations

from autopar.solvers.request import SolverRequest


def objective_s(request: SolverRequest, choice: tuple[int, ...]) -> float:
    """Node costs plus edge costs of ``choice``."""
    total = sum(request.node_cost_s[i][s] for i, s in enumerate(choice))
    for (u, v), mat in zip(request.edges, request.edge_cost_s):
        total += mat[choice[u]][choice[v]]
    return total


def memory_bytes(request: SolverRequest, choice: tuple[int, ...]) -> float:
    return sum(request.memory_bytes[i][s] for i, s in enumerate(choice))


def violations(request: SolverRequest, choice: tuple[int, ...]) -> list[str]:
    """Human-readable list of what ``choice`` breaks (empty when it is valid)."""
    out = []
    if len(choice) != len(request.node_names):
        return [f"choice has {len(choice)} entries for {len(request.node_names)} nodes"]
    for i, s in enumerate(choice):
        if not 0 <= s < request.strategy_counts[i]:
            out.append(f"{request.node_names[i]}: strategy {s} out of range")
    if request.memory_budget_bytes is not None and not out:
        used = memory_bytes(request, choice)
        if used > request.memory_budget_bytes * (1 + 1e-9):
            out.append(f"memory {used:.3e} B exceeds budget {request.memory_budget_bytes:.3e} B")
    return out


def min_memory_bytes(request: SolverRequest) -> float:
    """Least memory any choice needs (memory is a sum of per-node terms, so pick each node's minimum)."""
    return sum(min(row) for row in request.memory_bytes)


def alternatives(request: SolverRequest, choice: tuple[int, ...], k: int = 3) -> list[list[tuple[int, float, float]]]:
    """Per node, its ``k`` cheapest other strategies as ``(strategy, extra seconds, extra bytes)``: what the
    objective and the memory would change by if that node alone switched, its neighbours kept (so the
    resharding it would cause is in it).  Why the chosen strategy won, in the solver's own terms."""
    n = len(request.node_cost_s)
    incident: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(request.edges):
        incident[u].append((e, True))
        incident[v].append((e, False))

    def cost(i: int, s: int) -> float:
        total = request.node_cost_s[i][s]
        for e, first in incident[i]:
            u, v = request.edges[e]
            mat = request.edge_cost_s[e]
            total += mat[s][choice[v]] if first else mat[choice[u]][s]
        return total

    out = []
    for i in range(n):
        c = choice[i]
        base, mem = cost(i, c), request.memory_bytes[i][c]
        others = [(s, cost(i, s) - base, request.memory_bytes[i][s] - mem)
                  for s in range(len(request.node_cost_s[i])) if s != c]
        out.append(sorted(others, key=lambda t: (t[1], t[0]))[:k])
    return out
