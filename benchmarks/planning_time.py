"""Benchmark: end-to-end planning time (trace + passes + full search), printed and written as JSON.

Targets, tracing included, in one process on 2 idle cores: GPT-3 175B on 1024 a100-80gb (global batch 1536, seq 2048)
<= 6 s; GPT-3 39B on 64 <= 4 s; GPT 1T on 3072 <= 12 s; a 2-layer HuggingFace Mamba (hidden 64, seq 32; its scan
unrolled into ~800 ops) on 4 CPU ranks <= 10 s, building the model included, with every intra-op solve proved
optimal.  Each case prints how many layouts the search space holds, how many the time bound pruned, how many the
memory bound pruned, and how many were estimated.  The Mamba case needs ``transformers`` (the test extra).

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

_MAMBA = str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_mamba.py")
CASES = [
    # name, model, config, cluster, gpus, global batch, target seconds
    ("gpt3-175b", "gpt", {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq_len": 2048}, "a100-80gb",
     1024, 1536, 6),
    ("gpt3-39b", "gpt", {"layers": 48, "hidden": 8192, "heads": 64, "vocab": 51200, "seq_len": 2048}, "a100-80gb",
     64, 1536, 4),
    ("gpt-1t", "gpt", {"layers": 128, "hidden": 25600, "heads": 160, "vocab": 51200, "seq_len": 2048}, "a100-80gb",
     3072, 3072, 12),
    ("hf-mamba-2l", _MAMBA, {"seq_len": 32}, "cpu", 4, 256, 10),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exhaustive", action="store_true", help="check each plan against an unpruned search")
    args = ap.parse_args()
    rows = []
    for name, model, cfg, cluster_name, gpus, batch, target in CASES:
        cluster = load_cluster(cluster_name).with_overrides(gpus=gpus)
        ctx = PassContext(cluster=cluster)
        t0 = time.perf_counter()
        traced = trace_model(model, cfg, ctx=ctx)
        t1 = time.perf_counter()
        res = search(traced.graph, cluster, ctx, batch, {}, cluster.usable_memory_bytes)
        t2 = time.perf_counter()
        est = res.best.estimate
        row = {"case": name, "gpus": gpus, "global_batch": batch, "trace_s": round(t1 - t0, 2),
               "search_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2), "target_s": target,
               "layouts_enumerated": res.enumerated, "pruned_by_bound": res.pruned_bound,
               "pruned_by_memory": res.pruned_memory, "layouts_evaluated": res.evaluated,
               "ilp_solves": res.ilp_solves, "ilp_status": res.ilp_status, "layout": est.layout.to_dict(),
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
              f"by memory, {res.evaluated} estimated; {res.ilp_solves} ILP solves ({res.ilp_status}) -> "
              f"{est.layout.to_dict()} "
              f"{est.iteration_time_s:.2f} s/iter, MFU {est.mfu:.1%}")
    out = Path(__file__).parent / "results" / "planning_time.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
