"""Benchmark: `autopar verify` over a wider matrix of models and layouts than CI has time for.

Each case plans a small model with ``--fix`` on a 4- or 8-device ``cpu`` cluster, launches it on local
CPU ranks (gloo), and compares loss, gradients and parameters with one process over 3 steps.  Prints a
table and writes ``benchmarks/results/runtime_matrix.json``.  About 30 s per case on 2 cores.

    python benchmarks/runtime_matrix.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.cli import main as cli
from autopar.errors import AutoparError
from autopar.runtime.verify import verify

ROOT = Path(__file__).resolve().parents[1]
GPT = "layers=4,hidden=256,heads=8,vocab=256,seq_len=16"
WIDE = "layers=2,hidden=512,heads=8,vocab=256,seq_len=16"
LLAMA = "layers=4,hidden=512,heads=8,kv_heads=4,vocab=256,seq_len=32"
MOE = "layers=4,hidden=128,heads=4,vocab=256,seq_len=16,experts=4"
HF_LLAMA = "layers=4,hidden=512,heads=8,ffn=1024,vocab=256,seq_len=16"
HF_GPT2 = "layers=4,hidden=512,heads=8,vocab=256,seq_len=16"

CASES = [
    # name, model, config, --fix, devices
    ("gpt zero1", "gpt", GPT, "dp=4,zero=1", 4),
    ("gpt zero2 x2 micro-batches", "gpt", GPT, "dp=4,zero=2,mbs=1", 4),
    ("gpt tp4 sp", "gpt", WIDE, "tp=4,sp=on", 4),
    ("gpt pp2 interleaved x tp2 sp", "gpt", GPT, "pp=2,tp=2,sp=on,schedule=interleaved,v=2", 4),
    ("gpt pp2 x dp2 x tp2 zero3", "gpt", GPT, "pp=2,dp=2,tp=2,sp=off,zero=3", 8),
    ("llama (GQA) tp4 sp", "llama", LLAMA, "tp=4,sp=on", 4),
    ("llama pp2 x tp2 full recompute", "llama", LLAMA, "pp=2,tp=2,sp=off,recompute=full", 4),
    ("moe pp2 x tp2", "moe", MOE, "pp=2,tp=2,sp=off", 4),
    ("moe dp2 x tp2 selective", "moe", MOE, "dp=2,tp=2,sp=on,recompute=selective", 4),
    ("hf llama tp4 sp zero0", str(ROOT / "examples/hf_llama.py"), HF_LLAMA, "tp=4,sp=on", 4),
    ("hf llama pp4 1f1b", str(ROOT / "examples/hf_llama.py"), HF_LLAMA, "pp=4,schedule=1f1b", 4),
    ("hf gpt2 dp2 x tp2 (Conv1D)", str(ROOT / "examples/hf_gpt2.py"), HF_GPT2, "dp=2,tp=2,sp=off", 4),
]


def run_case(model: str, config: str, fix: str, devices: int, workdir: Path) -> dict:
    argv = ["plan", model, "--config", config, "--cluster", "cpu", "--gpus", str(devices), "--global-batch", "8",
            "--fix", fix, "-o", str(workdir)]
    with contextlib.redirect_stdout(io.StringIO()):  # the plan summary: not what this benchmark reports
        code = cli(argv)
    if code != 0:
        return {"ok": False, "error": "planning failed"}
    plan = json.loads((workdir / "plan.json").read_text())
    try:
        res = verify(workdir / "plan.json")
    except AutoparError as exc:
        return {"ok": False, "error": str(exc), "layout": plan["layout"]}
    return {"ok": res.ok, "layout": plan["layout"], "loss_rel_diff": res.loss_rel_diff,
            "grad_rel_diff": res.grad_rel_diff, "param_rel_diff": res.param_rel_diff,
            "sharded_on_tp": sorted({k for k, v in res.placements.items() if v.get("tp", "R") != "R"})[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()
    rows = []
    for name, model, config, fix, devices in CASES:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            row = {"case": name, "fix": fix, **run_case(model, config, fix, devices, Path(tmp))}
            row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    table = Table(title="autopar verify matrix (3 steps, tolerance 1e-4)")
    for col in ("case", "ok", "loss", "grads", "params", "wall"):
        table.add_column(col)
    for r in rows:
        diffs = [f"{r[k]:.1e}" if k in r else "-" for k in ("loss_rel_diff", "grad_rel_diff", "param_rel_diff")]
        table.add_row(r["case"], "OK" if r["ok"] else f"FAIL {r.get('error', '')}", *diffs, f"{r['wall_s']} s")
    Console().print(table)
    out = ROOT / "benchmarks" / "results" / "runtime_matrix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
