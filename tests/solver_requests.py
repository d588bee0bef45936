"""Random intra-op problems for the solver tests (hypothesis): one generator, shaped per test."""

from __future__ import annotations

from collections.abc import Callable

from autopar.solvers.request import SolverRequest
from hypothesis import strategies as st


@st.composite
def solver_requests(draw, nodes: tuple[int, int], strategies: int, memory: int, extra_edges: int, chain: bool,
                    budget: Callable[[int], int], digits: int = 2) -> SolverRequest:
    """``nodes`` (min, max) nodes of 1..``strategies`` strategies, memories 0..``memory`` bytes; a chain through
    them (``chain``) plus up to ``extra_edges`` random edges; no budget or one of 0..``budget(n)`` bytes."""
    n = draw(st.integers(*nodes))
    counts = [draw(st.integers(1, strategies)) for _ in range(n)]
    cost = st.floats(0, 10, allow_nan=False, allow_infinity=False).map(lambda x: round(x, digits))
    node_cost = [tuple(draw(cost) for _ in range(c)) for c in counts]
    mem = [tuple(float(draw(st.integers(0, memory))) for _ in range(c)) for c in counts]
    pairs = [(u, v) for u in range(n) for v in range(n) if u != v]
    extra = draw(st.lists(st.sampled_from(pairs), max_size=extra_edges, unique=not chain)) if pairs else []
    edges = list(dict.fromkeys([(i, i + 1) for i in range(n - 1)] * chain + extra))
    mats = [tuple(tuple(draw(cost) for _ in range(counts[v])) for _ in range(counts[u])) for u, v in edges]
    limit = draw(st.one_of(st.none(), st.integers(0, budget(n)).map(float)))
    return SolverRequest(node_names=tuple(f"n{i}" for i in range(n)), node_cost_s=tuple(node_cost),
                         memory_bytes=tuple(mem), edges=tuple(edges), edge_cost_s=tuple(mats),
                         memory_budget_bytes=limit, time_limit_s=10)
