"""Benchmark: autopar's estimates of published training runs against their measured iteration times.

Every row of ``benchmarks/reference/calibration.json`` is planned with its published layout pinned
(``--fix``; unpublished knobs are searched, see ``reference_runs.py``) on its cluster and framework, and
the estimate is compared with the measurement.  Per-layer rows (one transformer layer timed on a tp group)
compare the estimated forward and backward time of one layer.  Prints a table and the summary (median and
largest |error|, rows within 10 %), and writes ``benchmarks/results/calibration.json``.

    python benchmarks/calibration.py [--case CASE_ID] [--references FILE] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autopar.passes import PassContext
from reference_runs import CALIBRATION, ReferenceRun, load_calibration, reference_run
from rich.console import Console
from rich.table import Table

from autopar.errors import AutoparError
from autopar.frontend import TracedModel, trace_model
from autopar.inter_op.layout import Layout
from autopar.inter_op.recompute import layer_recompute
from autopar.inter_op.search import UnitCostCache, search
from autopar.inter_op.unit_costs import unit_sequence

RESULTS = Path(__file__).resolve().parent / "results" / "calibration.json"
#: Variants of a per-layer row: (name in the row, sequence parallel, recompute)
PER_LAYER_VARIANTS = (("baseline_no_recompute", False, "none"), ("sequence_parallel", True, "none"),
                      ("full_recompute", False, "full"), ("selective_recompute", False, "selective"),
                      ("selective_recompute_and_sequence_parallel", True, "selective"))


class TraceCache:
    """One trace per (model, config, attention, framework, compile) and one set of unit costs per device and
    tensor-parallel fabric on top: rows of the same model share the trace and the intra-op solves."""

    def __init__(self) -> None:
        self._traces: dict[tuple, TracedModel] = {}
        self._units: dict[tuple, UnitCostCache] = {}

    def _key(self, run: ReferenceRun) -> tuple:
        return (*run.model_key, run.framework, tuple(sorted(run.framework_overrides.items())), run.compile)

    def get(self, run: ReferenceRun) -> TracedModel:
        key = self._key(run)
        if key not in self._traces:
            self._traces[key] = trace_model(run.model_ref, run.config, ctx=run.context())
        return self._traces[key]

    def unit_costs(self, run: ReferenceRun, ctx: PassContext) -> UnitCostCache:
        """Unit costs depend on the device (a row may name a variant of its preset's) and the tp group's links,
        which only the node size and its fabric decide."""
        c = run.cluster
        key = (self._key(run), c.name, c.hbm_bandwidth_bytes_per_s, c.power_cap_w, c.gpus_per_node,
               c.intra_node_bandwidth_bytes_per_s)
        if key not in self._units:
            self._units[key] = UnitCostCache(self.get(run).graph, c, ctx, "cbc", 60.0)
        return self._units[key]


def search_run(run: ReferenceRun, traces: TraceCache):
    """The search for a row's published layout, sharing traces and unit costs with the other rows."""
    traced = traces.get(run)
    ctx = run.context()
    cache = traces.unit_costs(run, ctx)
    return search(traced.graph, run.cluster, ctx, run.global_batch, run.fixed, run.cluster.usable_memory_bytes,
                  cache=cache)


def estimate_run(run: ReferenceRun, traces: TraceCache) -> dict[str, Any]:
    """The estimate of one whole-run row, with its error against the measurement."""
    t0 = time.perf_counter()
    res = search_run(run, traces)
    if res.best is None:
        return {"case_id": run.case_id, "framework": run.framework, "gpus": run.cluster.gpus, "fixed": run.fixed,
                "error": None, "fits": False, "note": "no layout of the search space matches the published one"}
    est = res.best.estimate
    return {"case_id": run.case_id, "framework": run.framework, "attention": run.attention,
            "precision": run.precision, "compile": run.compile,
            "gpus": run.cluster.gpus, "cluster": run.cluster.name, "fixed": run.fixed, "searched": list(run.searched),
            "layout": est.layout.to_dict(), "estimate_s": est.iteration_time_s, "measured_s": run.measured_s,
            "error": est.iteration_time_s / run.measured_s - 1, "mfu": est.mfu, "hfu": est.hfu,
            "peak_memory_gib": est.peak_memory_bytes / 2**30, "fits": est.fits, "breakdown": est.breakdown,
            "compute_detail": est.compute_detail,
            "wall_s": time.perf_counter() - t0}


def estimate_per_layer(run: ReferenceRun, traces: TraceCache) -> dict[str, Any]:
    """One layer's forward and backward time on the row's tp group, per measured variant."""
    t0 = time.perf_counter()
    traced = traces.get(run)
    ctx = run.context()
    cache = traces.unit_costs(run, ctx)
    tp, mbs = run.fixed["tp"], run.fixed["mbs"]
    variants = {}
    est_total = meas_total = 0.0
    for name, sp, recompute in PER_LAYER_VARIANTS:
        if name not in run.per_layer_ms:
            continue
        costs, _ = cache.get(tp, mbs, sp, "fast")
        layer = costs[unit_sequence(traced.graph)[1]]
        fwd = layer.fwd_s + layer.tp_fwd_s
        bwd = layer.bwd_s + layer.tp_bwd_s + layer_recompute(layer, recompute, ctx.framework).time_s
        meas = run.per_layer_ms[name]
        variants[name] = {"fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "measured_fwd_ms": meas["forward"],
                          "measured_bwd_ms": meas["backward"], "error": (fwd + bwd) * 1e3 / meas["total"] - 1}
        est_total += (fwd + bwd) * 1e3
        meas_total += meas["total"]
    return {"case_id": run.case_id, "framework": run.framework, "attention": run.attention, "gpus": run.cluster.gpus,
            "cluster": run.cluster.name, "fixed": run.fixed, "per_layer": variants, "estimate_s": est_total / 1e3,
            "measured_s": meas_total / 1e3, "error": est_total / meas_total - 1, "wall_s": time.perf_counter() - t0}


def estimate_case(case: dict[str, Any], traces: TraceCache) -> dict[str, Any]:
    """The row's estimate; a row autopar cannot plan (a layout it has no knob for) is reported, not raised."""
    try:
        run = reference_run(case)
        return estimate_per_layer(run, traces) if run.per_layer_ms else estimate_run(run, traces)
    except (AutoparError, KeyError, ValueError) as exc:
        return {"case_id": case.get("case_id", "?"), "framework": "", "gpus": case.get("cluster", {}).get("n_gpus"),
                "fixed": {}, "error": None, "fits": False, "note": f"not planned: {exc}"}


def run_all(cases: list[dict[str, Any]], only: str | None = None) -> list[dict[str, Any]]:
    """Every row's estimate (or only ``only``'s)."""
    traces = TraceCache()
    return [estimate_case(case, traces) for case in cases if not only or case["case_id"] == only]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and largest |error| over the rows that got an estimate; rows refused (no layout, or one that
    does not fit although it ran) are listed."""
    refused = [r["case_id"] for r in rows if r["error"] is None or r.get("fits") is False]
    scored = [r for r in rows if r["error"] is not None]
    errors = [abs(r["error"]) for r in scored]
    return {"rows": len(rows), "scored": len(scored), "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors), "median_signed_error": statistics.median(r["error"] for r in scored),
            "within_10pct": sum(e <= 0.10 for e in errors), "too_slow": sum(r["error"] > 0 for r in scored),
            "refused": refused}


def render(rows: list[dict[str, Any]], summary: dict[str, Any], console: Console) -> None:
    table = Table(title="Estimate vs measured (published layouts pinned)", title_justify="left")
    for col in ("case", "GPUs", "framework", "layout", "estimate", "measured", "error", "MFU", "memory"):
        table.add_column(col, justify="right" if col in ("GPUs", "estimate", "measured", "error", "MFU") else "left")
    for r in rows:
        if "per_layer" in r:
            for name, v in r["per_layer"].items():
                table.add_row(f"{r['case_id']} [{name}]", str(r["gpus"]), r["framework"], f"tp={r['fixed']['tp']} "
                              "one layer", f"{v['fwd_ms'] + v['bwd_ms']:.1f} ms",
                              f"{v['measured_fwd_ms'] + v['measured_bwd_ms']:.1f} ms", f"{v['error']:+.1%}", "", "")
            continue
        if r["error"] is None:
            table.add_row(r["case_id"], str(r["gpus"]), r["framework"], r["note"], "", "", "", "", "REFUSED")
            continue
        table.add_row(r["case_id"], str(r["gpus"]), r["framework"], Layout.of(r["layout"]).describe(),
                      f"{r['estimate_s']:.2f} s", f"{r['measured_s']:.2f} s", f"{r['error']:+.1%}", f"{r['mfu']:.1%}",
                      f"{r['peak_memory_gib']:.0f} GiB" + ("" if r["fits"] else " REFUSED"))
    console.print(table)
    console.print(f"{summary['rows']} rows: median |error| {summary['median_abs_error']:.1%}, "
                  f"max |error| {summary['max_abs_error']:.1%}, median signed {summary['median_signed_error']:+.1%}, "
                  f"{summary['within_10pct']} within 10 %, {summary['too_slow']} estimated too slow, "
                  f"refused: {summary['refused'] or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--references", type=Path, default=CALIBRATION)
    ap.add_argument("--case", help="only this case_id")
    ap.add_argument("--output", type=Path, default=RESULTS, help=f"JSON to write (default {RESULTS.name} in results/)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = run_all(load_calibration(args.references), args.case)
    summary = summarize(rows)
    summary["wall_s"] = time.perf_counter() - t0
    render(rows, summary, Console(width=200))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2, sort_keys=True, default=str) + "\n")
    print(f"wrote {args.output} ({summary['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
