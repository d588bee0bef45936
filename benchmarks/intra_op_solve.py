"""Benchmark: intra-op ILP build + solve time for GPT-3 175B on a tp=8 mesh, with layer tying.

Target: < 2 s for 96 layers, and nearly flat from 24 to 128 layers.  Prints the number of variables and
constraints and writes ``benchmarks/results/intra_op_solve.json``.

    python benchmarks/intra_op_solve.py [--batch 16] [--backend cbc]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autopar.passes import PassContext

from autopar.cluster import MeshSpec, load_cluster
from autopar.frontend import trace_model
from autopar.intra_op.problem import IntraOpConfig, solve_intra_op

GPT3 = {"hidden": 12288, "heads": 96, "vocab": 51200, "seq_len": 2048}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16, help="samples per micro-batch on the tp group")
    ap.add_argument("--backend", default="cbc", choices=("cbc", "highs", "cpsat"))
    ap.add_argument("--layers", default="24,48,96,128")
    args = ap.parse_args()
    cluster = load_cluster("a100-80gb").with_overrides(gpus=8)
    ctx = PassContext(cluster=cluster)
    mesh = MeshSpec.on_cluster(cluster, ("tp",), (8,))
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        t0 = time.perf_counter()
        graph = trace_model("gpt", {**GPT3, "layers": layers}, ctx=ctx).graph
        trace_s = time.perf_counter() - t0
        cfg = IntraOpConfig(batch=args.batch, grad_sync_weight=1 / 64, backend=args.backend)
        t1 = time.perf_counter()
        sol = solve_intra_op(graph, [n.name for n in graph.ops()], mesh, cfg, cluster, ctx)
        total_s = time.perf_counter() - t1
        r = sol.result
        row = {"layers": layers, "trace_s": round(trace_s, 3), "build_s": round(sol.build_time_s, 3),
               "solve_s": round(r.solve_time_s, 3), "build_plus_solve_s": round(total_s, 3),
               "variables": r.num_variables, "constraints": r.num_constraints, "groups": sol.num_groups,
               "status": r.status, "objective_s": r.objective_s}
        rows.append(row)
        print(f"layers={layers:4d}  build+solve {total_s:6.3f} s (build {sol.build_time_s:.3f}, solve "
              f"{r.solve_time_s:.3f})  vars {r.num_variables}  constraints {r.num_constraints}  {r.status}  "
              f"(trace {trace_s:.1f} s, not counted)")
    out = Path(__file__).parent / "results" / "intra_op_solve.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"mesh": {"tp": 8}, "batch": args.batch, "backend": args.backend, "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
