"""The intra-op sharding problem as plain arrays, and its answer.  No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["optimal", "feasible", "infeasible", "timeout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverRequest:
    """Choose one strategy per node minimizing node costs plus edge costs under a memory budget.

    ``node_cost_s[i][s]``: cost of node ``i`` in strategy ``s`` (already multiplied by how many identical
    copies the node stands for).  ``edges[e] = (u, v)`` with ``edge_cost_s[e][s_u][s_v]``; ``u != v``.
    ``memory_bytes[i][s]``: per-device bytes node ``i`` holds in strategy ``s``; their sum must stay within
    ``memory_budget_bytes`` (``None``: no limit).
    """

    node_names: tuple[str, ...]
    node_cost_s: tuple[tuple[float, ...], ...]
    memory_bytes: tuple[tuple[float, ...], ...]
    edges: tuple[tuple[int, int], ...] = ()
    edge_cost_s: tuple[tuple[tuple[float, ...], ...], ...] = ()
    memory_budget_bytes: float | None = None
    time_limit_s: float = 60.0

    def __post_init__(self) -> None:
        n = len(self.node_names)
        if not (len(self.node_cost_s) == len(self.memory_bytes) == n):
            raise ValueError("node_cost_s and memory_bytes need one row per node")
        for i, (c, m) in enumerate(zip(self.node_cost_s, self.memory_bytes)):
            if not c or len(c) != len(m):
                raise ValueError(f"node {self.node_names[i]}: cost and memory rows differ or are empty")
        if len(self.edges) != len(self.edge_cost_s):
            raise ValueError("one cost matrix per edge")
        counts = self.strategy_counts
        for (u, v), mat in zip(self.edges, self.edge_cost_s):
            if u == v:
                raise ValueError("self-edges belong in node_cost_s")
            if len(mat) != counts[u] or any(len(row) != counts[v] for row in mat):
                raise ValueError(f"edge ({u}, {v}): matrix shape does not match the strategy counts")

    @property
    def strategy_counts(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.node_cost_s)

    @property
    def num_variables(self) -> int:
        return sum(self.strategy_counts) + sum(len(m) * len(m[0]) for m in self.edge_cost_s)

    @property
    def num_constraints(self) -> int:
        counts = self.strategy_counts
        return len(counts) + sum(counts[u] + counts[v] for u, v in self.edges) + (
            1 if self.memory_budget_bytes is not None else 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverResult:
    status: Status
    solver: str
    choice: tuple[int, ...] = ()
    objective_s: float = float("inf")
    bound_s: float | None = None
    solve_time_s: float = 0.0
    num_variables: int = 0
    num_constraints: int = 0
    min_memory_bytes: float | None = None  # set when infeasible: the least memory any choice needs

    @property
    def gap(self) -> float | None:
        """Relative optimality gap, when the solver reports a bound."""
        if self.bound_s is None or self.objective_s in (0.0, float("inf")):
            return 0.0 if self.status == "optimal" else None
        return max(0.0, (self.objective_s - self.bound_s) / abs(self.objective_s))
