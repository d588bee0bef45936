"""A generated ``train.py`` at a size where memory matters: 355M parameters, ZeRO-3 over 8 CPU ranks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.plan_file import Plan

REPO = Path(__file__).resolve().parents[1]

ZERO3_GPT = ["models/gpt.py", "--config", "layers=24,hidden=1024,heads=16,vocab=50304,seq_len=128", "--cluster", "cpu",
             "--gpus", "8", "--global-batch", "8", "--seq-len", "128", "--fix", "dp=8,zero=3"]


@pytest.mark.slow
def test_zero3_script_holds_a_shard_per_rank(tmp_path, capsys):
    args = list(ZERO3_GPT)
    args[0] = str(REPO / args[0])
    assert main(["plan", *args, "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    plan = Plan.load(tmp_path / "plan.json")
    params = sum(math.prod(p["shape"]) for p in plan.parameters.values())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                           str(tmp_path / "train.py"), "--steps", "2"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("tokens/s" in s and "MFU" in s for s in steps)
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["steps"] == 2 and summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    added = summary["peak_memory_bytes"] - summary["baseline_memory_bytes"]
    # each rank's AdamW state is 16 B / 8 ranks = 2 B per parameter; one fp32 copy of the weights is 4 B
    assert 2 * params < added < 4 * params, (added / params)

