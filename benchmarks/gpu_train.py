"""Benchmark (needs a GPU): the generated ``train.py`` of a ~1B model on one GPU, compiled and eager, against its plan.

For each of ``--compile`` and ``--no-compile`` it plans the model for one GPU of ``--cluster`` (the plan prices
compiled blocks only when it compiles them), writes ``train.py``, runs it under torchrun for ``--steps`` steps on
synthetic tokens, and reads the run's closing summary (steady-state step time, tokens/s, MFU and peak memory, the
first step left out as warm-up) next to the plan's estimate.  It also records the device and its clock and power
once per run (``nvidia-smi --query-gpu``; pynvml may be missing).  One run of both modes takes a few minutes, needs
no network, and writes ``benchmarks/results/gpu_train_<device>.json``.

    python benchmarks/gpu_train.py [--cluster h100-80gb] [--steps 30] [--output FILE]
    python benchmarks/gpu_train.py --device cpu     # the same plumbing on CPU ranks, on a tiny model (a test)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autopar.runtime.launch import run_killing_the_group

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: GPT with 24 layers of width 2048 (1.3B parameters, GPT-3 XL's shape) at 2048 tokens, 8 sequences a step.
GPU_MODEL = ["gpt", "--config", "layers=24,hidden=2048,heads=16,vocab=50304,seq_len=2048"]
GPU_BATCH = 8
#: The CPU check: a tiny GPT on the ``cpu`` preset (one rank), eager only (Inductor's CPU backend compiles slowly).
CPU_MODEL = ["gpt", "--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32"]
CPU_BATCH = 4
SMI_FIELDS = "name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.total"


class BenchmarkError(Exception):
    """A run that cannot go on, said in one line."""


def device_info() -> dict[str, str]:
    """The first GPU as ``nvidia-smi`` reports it now (empty without one)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    line = out.stdout.strip().splitlines()[:1]
    return dict(zip(SMI_FIELDS.split(","), (v.strip() for v in line[0].split(",")))) if line else {}


def plan_for(folder: Path, model: list[str], cluster: str, batch: int, compile_: bool | None) -> dict[str, Any]:
    """Plan ``model`` for one device of ``cluster`` into ``folder`` (``plan.json`` and ``train.py``)."""
    cmd = [sys.executable, "-m", "autopar.cli", "plan", *model, "--cluster", cluster, "--gpus", "1",
           "--global-batch", str(batch), "-o", str(folder), "-q"]
    if compile_ is not None:
        cmd.append("--compile" if compile_ else "--no-compile")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    if proc.returncode != 0:
        raise BenchmarkError(f"planning failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads((folder / "plan.json").read_text())


def train(folder: Path, steps: int, compile_: bool, timeout_s: float) -> dict[str, Any]:
    """Run ``folder/train.py`` on one rank; its closing summary (the last line it prints) and the wall time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(folder / "train.py"), "--steps", str(steps), "--log-every", str(max(1, steps // 3)),
           "--metrics", str(folder / "metrics.jsonl"), "--compile" if compile_ else "--no-compile"]
    start = time.perf_counter()
    try:
        proc = run_killing_the_group(cmd, timeout_s=timeout_s, cwd=folder,
                                     env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"train.py ran past {timeout_s:g} s: stopped it") from None
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if re.search(r"(Error|Exception|error):", line)]
        raise BenchmarkError(f"train.py failed: {(errors or proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": wall_s}


def compare(summary: dict[str, Any]) -> dict[str, float]:
    """Measured over estimated: step time and peak memory (above what torch held before the model was built)."""
    est = summary["estimate"]
    added = summary["peak_memory_bytes"] - summary.get("baseline_memory_bytes", 0)
    return {"time_measured_over_estimate": summary["iteration_time_s"] / est["iteration_time_s"],
            "memory_measured_over_estimate": added / est["peak_memory_bytes"]}


def run(device: str, cluster: str, steps: int, timeout_s: float) -> dict[str, Any]:
    """Both modes (eager only on CPU), planned and trained, against their estimates."""
    gpu = device == "cuda"
    model, batch = (GPU_MODEL, GPU_BATCH) if gpu else (CPU_MODEL, CPU_BATCH)
    modes = (True, False) if gpu else (False,)
    out: dict[str, Any] = {"device": device, "cluster": cluster, "model": model, "global_batch": batch,
                           "steps": steps, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="autopar-gpu-train-") as tmp:
        for compile_ in modes:
            name = "compiled" if compile_ else "eager"
            folder = Path(tmp) / name
            plan = plan_for(folder, model, cluster, batch, compile_ if gpu else None)
            before = device_info()
            summary = train(folder, steps, compile_, timeout_s)
            out["runs"][name] = {"layout": plan["layout"], "summary": summary, **compare(summary),
                                 "gpu_before": before, "gpu_after": device_info()}
            print(f"{name}: {summary['tokens_per_s']:,.0f} tokens/s (plan {summary['estimate']['tokens_per_s']:,.0f}), "
                  f"step {summary['iteration_time_s']:.4g} s (plan {summary['estimate']['iteration_time_s']:.4g} s), "
                  f"peak memory {summary['peak_memory_bytes'] / 2**30:.2f} GiB "
                  f"(plan {summary['estimate']['peak_memory_bytes'] / 2**30:.2f} GiB), {summary['wall_s']:.0f} s",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cluster", default=None, help="the preset the plan assumes (default: h100-80gb; cpu on CPU)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per train.py run")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    cluster = args.cluster or ("h100-80gb" if args.device == "cuda" else "cpu")
    try:
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise BenchmarkError("no CUDA device here: run it where a GPU is, or with --device cpu for the "
                                     "plumbing alone")
        result = run(args.device, cluster, args.steps, args.timeout_s)
    except (BenchmarkError, subprocess.TimeoutExpired) as exc:
        print(f"gpu_train: error: {exc}", file=sys.stderr)
        return 2
    tag = re.sub(r"[^a-z0-9]+", "-", result["runs"][next(iter(result["runs"]))]["gpu_before"].get(
        "name", args.device).lower()).strip("-")
    output = args.output or RESULTS / f"gpu_train_{tag}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
