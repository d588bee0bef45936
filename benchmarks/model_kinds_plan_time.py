"""Benchmark: planning the models beyond decoder LMs, printed and written as JSON.

Target: each plans in under 30 s on 2 idle cores, building the model on fake tensors, tracing and searching
included.  The cases are the ones ``benchmarks/runtime_matrix.py`` verifies (``examples/hf_models.py``'s
small configs of each kind on 4 CPU ranks, as a new user tries them, and the zoo's DiT), plus DiT-XL/2 at
full size on 8 H100s.  What runs is ``autopar plan`` (the API behind it), with nothing pinned.

    python benchmarks/model_kinds_plan_time.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar import modelfile
from autopar.api import plan_model

ROOT = Path(__file__).resolve().parents[1]
HF_MODELS = ROOT / "examples" / "hf_models.py"
DIT = ROOT / "models" / "dit.py"
TARGET_S = 30.0
#: (name, model file, config, cluster, devices, global batch)
CASES = [(f"hf {arch}", HF_MODELS, {"arch": arch, "seq_len": 32}, "cpu", 4, 8)
         for arch in modelfile.load_module(str(HF_MODELS)).ARCHS]
CASES += [("dit small", DIT, {"layers": 2, "hidden": 256, "heads": 4, "image": 8, "classes": 10}, "cpu", 4, 8),
          ("dit-xl/2", DIT, {}, "h100-80gb", 8, 256)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()
    rows = []
    for name, path, config, cluster, devices, batch in CASES:
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        plan = plan_model(str(path), config=config, cluster=cluster, gpus=devices, global_batch=batch).plans[0]
        wall = time.perf_counter() - t0
        rows.append({"case": name, "cluster": cluster, "devices": devices, "global_batch": batch,
                     "parameters": sum(math.prod(p["shape"]) for p in plan.parameters.values()),
                     "plan_s": round(wall, 2), "target_s": TARGET_S, "layout": plan.layout,
                     "iteration_time_s": plan.estimate["iteration_time_s"]})
    table = Table(title=f"Planning models beyond decoders (target {TARGET_S:.0f} s each)")
    for col in ("case", "cluster", "params", "plan s", "layout", "iteration"):
        table.add_column(col)
    for r in rows:
        lay = r["layout"]
        table.add_row(r["case"], f"{r['devices']} x {r['cluster']}", f"{r['parameters'] / 1e6:.1f} M",
                      f"{r['plan_s']:.1f}", f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} mbs{lay['mbs']} z{lay['zero']}",
                      f"{r['iteration_time_s'] * 1e3:.2f} ms")
    Console().print(table)
    slow = [r["case"] for r in rows if r["plan_s"] > TARGET_S]
    print("all under target" if not slow else f"over target: {', '.join(slow)}")
    out = ROOT / "benchmarks" / "results" / "model_kinds_plan_time.json"
    out.write_text(json.dumps({"target_s": TARGET_S, "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
