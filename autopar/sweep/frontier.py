"""The frontier of a sweep: the points no other beats on both time and cost (or time and energy), and which of
them meet a deadline and a budget."""

from __future__ import annotations

from typing import Any


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """For each ``(x, y)``, whether no other point is at least as good on both and better on one (lower is
    better)."""
    out = []
    for i, (x, y) in enumerate(points):
        beaten = any((a <= x and b <= y) and (a < x or b < y) for j, (a, b) in enumerate(points) if j != i)
        out.append(not beaten)
    return out


def cost_of(row: dict[str, Any]) -> float:
    """A row's cost: money where the sweep has prices, else GPU-hours."""
    return row["cost"] if row.get("cost") is not None else row["gpu_hours"]


def mark_frontier(rows: list[dict[str, Any]], deadline_s: float | None = None, budget: float | None = None) -> None:
    """Mark the planned rows: ``pareto_time_cost``, ``pareto_time_energy``, ``meets_deadline``, ``meets_budget``
    (``None`` where not asked) and ``best_choice`` (the cheapest that meets both)."""
    ok = [r for r in rows if r["status"] == "ok"]
    for flag, other in (("pareto_time_cost", cost_of), ("pareto_time_energy", lambda r: r["energy_kwh"])):
        for row, on in zip(ok, pareto([(r["wall_s"], other(r)) for r in ok]), strict=True):
            row[flag] = on
    for row in ok:
        row["meets_deadline"] = None if deadline_s is None else row["wall_s"] <= deadline_s
        row["meets_budget"] = None if budget is None else cost_of(row) <= budget
        row["best_choice"] = False
    meeting = [r for r in ok if r["meets_deadline"] is not False and r["meets_budget"] is not False]
    if meeting:
        min(meeting, key=lambda r: (cost_of(r), r["wall_s"], r["point"]))["best_choice"] = True


__all__ = ["cost_of", "mark_frontier", "pareto"]
