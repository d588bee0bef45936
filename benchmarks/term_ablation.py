"""Benchmark: how far each term of the cost model moves the estimates of every published table.

Each reference table (``benchmarks/reference``) is estimated with the full model, then with one term switched off
at a time, and the per-GPU median signed errors are printed and written to ``results/term_ablation.json``:

- ``power``: no power cap (every kernel at the boost clock, communication costs no clock: ``autopar.power``);
- ``interference``: collectives take no SMs and no HBM bandwidth from the compute beside them
  (``autopar.interference``; the clock they cost stays with ``power``);
- ``host``: launching costs the host nothing (no host-bound passes);
- ``kernel_latency``: a product kernel has no fixed time beyond the gap every kernel pays;
- ``gemm_store``: products store their results beside their main loop on every device (Ampere's store after it,
  ``Cluster.gemm_stores_after_main_loop``);
- ``metrics``: the training loop computes no metric over the logits (``Framework.metric_cross_entropies``: Composer's
  two cross-entropies per micro-batch in llm-foundry).

    python benchmarks/term_ablation.py [--tables calibration,nvidia_h100_tables]

``--tables`` reruns those tables and replaces their entries in the results file, keeping the others'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibration
import reference_runs

RESULTS = Path(__file__).resolve().parent / "results" / "term_ablation.json"
TABLES = ("calibration", "llm_foundry_tables", "megatron_core_h100_table", "nvidia_h100_tables",
          "nvidia_blackwell_tables")
TERMS = ("power", "interference", "host", "kernel_latency", "gemm_store", "metrics")


def _without(term: str, run: reference_runs.ReferenceRun) -> reference_runs.ReferenceRun:
    c, fw = run.cluster, dict(run.framework_overrides)
    if term == "power":
        c = dataclasses.replace(c, loaded_clock_hz=c.boost_clock_hz)
    elif term == "interference":
        c = dataclasses.replace(c, nccl_channels=0, nccl_network_channels=0, comm_hbm_bytes_per_byte=0.0)
        fw["tp_overlap_comm_sms"] = 0
    elif term == "host":
        c = dataclasses.replace(c, kernel_launch_s=0.0)
        fw["host_op_s"] = 0.0
    elif term == "kernel_latency":
        c = dataclasses.replace(c, gemm_latency_s=c.kernel_gap_s)
    elif term == "gemm_store":
        c = dataclasses.replace(c, gemm_stores_after_main_loop=False)
    elif term == "metrics":
        fw["metric_cross_entropies"] = 0
    return dataclasses.replace(run, cluster=c, framework_overrides=fw)


def estimate_table(stem: str, term: str | None) -> list[dict[str, Any]]:
    """Every row of ``reference/<stem>.json`` with ``term`` switched off (``None``: the full model)."""
    original = calibration.reference_run
    if term is not None:
        calibration.reference_run = lambda case: _without(term, original(case))
    try:
        return calibration.run_all(reference_runs.load_calibration(reference_runs.REFERENCE_DIR / f"{stem}.json"))
    finally:
        calibration.reference_run = original


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median signed error per GPU and precision, and over the table."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.get("error") is None:
            continue
        groups.setdefault(f"{r.get('cluster')} {r.get('precision', 'bf16')}", []).append(r["error"])
        groups.setdefault("all", []).append(r["error"])
    return {k: statistics.median(v) for k, v in sorted(groups.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", default=",".join(TABLES))
    args = ap.parse_args()
    out: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    t0 = time.perf_counter()
    for stem in args.tables.split(","):
        out[stem] = {}
        for term in (None, *TERMS):
            out[stem][term or "full model"] = summary(estimate_table(stem, term))
        full = out[stem]["full model"]
        print(f"{stem}: median signed error by GPU, full model and with each term off")
        for group, value in full.items():
            moved = ", ".join(f"{t} off {out[stem][t].get(group, float('nan')):+.1%}" for t in list(out[stem])[1:])
            print(f"  {group}: {value:+.1%} ({moved})")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
