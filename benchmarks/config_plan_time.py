"""Benchmark: planning the published configs of ``examples/configs`` at full size, printed and written as JSON.

Target: each plans in under 60 s on 2 idle cores, building the model on fake tensors, tracing and searching
included, on an H100 cluster of the size such a model trains on (64 to 512 GPUs, sequence 4096, the default
global batch).  What runs is ``autopar plan hf:examples/configs/NAME`` (the API behind it).

    python benchmarks/config_plan_time.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.api import plan_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
TARGET_S = 60.0
#: (config folder, GPUs): a cluster of the scale each model trains on.
CASES = [
    ("llama-3.1-8b", 64), ("llama-3.1-70b", 512), ("llama-3.1-405b", 1024), ("mixtral-8x7b", 256),
    ("qwen2.5-7b", 64), ("qwen2.5-72b", 512), ("gemma-2-27b", 256), ("deepseek-v2-lite", 64),
    ("vit-huge-patch14-224", 64), ("t5-v1_1-xxl", 256),
]
SEQ_LEN = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()
    rows = []
    for name, gpus in CASES:
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        planning = plan_model(f"hf:{CONFIGS / name}", cluster="h100-80gb", gpus=gpus, seq_len=SEQ_LEN)
        wall = time.perf_counter() - t0
        plan = planning.plans[0]
        rows.append({"config": name, "gpus": gpus, "seq_len": plan.seq_len, "global_batch": plan.global_batch,
                     "parameters": sum(math.prod(p["shape"]) for p in plan.parameters.values()),
                     "plan_s": round(wall, 2), "target_s": TARGET_S, "layout": plan.layout,
                     "iteration_time_s": plan.estimate["iteration_time_s"], "mfu": plan.estimate["mfu"]})
    table = Table(title=f"Planning the published configs (target {TARGET_S:.0f} s each)")
    for col in ("config", "GPUs", "params", "plan s", "layout", "iteration", "MFU"):
        table.add_column(col)
    for r in rows:
        lay = r["layout"]
        table.add_row(r["config"], str(r["gpus"]), f"{r['parameters'] / 1e9:.2f} B", f"{r['plan_s']:.1f}",
                      f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} ep{lay.get('ep', 1)} z{lay['zero']} "
                      f"{lay['recompute']}", f"{r['iteration_time_s']:.3f} s", f"{r['mfu']:.1%}")
    Console().print(table)
    slow = [r["config"] for r in rows if r["plan_s"] > TARGET_S]
    print("all under target" if not slow else f"over target: {', '.join(slow)}")
    out = ROOT / "benchmarks" / "results" / "config_plan_time.json"
    out.write_text(json.dumps({"target_s": TARGET_S, "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
