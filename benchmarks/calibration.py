"""Benchmark: autopar's estimates of published training runs, with their layouts pinned (``--fix``).

Reads ``shared/reference/calibration.json`` (``--references PATH``), estimates every case and prints
estimate vs measurement; writes ``benchmarks/results/calibration.json``.  For each case it also runs the
unconstrained search and reports whether it finds a layout at least as fast that fits.

Runtime facts of each source, not fitted numbers, decide the modelling switches: Megatron-LM of 2021-22
ran unfused ("math") attention with a fused scale-mask-softmax; torchtitan (2024) runs flash attention.

    python benchmarks/calibration.py [--references ../shared/reference/calibration.json] [--no-search]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from autopar.passes import PassContext

from autopar.cluster import load_cluster
from autopar.frontend import trace_model
from autopar.inter_op.layout import normalize_fix
from autopar.inter_op.search import UnitCostCache, search
from autopar.inter_op.unit_costs import unit_sequence

HERE = Path(__file__).resolve().parent
DEFAULT_REFS = HERE.parents[1] / "shared" / "reference" / "calibration.json"


def model_of(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    m = case["model"]
    if "llama" in m["name"].lower():
        return "llama", {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"],
                         "kv_heads": m.get("kv_heads", m["heads"]), "ffn": m["ffn"], "vocab": m["vocab"],
                         "seq_len": m["seq_len"]}
    cfg = {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "vocab": m["vocab"],
           "seq_len": m["seq_len"]}
    if m.get("ffn"):
        cfg["ffn"] = m["ffn"]
    return "gpt", cfg


def attention_of(case: dict[str, Any]) -> str:
    return "flash" if case["source"].startswith("pytorch/torchtitan") else "math"


def fix_of(case: dict[str, Any]) -> dict[str, Any]:
    lay = case["layout"]
    rec = lay.get("recompute", "none")
    fix = {"tp": lay["tp"], "pp": lay["pp"], "dp": lay["dp"], "mbs": lay["micro_batch"],
           "recompute": "full" if rec.startswith("full") else ("selective" if rec.startswith("selective") else "none"),
           "sp": "on" if lay.get("sequence_parallel") else "off"}
    sched = lay.get("pipeline_schedule")
    if lay["pp"] > 1 and sched:
        fix["schedule"] = "interleaved" if lay.get("virtual_stages", 1) > 1 else sched.lower()
        fix["v"] = lay.get("virtual_stages", 1)
    fix["zero"] = 3 if "FSDP" in lay.get("dp_type", "") else 0
    return normalize_fix(fix)


def measured_time_s(case: dict[str, Any]) -> float | None:
    meas, der = case.get("measured", {}), case.get("derived", {})
    if der.get("iteration_time_s"):
        return der["iteration_time_s"]
    if meas.get("tokens_per_s_per_gpu"):
        m = case["model"]
        return case["global_batch"] * m["seq_len"] / (meas["tokens_per_s_per_gpu"] * case["cluster"]["n_gpus"])
    return None


def run_case(case: dict[str, Any], do_search: bool) -> dict[str, Any]:
    cluster = load_cluster("a100-80gb").with_overrides(gpus=case["cluster"]["n_gpus"])
    ctx = PassContext(cluster=cluster, attention=attention_of(case))
    ref, cfg = model_of(case)
    t0 = time.perf_counter()
    traced = trace_model(ref, cfg, ctx=ctx)
    row: dict[str, Any] = {"case_id": case["case_id"], "attention": ctx.attention}
    if "measured_per_layer_ms" in case:  # one transformer layer on a tp group: compare unit costs
        lay = case["layout"]
        cache = UnitCostCache(traced.graph, cluster, ctx, "cbc", 60)
        for variant, sp in (("baseline_no_recompute", False), ("sequence_parallel", True)):
            costs, _ = cache.get(lay["tp"], lay["micro_batch"], sp, "lean")
            layer = costs[unit_sequence(traced.graph)[1]]
            fwd = (layer.fwd_s + layer.tp_fwd_s) * 1e3
            bwd = (layer.bwd_s + layer.tp_bwd_s) * 1e3
            meas = case["measured_per_layer_ms"][variant]
            row[variant] = {"fwd_ms": round(fwd, 2), "bwd_ms": round(bwd, 2), "measured_fwd_ms": meas["forward"],
                            "measured_bwd_ms": meas["backward"], "total_error": (fwd + bwd) / meas["total"] - 1}
        return row
    fixed = fix_of(case)
    budget = cluster.usable_memory_bytes
    pinned = search(traced.graph, cluster, ctx, case["global_batch"], fixed, budget)
    est = pinned.best.estimate
    measured = measured_time_s(case)
    row.update({"layout": est.layout.to_dict(), "estimate_s": est.iteration_time_s, "measured_s": measured,
                "error": est.iteration_time_s / measured - 1 if measured else None, "mfu": est.mfu,
                "hfu": est.hfu, "peak_memory_gib": est.peak_memory_bytes / 2**30, "fits": est.fits,
                "breakdown": est.breakdown, "trace_s": traced.graph.trace_time_s})
    if do_search:
        free = search(traced.graph, cluster, ctx, case["global_batch"], {}, budget)
        best = free.best.estimate
        row.update({"search_layout": best.layout.to_dict(), "search_estimate_s": best.iteration_time_s,
                    "search_fits": best.fits, "search_time_s": free.solve_time_s,
                    "search_at_least_as_fast": best.fits and best.iteration_time_s <= est.iteration_time_s + 1e-12})
    row["wall_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--references", type=Path, default=DEFAULT_REFS)
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--case", help="only this case_id")
    args = ap.parse_args()
    cases = json.loads(args.references.read_text())["cases"]
    rows = []
    for case in cases:
        if args.case and case["case_id"] != args.case:
            continue
        row = run_case(case, not args.no_search)
        rows.append(row)
        if "error" in row:
            print(f"{row['case_id']:45s} estimate {row['estimate_s']:8.3f} s  measured {row['measured_s']:8.3f} s  "
                  f"error {row['error']:+6.1%}  mfu {row['mfu']:.3f}  mem {row['peak_memory_gib']:.1f} GiB"
                  f"  fits {row['fits']}")
            if "search_estimate_s" in row:
                print(f"{'':45s} search   {row['search_estimate_s']:8.3f} s  fits {row['search_fits']}  "
                      f"({row['search_time_s']:.1f} s) {row['search_layout']}")
        else:
            for variant in ("baseline_no_recompute", "sequence_parallel"):
                v = row[variant]
                print(f"{row['case_id']:45s} {variant:22s} fwd {v['fwd_ms']:6.2f} ms (meas {v['measured_fwd_ms']})"
                      f"  bwd {v['bwd_ms']:6.2f} ms (meas {v['measured_bwd_ms']})  total error {v['total_error']:+.1%}")
    out = HERE / "results" / "calibration.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2, sort_keys=True, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
