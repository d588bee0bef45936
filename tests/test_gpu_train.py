"""``benchmarks/gpu_train.py`` (issue: a GPU run of train.py against its plan): its plumbing on one CPU rank, and its
one-line refusal where no GPU is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_train


def test_the_cpu_run_plans_trains_and_compares_with_the_estimate(tmp_path):
    out = tmp_path / "result.json"
    assert gpu_train.main(["--device", "cpu", "--steps", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"]["eager"]
    assert run["layout"]["dp"] == 1 and run["summary"]["steps"] == 2
    assert run["time_measured_over_estimate"] == pytest.approx(
        run["summary"]["iteration_time_s"] / run["summary"]["estimate"]["iteration_time_s"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert gpu_train.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]
