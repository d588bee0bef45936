"""Exact reductions of the intra-op ILP before a solver sees it.  No torch here.

Many-op models (a state-space scan unrolled over the sequence, hundreds of small element-wise ops) give the ILP
hundreds of groups; with a tight memory budget CBC then stalls far from optimal.  Three reductions shrink the
problem without changing its optimum:

- **memory**: a strategy whose memory above its node's least exceeds the budget's slack over the least total
  can be in no feasible answer (the "lean" variant allows 2 % over the least, so few survive);
- **dominance**: a strategy that costs no less, holds no less memory (where a budget applies) and whose every
  edge row costs no less than another strategy's of the same node can be swapped for it in any answer;
- **elimination**: a node with one or two neighbours whose memory does not depend on its strategy (every node
  when no budget applies) is eliminated as in min-sum variable elimination: with one neighbour, its best
  strategy for each of the neighbour's is folded into the neighbour's costs; with two, into an edge between
  them (chains and ladders of element-wise ops, a scan unrolled over the sequence, collapse).  Its memory
  leaves the budget.

Reductions repeat until none applies.  ``Presolved.expand`` maps the reduced problem's answer back onto the
original nodes and strategies.  Ties keep the lower strategy index, as the solvers' tie-break does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from autopar.solvers.request import SolverRequest

#: Bytes of rounding the memory reduction allows, so that a strategy exactly at the slack stays.
_MEMORY_TOL_BYTES = 1.0


@dataclass(frozen=True, slots=True)
class _Eliminated:
    node: int  # original index of the eliminated node
    around: tuple[int, ...]  # original indices of its one or two neighbours
    best: dict[tuple[int, ...], int]  # the neighbours' original strategies -> the node's original strategy


@dataclass(frozen=True, slots=True)
class Presolved:
    """A reduced request and how to read its answers back."""

    request: SolverRequest
    nodes: tuple[int, ...]  # original index of each reduced node
    strategies: tuple[tuple[int, ...], ...]  # per reduced node, the original indices of its strategies
    eliminated: tuple[_Eliminated, ...]  # in the order they were eliminated

    def expand(self, choice: tuple[int, ...], num_nodes: int) -> tuple[int, ...]:
        """The original problem's answer from the reduced one's ``choice``."""
        out: list[int | None] = [None] * num_nodes
        for r, (node, kept) in enumerate(zip(self.nodes, self.strategies, strict=True)):
            out[node] = kept[choice[r]]
        for e in reversed(self.eliminated):  # its neighbours are chosen before it (or eliminated after it)
            out[e.node] = e.best[tuple(out[j] for j in e.around)]
        assert all(c is not None for c in out)
        return tuple(out)  # type: ignore[arg-type]


def presolve(request: SolverRequest) -> Presolved:
    """Reduce ``request`` exactly (see the module docstring)."""
    n = len(request.node_names)
    cost = {i: dict(enumerate(row)) for i, row in enumerate(request.node_cost_s)}
    memory = {i: dict(enumerate(row)) for i, row in enumerate(request.memory_bytes)}
    # edges keyed by (u, v) with u < v, the matrix as {(s_u, s_v): cost}; two edges of one pair are summed
    edges: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    for (u, v), mat in zip(request.edges, request.edge_cost_s, strict=True):
        a, b = (u, v) if u < v else (v, u)
        m = edges.setdefault((a, b), {})
        for s, row in enumerate(mat):
            for t, c in enumerate(row):
                key = (s, t) if u < v else (t, s)
                m[key] = m.get(key, 0.0) + c
    budget = request.memory_budget_bytes
    eliminated: list[_Eliminated] = []
    if budget is not None and sum(min(row) for row in request.memory_bytes) > budget + _MEMORY_TOL_BYTES:
        return _unreduced(request)  # infeasible: nothing to reduce (the solvers report it)

    # each node's edges, in the order of ``edges`` (an insertion-ordered dict of its own)
    touching: dict[int, dict[tuple[int, int], None]] = {i: {} for i in range(n)}
    for e in edges:
        touching[e[0]][e] = touching[e[1]][e] = None

    def neighbours(i: int) -> list[tuple[int, int]]:
        return list(touching[i])

    def drop(i: int, gone: set[int]) -> None:
        for s in gone:
            del cost[i][s], memory[i][s]
        for (a, b) in touching[i]:
            m = edges[(a, b)]
            side = 0 if a == i else 1
            for key in [k for k in m if k[side] in gone]:
                del m[key]

    changed = True
    while changed:
        changed = False
        if budget is not None:
            slack = budget - sum(min(memory[i].values()) for i in cost)
            for i in cost:
                least = min(memory[i].values())
                gone = {s for s, m in memory[i].items() if m - least > slack + _MEMORY_TOL_BYTES}
                if gone:
                    drop(i, gone)
                    changed = True
        for i in list(cost):
            gone = _dominated(i, cost[i], memory[i] if budget is not None else None,
                              [(e, edges[e]) for e in neighbours(i)])
            if gone:
                drop(i, gone)
                changed = True
        for i in list(cost):
            if budget is not None and len(set(memory[i].values())) > 1:
                continue  # its memory is a choice the budget weighs
            around = neighbours(i)
            others = tuple(sorted({j for e in around for j in e if j != i}))
            if len(others) not in (1, 2):
                continue
            eliminated.append(_eliminate(i, others, cost, around, edges))
            for a, b in around:
                del touching[a][(a, b)], touching[b][(a, b)]
            if len(others) == 2:
                touching[others[0]].setdefault(others, None)
                touching[others[1]].setdefault(others, None)
            if budget is not None:
                budget -= next(iter(memory[i].values()))
            del cost[i], memory[i]
            changed = True
    nodes = tuple(sorted(cost))
    index = {node: r for r, node in enumerate(nodes)}
    strategies = tuple(tuple(sorted(cost[i])) for i in nodes)
    position = [{s: k for k, s in enumerate(kept)} for kept in strategies]
    reduced_edges, mats = [], []
    for (a, b), m in sorted(edges.items()):
        ra, rb = index[a], index[b]
        mat = [[0.0] * len(strategies[rb]) for _ in strategies[ra]]
        for (s, t), c in m.items():
            mat[position[ra][s]][position[rb][t]] = c
        reduced_edges.append((ra, rb))
        mats.append(tuple(tuple(row) for row in mat))
    reduced = SolverRequest(
        node_names=tuple(request.node_names[i] for i in nodes),
        node_cost_s=tuple(tuple(cost[i][s] for s in kept) for i, kept in zip(nodes, strategies, strict=True)),
        memory_bytes=tuple(tuple(memory[i][s] for s in kept) for i, kept in zip(nodes, strategies, strict=True)),
        edges=tuple(reduced_edges), edge_cost_s=tuple(mats), memory_budget_bytes=budget,
        time_limit_s=request.time_limit_s)
    assert len(nodes) + len(eliminated) == n
    return Presolved(reduced, nodes, strategies, tuple(eliminated))


def _unreduced(request: SolverRequest) -> Presolved:
    counts = request.strategy_counts
    return Presolved(request, tuple(range(len(counts))), tuple(tuple(range(c)) for c in counts), ())


def _dominated(i: int, cost: dict[int, float], memory: dict[int, float] | None,
               around: list[tuple[tuple[int, int], dict[tuple[int, int], float]]]) -> set[int]:
    """Strategies of node ``i`` that another of its strategies dominates (the lower index wins a full tie)."""
    rows: dict[int, list[float]] = {s: [] for s in cost}
    for (a, _b), m in around:
        mine = 0 if a == i else 1
        by_other: dict[int, dict[int, float]] = {s: {} for s in cost}
        for key, c in m.items():
            by_other[key[mine]][key[1 - mine]] = c
        others = sorted({key[1 - mine] for key in m})
        for s in cost:
            rows[s].extend(by_other[s][t] for t in others)
    order = sorted(cost)
    gone: set[int] = set()
    for s in order:
        for better in order:
            if better == s or better in gone:
                continue
            if cost[better] > cost[s] or (memory is not None and memory[better] > memory[s]):
                continue
            if any(x > y for x, y in zip(rows[better], rows[s], strict=True)):
                continue
            full_tie = (cost[better] == cost[s] and (memory is None or memory[better] == memory[s])
                        and rows[better] == rows[s])
            if full_tie and better > s:
                continue  # the lower index stays
            gone.add(s)
            break
    return gone


def _eliminate(i: int, others: tuple[int, ...], cost: dict[int, dict[int, float]], around: list[tuple[int, int]],
               edges: dict[tuple[int, int], dict[tuple[int, int], float]]) -> _Eliminated:
    """Eliminate node ``i`` (neighbours ``others``, one or two): its best strategy for each of their strategy pairs
    goes into the single neighbour's costs, or into an edge between the two; ``i``'s edges are removed."""
    def edge(j: int, s: int, t: int) -> float:
        return edges[(i, j)][(s, t)] if (i, j) in edges else edges[(j, i)][(t, s)]

    best: dict[tuple[int, ...], int] = {}
    values: dict[tuple[int, ...], float] = {}
    for combo in itertools.product(*(sorted(cost[j]) for j in others)):
        value, choice = min((cost[i][s] + sum(edge(j, s, t) for j, t in zip(others, combo, strict=True)), s)
                            for s in sorted(cost[i]))
        best[combo], values[combo] = choice, value
    for e in around:
        del edges[e]
    if len(others) == 1:
        for (t,), value in values.items():
            cost[others[0]][t] += value
    else:
        m = edges.setdefault(others, {})
        for key, value in values.items():
            m[key] = m.get(key, 0.0) + value
    return _Eliminated(i, others, best)


__all__ = ["Presolved", "presolve"]
