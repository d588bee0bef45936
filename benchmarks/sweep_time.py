"""Benchmark: ``autopar sweep`` of Llama 3 8B, 70B and 405B on 15T tokens over 5 GPU types and 8 sizes each.

120 points (3 models x a100-80gb, h100-80gb, h200, b200, gb200-nvl72 x 64, 128, ..., 8192 GPUs, the GB200 counts
rounded to whole racks of 72), 4Mi tokens per batch (512 sequences of 8192), in a pool of ``--jobs`` processes
(default 2: the 2 cores of the target machine).  Target: all 120 within 300 s on 2 idle cores, tracing included.
Prints each model's time and the points' outcomes, and writes ``benchmarks/results/sweep_time.json``.

    python benchmarks/sweep_time.py [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from autopar.sweep.quantities import parse_gpu_counts
from autopar.sweep.sweep import SweepRequest, run_sweep

RESULTS = Path(__file__).resolve().parent / "results" / "sweep_time.json"
TARGET_S = 300.0
CLUSTERS = ["a100-80gb", "h100-80gb", "h200", "b200", "gb200-nvl72"]
GPUS = parse_gpu_counts("64,128,...,8192")
_LLAMA3 = {"vocab": 128256, "seq_len": 8192, "rope_theta": 500000.0}
# Llama 3.1's published shapes (examples/configs/llama-3.1-*/config.json, with their sources)
MODELS = {
    "llama3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, **_LLAMA3},
    "llama3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, **_LLAMA3},
    "llama3-405b": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, **_LLAMA3},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="processes that plan the points (default 2)")
    args = ap.parse_args()
    rows, total = [], 0.0
    for name, config in MODELS.items():
        req = SweepRequest(model="models/llama.py", clusters=CLUSTERS, gpus=GPUS, tokens=15e12, config=config)
        t0 = time.perf_counter()
        result = run_sweep(req, jobs=args.jobs)
        elapsed = time.perf_counter() - t0
        total += elapsed
        outcomes = Counter(r["status"] for r in result.rows)
        best = min(result.ok(), key=lambda r: r["wall_s"])
        slowest = sorted(result.elapsed_s.items(), key=lambda kv: -kv[1])[:5]
        rows.append({"model": name, "points": len(result.rows), "time_s": round(elapsed, 1),
                     "outcomes": dict(sorted(outcomes.items())),
                     "fastest": {"point": best["point"], "layout": best["layout"], "days": best["wall_s"] / 86400},
                     "slowest_points_s": {k: round(v, 1) for k, v in slowest}})
        print(f"{name}: {len(result.rows)} points in {elapsed:.1f} s ({dict(sorted(outcomes.items()))}); fastest "
              f"{best['point']} {best['layout']}: {best['wall_s'] / 86400:.1f} days; slowest points "
              + ", ".join(f"{k} {v:.1f} s" for k, v in slowest), flush=True)
    points = sum(r["points"] for r in rows)
    print(f"all: {points} points in {total:.1f} s with {args.jobs} processes (target {TARGET_S:.0f} s): "
          f"{'met' if total <= TARGET_S else 'MISSED'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"jobs": args.jobs, "target_s": TARGET_S, "total_s": round(total, 1),
                                   "points": points, "models": rows}, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
