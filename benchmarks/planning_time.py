"""Benchmark: end-to-end planning time (trace + passes + full search), printed and written as JSON.

Targets, tracing included, in one process on 2 idle cores: GPT-3 175B on 1024 a100-80gb (global batch 1536, seq 2048)
<= 6 s; GPT-3 39B on 64 <= 4 s; GPT 1T on 3072 <= 12 s.  Each case prints how many layouts the search space holds,
how many the time bound pruned, how many the memory bound pruned, and how many were estimated.

    python benchmarks/planning_time.py [--exhaustive]

``--exhaustive`` also searches every case with no lower bound and no cut-off and checks that it plans the same
layout (slow).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autopar.passes import PassContext

from autopar.cluster import load_cluster
from autopar.frontend import trace_model
from autopar.inter_op.search import search

CASES = [
    # name, config, gpus, global batch, target seconds
    ("gpt3-175b", {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq_len": 2048}, 1024, 1536, 6),
    ("gpt3-39b", {"layers": 48, "hidden": 8192, "heads": 64, "vocab": 51200, "seq_len": 2048}, 64, 1536, 4),
    ("gpt-1t", {"layers": 128, "hidden": 25600, "heads": 160, "vocab": 51200, "seq_len": 2048}, 3072, 3072, 12),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exhaustive", action="store_true", help="check each plan against an unpruned search")
    args = ap.parse_args()
    rows = []
    for name, cfg, gpus, batch, target in CASES:
        cluster = load_cluster("a100-80gb").with_overrides(gpus=gpus)
        ctx = PassContext(cluster=cluster)
        t0 = time.perf_counter()
        traced = trace_model("gpt", cfg, ctx=ctx)
        t1 = time.perf_counter()
        res = search(traced.graph, cluster, ctx, batch, {}, cluster.usable_memory_bytes)
        t2 = time.perf_counter()
        est = res.best.estimate
        row = {"case": name, "gpus": gpus, "global_batch": batch, "trace_s": round(t1 - t0, 2),
               "search_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2), "target_s": target,
               "layouts_enumerated": res.enumerated, "pruned_by_bound": res.pruned_bound,
               "pruned_by_memory": res.pruned_memory, "layouts_evaluated": res.evaluated,
               "ilp_solves": res.ilp_solves, "layout": est.layout.to_dict(),
               "iteration_time_s": est.iteration_time_s, "mfu": est.mfu}
        if args.exhaustive:
            t3 = time.perf_counter()
            full = search(traced.graph, cluster, ctx, batch, {}, cluster.usable_memory_bytes, exhaustive=True)
            same = full.best.estimate.layout == est.layout and \
                full.best.estimate.iteration_time_s == est.iteration_time_s
            row.update(exhaustive_s=round(time.perf_counter() - t3, 2), exhaustive_evaluated=full.evaluated,
                       exhaustive_same_plan=same)
            print(f"{name}: exhaustive search ({full.evaluated} layouts, {row['exhaustive_s']:.1f} s) plans "
                  f"{'the same layout' if same else 'another layout: ' + str(full.best.estimate.layout.to_dict())}")
        rows.append(row)
        print(f"{name}: {row['total_s']:.1f} s (trace {row['trace_s']:.1f}, search {row['search_s']:.1f}; target "
              f"{target} s) {res.enumerated} layouts: {res.pruned_bound} pruned by the bound, {res.pruned_memory} "
              f"by memory, {res.evaluated} estimated; {res.ilp_solves} ILP solves -> {est.layout.to_dict()} "
              f"{est.iteration_time_s:.2f} s/iter, MFU {est.mfu:.1%}")
    out = Path(__file__).parent / "results" / "planning_time.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
