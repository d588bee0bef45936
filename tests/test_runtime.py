"""``autopar verify`` on data-parallel plans (4 CPU ranks, gloo): same numbers as one process."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main

SMALL = ["gpt", "--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32", "--cluster", "cpu",
         "--global-batch", "8"]


def _plan(tmp_path, fix: str) -> str:
    assert main(["plan", *SMALL, "--fix", fix, "-o", str(tmp_path)]) == 0
    return str(tmp_path / "plan.json")


@pytest.mark.slow
@pytest.mark.parametrize(("fix", "sharded"), [("dp=4,zero=0", False), ("dp=4,zero=3", True)])
def test_verify_data_parallel_plans(tmp_path, capsys, fix, sharded):
    plan = _plan(tmp_path, fix)
    capsys.readouterr()
    code = main(["verify", plan, "--steps", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["ok"] and out["sharded_parameters"] is sharded
    assert max(out["loss_rel_diff"], out["grad_rel_diff"], out["param_rel_diff"]) <= 1e-4
    assert len(out["losses"]) == 3


def test_verify_refuses_plans_it_cannot_run_yet(tmp_path, capsys):
    plan = _plan(tmp_path, "tp=2,dp=2")
    capsys.readouterr()
    code = main(["verify", plan])
    err = capsys.readouterr().err
    assert code == 2 and "tensor and pipeline parallel runtimes are not implemented yet" in err


def test_verify_rejects_large_plans(tmp_path, capsys):
    assert main(["plan", *SMALL[:3], "--gpus", "16", "--global-batch", "16", "--fix", "dp=16",
                 "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "plan.json")])
    assert code == 2 and "at most 8 ranks" in capsys.readouterr().err
