"""Benchmark: does autopar rank parallel layouts the way a cluster measured them?

Every run of every sweep in ``benchmarks/reference/sweeps.json`` is estimated with its layout, attention
kernel and norm kernel pinned (``reference_runs.py``); the estimates are ranked against the measured step
times (Spearman's rank correlation), and the layout autopar estimates fastest (its top pick) is looked up
among the measurements: its regret is how much slower it measured than the sweep's best.  Prints a table
and writes ``benchmarks/results/ranking.json``.

    python benchmarks/ranking.py [--sweeps FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration import TraceCache, search_run
from reference_runs import SWEEPS, ReferenceRun, load_sweeps, sweep_runs
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results" / "ranking.json"


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy)


def estimate_sweep_run(run: ReferenceRun, traces: TraceCache) -> dict[str, Any]:
    res = search_run(run, traces)
    est = res.best.estimate if res.best is not None else None
    return {"case_id": run.case_id, "fixed": run.fixed, "attention": run.attention,
            "rms_norm": run.config.get("rms_norm"), "measured_s": run.measured_s,
            "estimate_s": est.iteration_time_s if est else None, "fits": bool(est and est.fits),
            "layout": est.layout.to_dict() if est else None,
            "peak_memory_gib": est.peak_memory_bytes / 2**30 if est else None}


def rank_sweep(name: str, sweep: dict[str, Any], traces: TraceCache) -> dict[str, Any]:
    rows = [estimate_sweep_run(run, traces) for run in sweep_runs(name, sweep)]
    scored = [r for r in rows if r["estimate_s"] is not None]
    rho = spearman([r["estimate_s"] for r in scored], [r["measured_s"] for r in scored])
    pick = min(scored, key=lambda r: (not r["fits"], r["estimate_s"]))
    best = min(rows, key=lambda r: r["measured_s"])
    return {"sweep": name, "runs": len(rows), "spearman": rho, "top_pick": pick, "measured_best": best,
            "top_pick_regret": pick["measured_s"] / best["measured_s"] - 1,
            "refused": [r["case_id"] for r in rows if not r["fits"]], "rows": rows}


def run_all(sweeps: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    traces = TraceCache()
    return [rank_sweep(name, sweep, traces) for name, sweep in sweeps.items()]


def render(results: list[dict[str, Any]], console: Console) -> None:
    for res in results:
        table = Table(title=f"{res['sweep']}: estimate vs measured step time", title_justify="left")
        for col in ("run", "layout", "kernels", "estimate", "measured", "est. rank", "meas. rank"):
            table.add_column(col)
        rows = res["rows"]
        est_rank = {r["case_id"]: i + 1 for i, r in enumerate(sorted(rows, key=lambda r: r["estimate_s"] or 1e30))}
        for i, r in enumerate(sorted(rows, key=lambda r: r["measured_s"])):
            f = r["fixed"]
            text = f"tp{f['tp']} pp{f['pp']} dp{f['dp']} mbs{f['mbs']} rc={f.get('recompute', '?')}"
            est = f"{r['estimate_s']:.1f} s" + ("" if r["fits"] else " REFUSED") if r["estimate_s"] else "-"
            table.add_row(r["case_id"].split("#")[-1], text, f"{r['attention']}/{r['rms_norm']}", est,
                          f"{r['measured_s']:.1f} s", str(est_rank[r["case_id"]]), str(i + 1))
        console.print(table)
        pick = res["top_pick"]
        console.print(f"{res['sweep']}: Spearman {res['spearman']:.3f} over {res['runs']} runs; top pick "
                      f"#{pick['case_id'].split('#')[-1]} measured {pick['measured_s']:.1f} s vs best "
                      f"{res['measured_best']['measured_s']:.1f} s (regret {res['top_pick_regret']:+.1%}); "
                      f"refused: {len(res['refused'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=Path, default=SWEEPS)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = run_all(load_sweeps(args.sweeps))
    render(results, Console(width=160))
    RESULTS.parent.mkdir(exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "rows"} for r in results]
    RESULTS.write_text(json.dumps({"summary": summary, "sweeps": results, "wall_s": time.perf_counter() - t0},
                                  indent=2, sort_keys=True, default=str) + "\n")
    print(f"wrote {RESULTS} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
