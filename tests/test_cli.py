"""The ``autopar plan`` command: summary output and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main

SMALL = "layers=2,hidden=64,heads=4,vocab=128,seq_len=32"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_model_section(capsys):
    code, out, err = run(capsys, "plan", "gpt", "--config", SMALL, "--global-batch", "8", "--json")
    assert code == 0, err
    data = json.loads(out)
    model = data["model"]
    for key in ("parameters", "layers", "layer_types", "flops_per_token", "trace_time_s"):
        assert key in model
    assert model["layers"] == 2 and len(model["layer_types"]) == 1 and model["layer_types"][0]["count"] == 2
    assert model["flops_per_iteration"] == pytest.approx(8 * model["seq_len"] * model["flops_per_token"])


def test_plan_human_summary(capsys):
    code, out, _ = run(capsys, "plan", "gpt", "--config", SMALL)
    assert code == 0
    assert "parameters" in out and "FLOPs per token" in out and "optimizer state" in out


def test_plan_model_file_path(capsys, examples):
    code, out, err = run(capsys, "plan", str(examples / "hf_llama.py"), "--config",
                         "layers=2,hidden=64,heads=4,kv_heads=4", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["layers"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "missing_model.py"], "model file not found: missing_model.py"),
        (["plan", "{fixtures}/no_build.py"], "defines no build_model"),
        (["plan", "gpt", "--config", "layerz=2"], "unknown config key 'layerz'"),
        (["plan", "gpt", "--config", SMALL, "--cluster", "tpu-v9"], "unknown cluster 'tpu-v9'"),
        (["plan", "gpt", "--config", SMALL, "--cluster", "{fixtures}/bad_key.toml"], "unknown key 'peak_flop'"),
        (["plan", "{fixtures}/untraceable.py"], "torch.export could not trace the model"),
        (["plan", "gpt", "--config", "layers"], "expected key=value"),
        (["plan", "gpt", "--gpus", "0"], "--gpus must be >= 1"),
        (["plan", "gpt", "--bogus-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(capsys, fixtures, argv, message):
    argv = [a.replace("{fixtures}", str(fixtures)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert message in lines[0]
    assert "Traceback" not in err and out == ""


def test_debug_shows_traceback(capsys):
    code = main(["plan", "gpt", "--config", "layerz=2", "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err


def test_evaluate_the_shipped_candidates(capsys, examples):
    # the README's evaluate line: every layout of examples/candidates.jsonl is estimated (64 GPUs)
    code, out, err = run(capsys, "evaluate", "gpt", "--config", "layers=8,hidden=256,heads=8,vocab=512,seq_len=128",
                         "--gpus", "64", "--layouts", str(examples / "candidates.jsonl"))
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == len((examples / "candidates.jsonl").read_text().splitlines()) == 5
    assert all("error" not in line and line["estimate"]["fits"] for line in lines), lines


def test_quiet_prints_nothing_but_errors(capsys, tmp_path, examples):
    out = tmp_path / "out"
    code, stdout, stderr = run(capsys, "plan", "gpt", "--config", SMALL, "--gpus", "8", "--global-batch", "8",
                               "-o", str(out), "--quiet")
    assert code == 0 and stdout == stderr == "" and (out / "plan.json").exists()
    code, stdout, stderr = run(capsys, "codegen", str(out / "plan.json"), "-o", str(tmp_path / "t.py"), "-q")
    assert code == 0 and stdout == stderr == "" and (tmp_path / "t.py").exists()
    code, stdout, stderr = run(capsys, "evaluate", "gpt", "--config", SMALL, "--gpus", "64", "--layouts",
                               str(examples / "candidates.jsonl"), "-q")
    assert code == 0 and stdout == stderr == ""
    code, stdout, stderr = run(capsys, "plan", "gpt", "--config", "layers=-1", "-q")
    assert code == 2 and stdout == "" and stderr.count("\n") == 1 and "layers must be a positive integer" in stderr


def test_json_prints_only_json(capsys, tmp_path):
    code, stdout, _ = run(capsys, "plan", "gpt", "--config", SMALL, "--gpus", "8", "--global-batch", "8", "--json",
                          "-o", str(tmp_path / "o"), "--trace", str(tmp_path / "t.json"))
    assert code == 0
    data = json.loads(stdout)  # the whole of stdout is one JSON object
    assert data["plan_file"].endswith("plan.json") and data["trace_file"].endswith("t.json")
