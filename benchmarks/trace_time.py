"""Benchmark: tracing a Llama-7B-sized model on fake tensors (target: < 10 s and < 2 GB RSS).

Runs in a fresh interpreter so the RSS is the trace's own.

    python benchmarks/trace_time.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, time
t0 = time.perf_counter()
from autopar.frontend import trace_model
cfg = dict(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq_len=4096)
t1 = time.perf_counter()
g = trace_model("llama", cfg).graph
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "trace_and_passes_s": t2 - t1, "export_s": g.trace_time_s,
                  "nodes": len(g), "parameters": g.num_parameters,
                  "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def main() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"llama-7b: trace + passes {row['trace_and_passes_s']:.2f} s (target < 10 s), max RSS "
          f"{row['max_rss_gb']:.2f} GB (target < 2 GB), {row['nodes']} nodes, {row['parameters']:,} parameters")
    path = Path(__file__).parent / "results" / "trace_time.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(row, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
