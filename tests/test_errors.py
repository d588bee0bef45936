"""Bad input: one line that names the problem, exit code 2, no traceback and no file written."""

from __future__ import annotations

import json
import textwrap

import autopar.solvers.ilp as ilp
import pytest
from autopar.solvers.request import SolverResult

from autopar.cli import main

SMALL = "layers=2,hidden=64,heads=4,vocab=128,seq_len=32"
CPU = ["--cluster", "cpu", "--gpus", "4", "--global-batch", "8"]

MODEL_FILES = {
    "no_build.py": "x = 1\n",
    "raises.py": "def build_model(**config):\n    raise RuntimeError('weights server down')\n",
    "untraceable.py": textwrap.dedent('''
        import torch
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(16, 8)

            def forward(self, x):
                h = self.emb(x)
                if h.sum() > 0:  # data-dependent control flow
                    h = h * 2
                return h

        def build_model():
            return M()
    '''),
    "batch_second.py": textwrap.dedent('''
        import torch
        from torch import nn

        def build_model(seq_len=16):
            return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))

        def example_inputs(batch_size, seq_len, **config):
            return torch.randint(0, 64, (seq_len, batch_size))  # [seq, batch], as nn.Transformer's default
    '''),
}


@pytest.fixture
def files(tmp_path):
    for name, text in MODEL_FILES.items():
        (tmp_path / name).write_text(text)
    bad = tmp_path / "bad_cluster.toml"
    bad.write_text('name = "x"\nbase = "a100-80gb"\ngpus = "many"\n')
    unknown = tmp_path / "unknown_key.toml"
    unknown.write_text('name = "x"\nbase = "a100-80gb"\ngpu_count = 8\n')
    return tmp_path


def _fails(capsys, tmp_path, argv: list[str], *expected: str) -> None:
    out = tmp_path / "out"
    assert main([*argv, "-o", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("autopar: error: "), err
    assert "Traceback" not in err + captured.out
    for text in expected:
        assert text in err, err
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize(("argv", "expected"), [
    (["plan", "missing.py"], ["model file not found: missing.py"]),
    (["plan", "{files}/no_build.py"], ["defines no build_model"]),
    (["plan", "{files}/raises.py"], ["build_model raised RuntimeError: weights server down"]),
    (["plan", "{files}/untraceable.py", "--seq-len", "8", *CPU],
     ["could not trace the model at", "untraceable.py:12 (if h.sum() > 0:)"]),
    (["plan", "{files}/batch_second.py", "--seq-len", "16", *CPU],
     ["returned input 0 of shape [16, 2]: dim 0 of every input must be the batch"]),
    (["plan", "gpt", "--config", "layers=-1"], ["layers must be a positive integer, got -1"]),
    (["plan", "gpt", "--config", "layers=two"], ["build_model rejected the config"]),
    (["plan", "llama", "--config", "hidden=0"], ["hidden must be a positive integer, got 0"]),
    (["plan", "gpt", "--config", "depth=3"], ["unknown config key 'depth'"]),
    (["plan", "gpt", "--cluster", "nosuch"], ["unknown cluster 'nosuch'"]),
    (["plan", "gpt", "--cluster", "{files}/bad_cluster.toml"], ["gpus must be an integer"]),
    (["plan", "gpt", "--cluster", "{files}/unknown_key.toml"], ["unknown key 'gpu_count'"]),
    (["plan", "gpt", "--framework", "jax"], ["unknown framework"]),
    (["plan", "gpt", "--config", SMALL, "--gpus", "8", "--global-batch", "12", "--fix", "dp=8"],
     ["global batch 12 is not divisible by dp=8"]),
    (["plan", "gpt", "--config", SMALL, "--fix", "foo=1"], ["unknown layout key 'foo'"]),
    (["plan", "gpt", "--gpus", "8", "--memory-limit", "0.01"], ["no layout fits in", "the leanest needs"]),
], ids=["missing-file", "no-build-model", "build-model-raises", "untraceable", "batch-second", "negative-layers",
        "wrong-type",
        "zero-hidden", "unknown-config-key", "unknown-preset", "malformed-cluster", "unknown-cluster-key",
        "unknown-framework", "batch-does-not-divide", "unknown-layout-key", "nothing-fits"])
def test_bad_planning_input(capsys, files, argv, expected):
    _fails(capsys, files, [a.replace("{files}", str(files)) for a in argv], *expected)


@pytest.fixture
def plan_file(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["plan", "gpt", "--config", SMALL, *CPU, "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    return out / "plan.json"


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda text: "{not json", "not a JSON plan file"),
    (lambda text: text.replace('"schema_version": 7', '"schema_version": 6'), "schema version 6 is not supported"),
    (lambda text: text.replace('"global_batch": 8', '"global_batch": 16'), "modified after it was written"),
], ids=["not-json", "wrong-schema", "tampered"])
def test_bad_plan_files(capsys, tmp_path, plan_file, edit, expected):
    plan_file.write_text(edit(plan_file.read_text()))
    _fails(capsys, tmp_path, ["codegen", str(plan_file)], expected)
    for command in (["show", str(plan_file)], ["diff", str(plan_file), str(plan_file)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err


def test_a_plan_for_another_model_is_refused(capsys, tmp_path, plan_file):
    from autopar.frontend import trace_model
    from autopar.plan_file import Plan, PlanError

    other = trace_model("gpt", {"layers": 3, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32})
    with pytest.raises(PlanError, match="the model does not match the plan"):
        Plan.load(plan_file).check_model(other.graph, other.config)


def test_a_solver_time_limit_still_plans_and_says_so(capsys, tmp_path, monkeypatch):
    # the ILP stops at its time limit with a feasible answer: the plan uses it, exit 0, and a note gives its gap
    real = ilp._solve_pulp

    def stopped(request, backend):
        r = real(request, backend)
        return SolverResult(status="feasible", solver=r.solver, choice=r.choice, objective_s=r.objective_s,
                            solve_time_s=r.solve_time_s, num_variables=r.num_variables,
                            num_constraints=r.num_constraints)

    monkeypatch.setattr(ilp, "_solve_pulp", stopped)
    monkeypatch.setattr(ilp, "_solve_by_elimination", lambda request: None)  # it would prove this small graph
    out = tmp_path / "out"
    assert main(["plan", "gpt", "--config", SMALL, *CPU, "--fix", "tp=2", "-o", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    solve = json.loads(captured.out)["solve"]
    assert solve["status"] == "feasible" and 0 < solve["gap"] < 1
    assert "stopped at its time limit" in captured.err and "of optimal" in captured.err
    assert (out / "plan.json").exists()


def test_the_parser_names_the_program_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "see 'autopar --help'" in err and "autopar autopar" not in err
