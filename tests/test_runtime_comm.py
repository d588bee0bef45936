"""The tp bytes the runtime moves are the bytes the plan records (``benchmarks/runtime_comm.py``, smaller).

Each plan is applied on a fake process group of 8 ranks in one process; the collectives on the tp group
of one training iteration are counted by their real bytes and compared with the plan's
``estimated_tp_bytes_per_microbatch`` (times the micro-batches, plus the per-iteration synchronization).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from pathlib import Path

import pytest

from autopar.cli import main

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CONFIG = "layers=2,hidden=1024,heads=8,vocab=8192,seq_len=64"


@pytest.fixture(scope="module")
def runtime_comm():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("runtime_comm")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
@pytest.mark.parametrize(("model", "config", "fix"), [
    # tp without sequence parallelism (all-reduces) is llama's case, with it (all-gathers, reduce-scatters) gpt's;
    # the benchmark (benchmarks/runtime_comm.py) runs more
    ("gpt", "layers=2,hidden=2048,heads=16,vocab=8192,seq_len=64", "tp=8,sp=on"),
    ("llama", CONFIG, "dp=2,tp=4,sp=off,zero=0"),
    ("moe", CONFIG + ",experts=8", "tp=8,sp=off"),
], ids=["gpt-tp8-sp", "llama-dp2xtp4", "moe-tp8"])
def test_runtime_moves_the_tp_bytes_the_plan_records(tmp_path, monkeypatch, runtime_comm, model, config, fix):
    monkeypatch.setenv("AUTOPAR_DEVICE", "cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", model, "--config", config, "--cluster", "a100-80gb", "--gpus", "8", "--global-batch",
                     "8", "--fix", fix, "-o", str(tmp_path)]) == 0
    row = runtime_comm.measure(tmp_path / "plan.json")
    assert row["planned_tp_bytes"] > 0, "the plan shards nothing on tp: pick a larger model"
    assert 0.9 <= row["ratio"] <= 1.1, row


@pytest.mark.slow
@pytest.mark.parametrize("fix", ["dp=8,ep=4", "dp=4,tp=2,ep=2,sp=off"], ids=["dp8-ep4", "dp4xtp2-ep2"])
def test_runtime_moves_the_all_to_all_bytes_the_plan_records(tmp_path, monkeypatch, runtime_comm, fix):
    """Expert parallelism: the dispatch and combine all-to-alls of one iteration (forward and backward) are
    the bytes the plan records per micro-batch (``estimated_ep_bytes_per_microbatch``) times the
    micro-batches; with tp the experts are split there too and each tp rank exchanges only its share."""
    monkeypatch.setenv("AUTOPAR_DEVICE", "cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "moe", "--config", CONFIG + ",experts=8", "--cluster", "a100-80gb", "--gpus", "8",
                     "--global-batch", "8", "--fix", fix, "-o", str(tmp_path)]) == 0
    row = runtime_comm.measure(tmp_path / "plan.json")
    assert row["planned_ep_bytes"] > 0 and 0.9 <= row["ep_ratio"] <= 1.1, row
