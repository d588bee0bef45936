"""``autopar show`` and ``autopar diff`` on saved plans: what they print and how they exit."""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES

from autopar.cli import main
from autopar.plan_file import Plan

CPU = ["--cluster", "cpu", "--gpus", "4", "--global-batch", "8"]
GPT = "layers=2,hidden=64,heads=4,vocab=256,seq_len=32"
LLAMA = "layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq_len=32"
MOE = "layers=2,hidden=64,heads=4,vocab=256,seq_len=32,experts=4,top_k=2"
MLP = "layers=2,hidden=512,in_dim=64,classes=16"  # big enough that tp splits weights on 4 CPU ranks
HF_LLAMA = "layers=2,hidden=256,heads=4,kv_heads=4,ffn=1024,vocab=256,seq_len=32"
HF_GPT2 = "layers=2,hidden=256,heads=4,vocab=256,seq_len=32"


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich tables unwrapped, so lines can be asserted whole


def _plan(tmp_path, name: str, model: str, config: str, fix: str) -> str:
    out = tmp_path / name
    assert main(["plan", model, "--config", config, *CPU, "--fix", fix, "-o", str(out), "--json"]) == 0
    return str(out / "plan.json")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plans")
    return {"tp2": _plan(tmp, "tp2", "gpt", GPT, "tp=2,pp=1,dp=2"),
            "pp2": _plan(tmp, "pp2", "gpt", GPT, "pp=2,tp=1,dp=2,schedule=1f1b,mbs=1"),
            "dp4": _plan(tmp, "dp4", "gpt", GPT, "tp=1,pp=1,dp=4"),
            "llama": _plan(tmp, "llama", "llama", LLAMA, "tp=2,dp=2"),
            "moe": _plan(tmp, "moe", "moe", MOE, "tp=2,dp=2"),
            "mlp": _plan(tmp, "mlp", "mlp", MLP, "tp=2,dp=2"),
            "hf_llama": _plan(tmp, "hf_llama", str(EXAMPLES / "hf_llama.py"), HF_LLAMA, "tp=2,dp=2"),
            "hf_gpt2": _plan(tmp, "hf_gpt2", str(EXAMPLES / "hf_gpt2.py"), HF_GPT2, "tp=2,dp=2")}


def _lines(capsys) -> list[str]:
    return [line.strip() for line in capsys.readouterr().out.splitlines()]


def test_show_prints_mesh_stages_sharding_time_and_memory(plans, capsys):
    assert main(["show", plans["tp2"]]) == 0
    out = "\n".join(_lines(capsys))
    assert "pp=1 x dp=2 x cp=1 x tp=2 = 4 devices" in out
    assert "dp=2 tp=2 pp=1" in out
    assert "Sharding: layer type" in out and "(blocks.0)" in out
    # a column-parallel fc splits its output features, the row-parallel projection its input features
    assert any(line.startswith("│ mlp.fc.weight") and "dim 0 on tp" in line for line in out.splitlines())
    assert any(line.startswith("│ mlp.proj.weight") and "dim 1 on tp" in line for line in out.splitlines())
    assert "Time per iteration" in out and "tp comm" in out
    assert "Memory per device" in out and "fits" in out


def test_show_lists_every_pipeline_stage(plans, capsys):
    assert main(["show", plans["pp2"]]) == 0
    rows = [line for line in _lines(capsys) if line.startswith("│ 0 ") or line.startswith("│ 1 ")]
    stage_rows = [r for r in rows if "+emb" in r or "+head" in r]
    assert len(stage_rows) == 2
    assert "+emb" in stage_rows[0] and "+head" in stage_rows[1]


@pytest.mark.parametrize("name", ["llama", "moe", "mlp", "hf_llama", "hf_gpt2"])
def test_show_and_explain_work_on_every_zoo_model_and_the_hf_examples(plans, capsys, name):
    assert main(["show", plans[name]]) == 0
    out = "\n".join(_lines(capsys))
    assert "Sharding: layer type" in out and "on tp" in out
    plan = Plan.load(plans[name])
    # a weight of the last layer: explained through the layer its type is listed under
    explained = {v["module"] for v in plan.op_strategies.values() if v.get("alternatives")}
    prefix = plan.model["layer_container"]
    weight = next(f for f in sorted(plan.parameters) if f.startswith(f"{prefix}.1.")
                  and f.rpartition(".")[0].replace(f"{prefix}.1.", f"{prefix}.0.", 1) in explained)
    assert main(["explain", plans[name], weight]) == 0
    out = "\n".join(_lines(capsys))
    assert f"parameter {weight}" in out and "chosen" in out and "instead" in out
    assert main(["diff", plans[name], plans["dp4"]]) == 1


def test_explain_an_op_shows_its_strategy_and_the_cheaper_losers(plans, capsys):
    plan = Plan.load(plans["tp2"])
    op = next(k for k, v in plan.op_strategies.items() if v["module"].endswith("mlp.fc"))
    assert main(["explain", plans["tp2"], op]) == 0
    out = "\n".join(_lines(capsys))
    rows = [[cell.strip() for cell in line.split("│")] for line in out.splitlines() if line.startswith("│ instead")]
    assert rows and all(row[3].startswith("+") for row in rows)  # the time column: every switch costs time
    assert "R, S(0)" in out  # the column-parallel fc: its weight split on dim 0


def test_explain_an_unknown_name_is_a_one_line_error(plans, capsys):
    assert main(["explain", plans["tp2"], "blocks.9.nothing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is neither an op nor a parameter" in err


def test_diff_names_the_changes_and_their_effect(plans, capsys):
    assert main(["diff", plans["tp2"], plans["dp4"]]) == 1
    out = "\n".join(_lines(capsys))
    assert "layout tp" in out and "layout dp" in out
    assert "dim 0 on tp" in out and "replicated" in out
    assert "Estimated effect" in out and "iteration" in out


def test_diff_of_a_plan_with_itself_exits_0(plans, capsys):
    assert main(["diff", plans["tp2"], plans["tp2"]]) == 0
    assert "are the same plan" in capsys.readouterr().out


def test_diff_json(plans, capsys):
    assert main(["diff", plans["tp2"], plans["dp4"], "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["same"]
    assert {"what": "layout tp", "before": 2, "after": 1} in data["changes"]


def test_show_refuses_a_file_that_is_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a JSON plan file" in err


def test_show_names_the_part_of_each_rack_a_gb200_job_uses(tmp_path, capsys):
    """256 GB200s are not whole NVL72 racks: the plan uses 64 GPUs of each (docs/clusters.md), and says so."""
    out = tmp_path / "gb200"
    assert main(["plan", "gpt", "--config", GPT, "--cluster", "gb200-nvl72", "--gpus", "256", "--global-batch", "256",
                 "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["show", str(out / "plan.json")]) == 0
    assert "256 x B200 (GB200 NVL72), 4 per node, NVLink domains of 64" in "\n".join(_lines(capsys))
