"""``autopar sweep``: the best plan of every GPU type at every cluster size, and what training on it costs.

    request = SweepRequest(model="models/llama.py", config=..., clusters=["h100-80gb", "b200"],
                           gpus=[256, 512, 1024], tokens=15e12)
    result = run_sweep(request, jobs=2)

The model is traced once; the points run in ``autopar.sweep.runner``; each point's estimate becomes time, GPU-hours,
cost and energy in ``autopar.sweep.economics``; ``autopar.sweep.frontier`` marks the Pareto-optimal points.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from autopar.api import setup
from autopar.cluster import Cluster, cluster_from_args
from autopar.errors import AutoparError
from autopar.framework import DEFAULT_FRAMEWORK, load_framework
from autopar.frontend import trace_model
from autopar.inter_op.fp8 import training_precisions
from autopar.inter_op.layout import Layout
from autopar.summary import model_summary
from autopar.sweep.economics import Power, Prices, Reliability, point_economics
from autopar.sweep.frontier import mark_frontier
from autopar.sweep.grid import sweep_points
from autopar.sweep.runner import PlanningOptions, PointResult, TypeGraph, run_points

#: Llama 3's batches: 4M tokens (512 sequences of 8192; arXiv 2407.21783, sec. 3.4.1), as a binary 4 Mi.
DEFAULT_TOKENS_PER_BATCH = 4 * 2**20
DEFAULT_CLUSTERS = ("a100-80gb", "h100-80gb", "h200", "b200", "gb200-nvl72")
#: Breakdown terms drawn as communication (the rest: compute, recomputation, the pipeline bubble).
COMMUNICATION_TERMS = ("tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_p2p_s", "dp_comm_exposed_s")


@dataclass(slots=True)
class SweepRequest:
    """What to sweep: a model, GPU types and counts, the tokens to train, and what the answer is judged by."""

    model: str
    clusters: list[str]
    gpus: list[int]
    tokens: float
    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int | None = None
    tokens_per_batch: float | None = None
    """Held fixed across the points (default ``DEFAULT_TOKENS_PER_BATCH``); or ``global_batch`` sequences."""
    global_batch: int | None = None
    framework: str = DEFAULT_FRAMEWORK
    precision: str = "bf16"
    attention: str = "flash"
    solver: str = "cbc"
    time_limit_s: float = 60.0
    memory_limit_gb: float | None = None
    compile: bool | None = None
    every_layer: bool = False
    prices: Prices | None = None
    power: Power = field(default_factory=Power)
    reliability: Reliability = field(default_factory=Reliability)
    deadline_s: float | None = None
    budget: float | None = None


@dataclass(slots=True)
class SweepResult:
    """The points' rows (``rows``: one dict each, what ``--json`` and ``--csv`` write) and the sweep's facts."""

    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    plans: dict[str, str]
    """Point key (``h100-80gb-1024``) -> its plan file's text."""
    elapsed_s: dict[str, float] = field(default_factory=dict)
    """Point key -> the seconds planning it took (not written: it varies run to run)."""

    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "ok"]


def check_request(req: SweepRequest) -> dict[str, Cluster]:
    """The request's clusters by name, and one-line errors for what cannot run (before anything is traced)."""
    if not req.clusters:
        raise AutoparError("--cluster: give at least one GPU type")
    if not req.gpus:
        raise AutoparError("--gpus: give at least one GPU count")
    if not req.tokens > 0:
        raise AutoparError("--tokens must be positive")
    if req.global_batch is not None and req.global_batch < 1:
        raise AutoparError("--global-batch must be >= 1")
    if req.tokens_per_batch is not None and req.global_batch is not None:
        raise AutoparError("give --tokens-per-batch or --global-batch, not both")
    if req.budget is not None and req.prices is None:
        raise AutoparError("--budget needs --prices (a TOML of prices per GPU-hour)")
    clusters = {name: cluster_from_args(name) for name in dict.fromkeys(req.clusters)}
    framework = load_framework(req.framework)
    for cluster in clusters.values():
        if req.prices is not None:
            req.prices.of(cluster.name)
        training_precisions(req.precision, cluster, framework)
    return clusters


def run_sweep(req: SweepRequest, jobs: int = 1, ray_address: str | None = None,
              on_progress: Callable[[str, int, int], None] | None = None) -> SweepResult:
    """Plan every point of ``req`` and price it.  ``on_progress(what, done, total)`` hears of each stage and
    point.  Raises ``AutoparError`` (one line) for bad input, before any point runs."""
    clusters = check_request(req)
    points = sweep_points(clusters, req.gpus)
    first = next(iter(clusters))
    _, ctx0, _, _ = setup(first, None, None, None, None, req.time_limit_s, req.memory_limit_gb, req.attention,
                          req.framework, req.precision, req.compile)
    if on_progress is not None:
        on_progress(f"tracing {req.model}", 0, len(points))
    traced = trace_model(req.model, req.config, req.seq_len, ctx0, req.every_layer)
    seq_len = traced.graph.seq_len
    batch = req.global_batch or max(1, round((req.tokens_per_batch or DEFAULT_TOKENS_PER_BATCH) / seq_len))
    options = PlanningOptions(req.model, traced.config, batch, req.framework, req.precision, req.attention,
                              req.solver, req.time_limit_s, req.memory_limit_gb, req.compile)
    graphs = {}
    for name in clusters:
        _, ctx, _, _ = options.setup(name, clusters[name].gpus)
        graphs[name] = TypeGraph(name, traced.annotated(ctx))
    summary = model_summary(traced.graph, batch)
    done = 0

    def point_done(result: PointResult) -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(f"{result.point.key}: {result.status}", done, len(points))

    if on_progress is not None:
        on_progress("planning", 0, len(points))
    results = run_points(points, options, graphs, jobs, ray_address, point_done)
    rows = [_row(r, clusters[r.point.cluster], req, summary["parameters"]) for r in results]
    _scaling(rows)
    mark_frontier(rows, req.deadline_s, req.budget)
    meta = {
        "model": req.model, "config": traced.config, "parameters": summary["parameters"], "seq_len": seq_len,
        "global_batch": batch, "tokens_per_batch": batch * seq_len, "tokens": req.tokens,
        "framework": req.framework, "precision": req.precision,
        "cost_unit": req.prices.currency if req.prices is not None else "GPU-hours",
        "prices": req.prices.source if req.prices is not None else None,
        "deadline_s": req.deadline_s, "budget": req.budget,
        "power": {"pue": req.power.pue, "node_overhead_w": req.power.node_overhead_w},
        "reliability": {"interruptions_per_gpu_day": req.reliability.interruptions_per_gpu_day,
                        "restart_s": req.reliability.restart_s,
                        "checkpoint_bytes_per_s_per_gpu": req.reliability.checkpoint_bytes_per_s_per_gpu,
                        "checkpoint_every_s": req.reliability.checkpoint_every_s},
        "accuracy": {c.name: accuracy_note(c.name, req.precision) for c in clusters.values()},
    }
    plans = {r.point.key: r.plan_json for r in results if r.plan_json is not None}
    return SweepResult(rows, meta, plans, {r.point.key: r.elapsed_s for r in results})


def _row(r: PointResult, cluster: Cluster, req: SweepRequest, parameters: float) -> dict[str, Any]:
    p = r.point
    row: dict[str, Any] = {
        "point": p.key, "gpu_type": r.cluster_name, "device": r.device, "gpus": p.gpus, "gpus_asked": list(p.asked),
        "rounded": p.rounded, "status": r.status, "note": _note(r), "memory_budget_bytes": r.memory_budget_bytes,
    }
    acc = accuracy(r.cluster_name, req.precision)
    row["error_band"] = acc["median_abs_error"] if acc else None
    row["accuracy"] = accuracy_note(r.cluster_name, req.precision)
    if r.status == "no-fit":
        row["leanest_bytes"] = r.leanest_bytes
    if r.status != "ok":
        return row
    assert r.estimate is not None and r.layout is not None
    est, b = r.estimate, r.estimate["breakdown"]
    row.update({
        "layout": Layout.of(r.layout).describe(), "iteration_time_s": est["iteration_time_s"],
        "tokens_per_s": est["tokens_per_s"], "mfu": est["mfu"], "peak_memory_bytes": est["peak_memory_bytes"],
        "compute_s": b.get("compute_s", 0.0), "recompute_s": b.get("recompute_s", 0.0),
        "bubble_s": b.get("pp_bubble_s", 0.0), "communication_s": sum(b.get(k, 0.0) for k in COMMUNICATION_TERMS),
        "plan_file": f"plans/{p.key}.json",
    })
    row.update(point_economics(est, cluster, p.gpus, req.tokens, parameters, req.prices, req.power,
                               req.reliability))
    if row["wall_s"] is None:
        row["status"] = "stalls"
        row["note"] = "; ".join(filter(None, [row["note"], "interruptions come faster than the job recovers from "
                                              "them: it never finishes"]))
    return row


def _note(r: PointResult) -> str:
    parts = []
    if r.point.rounded:
        asked = ", ".join(str(a) for a in r.point.asked)
        parts.append(f"{asked} GPUs asked; {r.cluster_name} takes {r.point.gpus}")
    if r.status == "no-fit":
        parts.append(f"does not fit: the leanest layout needs {r.leanest_bytes / 2**30:.1f} GiB per device, "
                     f"{r.memory_budget_bytes / 2**30:.1f} GiB usable")
    elif r.status != "ok":
        parts.append(r.message)
    return "; ".join(parts)


def _scaling(rows: list[dict[str, Any]]) -> None:
    """Each planned point's throughput per GPU against its type's smallest planned point."""
    base: dict[str, dict[str, Any]] = {}
    for row in sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["gpus"]):
        ref = base.setdefault(row["gpu_type"], row)
        row["scaling_efficiency"] = (row["tokens_per_s"] / row["gpus"]) / (ref["tokens_per_s"] / ref["gpus"])


def _accuracy_table() -> dict[str, Any]:
    return json.loads(resources.files("autopar").joinpath("accuracy.json").read_text())["clusters"]


def accuracy(cluster: str, precision: str) -> dict[str, Any] | None:
    """How the estimates of ``cluster`` (a preset name) compare with published runs, from ``autopar/accuracy.json``
    (``benchmarks/accuracy_report.py``): ``runs``, ``median_abs_error``, ``median_signed_error``; ``None`` when
    no published run of it was checked."""
    table = _accuracy_table().get(cluster, {})
    return table.get("bf16" if precision == "auto" else precision)


def accuracy_note(cluster: str, precision: str) -> str:
    """``accuracy`` in words: "h100-80gb estimates: median error 6.7 % on 94 published runs (4.0 % fast)"."""
    acc = accuracy(cluster, precision)
    if acc is None:
        return f"{cluster}: no published run to check its estimates against"
    bias = acc["median_signed_error"]
    side = "fast" if bias < 0 else "slow"
    return (f"{cluster} estimates: median error {acc['median_abs_error']:.1%} on {acc['runs']} published runs "
            f"(median {abs(bias):.1%} too {side})")


__all__ = ["COMMUNICATION_TERMS", "DEFAULT_CLUSTERS", "DEFAULT_TOKENS_PER_BATCH", "SweepRequest", "SweepResult",
           "accuracy", "accuracy_note", "check_request", "run_sweep"]
