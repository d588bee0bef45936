"""The Python API: ``autopar.plan`` on zoo names, model files, factories and built modules, as the CLI plans."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import imported

import autopar
from autopar.cli import main
from autopar.errors import AutoparError
from autopar.modelfile import load_for
from autopar.plan_file import Plan
from autopar.runtime.support import model_on_meta

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}
ON_CPU = {"cluster": "cpu", "gpus": 4, "global_batch": 8}

FACTORY_FILE = textwrap.dedent('''
    from torch import nn

    from autopar.models.gpt import build_model


    class Tiny(nn.Module):
        """A GPT of the zoo behind a class of the user's own."""

        def __init__(self, layers=2, hidden=64, heads=4, vocab=256, seq_len=32):
            super().__init__()
            self.inner = build_model(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len)

        def forward(self, tokens):
            return self.inner(tokens)


    def make_tiny(**config):
        return Tiny(**config)


    def example_inputs(batch_size, seq_len, **config):
        import torch
        return (torch.randint(0, config.get("vocab", 256), (batch_size, seq_len)),)
''')


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "tiny_model.py"
    path.write_text(FACTORY_FILE)
    with imported(path) as module:  # a module-level class of a user's file, imported as a user would
        yield module


def test_plan_writes_the_bytes_the_cli_writes(tmp_path):
    config = ",".join(f"{k}={v}" for k, v in SMALL.items())
    assert main(["plan", "gpt", "--config", config, "--cluster", "cpu", "--gpus", "4", "--global-batch", "8",
                 "-o", str(tmp_path / "cli"), "--json"]) == 0
    plan = autopar.plan("gpt", config=SMALL, **ON_CPU)
    assert isinstance(plan, Plan)
    plan.save(tmp_path / "api.json")
    assert (tmp_path / "api.json").read_bytes() == (tmp_path / "cli" / "plan.json").read_bytes()


def test_public_names_are_exported():
    for name in ("Plan", "plan", "load_cluster", "apply", "trace"):
        assert name in autopar.__all__ and hasattr(autopar, name)


def test_a_factory_is_named_by_file_and_rebuilt_by_the_runtime(user_module):
    plan = autopar.plan(user_module.Tiny, config=SMALL, **ON_CPU)
    ref = plan.model["ref"]
    assert ref.endswith("tiny_model.py:Tiny") and plan.model["path"] == ref
    rebuilt = model_on_meta(plan)  # what every rank does: import FILE, call Tiny(**config) on meta
    assert type(rebuilt).__name__ == "Tiny"
    assert sum(p.numel() for p in rebuilt.parameters()) == sum(_numel(s["shape"]) for s in plan.parameters.values())
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    # a function factory plans the same model
    by_function = autopar.plan(user_module.make_tiny, config=SMALL, **ON_CPU)
    assert by_function.model["fingerprint"] == plan.model["fingerprint"]


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_a_built_module_is_traced_as_it_is_and_left_untouched(user_module):
    built = user_module.Tiny(**SMALL)
    before = {k: v.clone() for k, v in built.state_dict().items()}
    plan = autopar.plan(built, config=SMALL, **ON_CPU)
    assert plan.model["fingerprint"] == autopar.plan(user_module.Tiny, config=SMALL, **ON_CPU).model["fingerprint"]
    after = built.state_dict()
    assert all(not hasattr(t, "fake_mode") for t in after.values())
    assert all(before[k].equal(after[k]) for k in before)


def test_example_inputs_are_recorded_for_the_runtime(user_module):
    plan = autopar.plan(user_module.Tiny, config=SMALL, example_inputs=user_module.example_inputs, **ON_CPU)
    assert plan.model["example_inputs"].endswith("tiny_model.py:example_inputs")
    module = load_for(plan.model)
    assert module.example_inputs(2, 8, vocab=256)[0].shape == (2, 8)


def test_top_returns_distinct_plans_best_first():
    plans = autopar.plan("gpt", config=SMALL, top=3, **ON_CPU)
    assert isinstance(plans, list) and 1 < len(plans) <= 3
    times = [p.estimate["iteration_time_s"] for p in plans]
    assert times == sorted(times)
    assert len({json.dumps(p.layout, sort_keys=True) for p in plans}) == len(plans)


def test_fix_as_a_dict_or_a_string():
    as_dict = autopar.plan("gpt", config=SMALL, fix={"tp": 2, "pp": 1}, **ON_CPU)
    as_text = autopar.plan("gpt", config=SMALL, fix="tp=2,pp=1", **ON_CPU)
    assert as_dict.layout["tp"] == 2 and as_dict.to_json() == as_text.to_json()


def test_bad_models_get_one_line_errors():
    with pytest.raises(AutoparError, match="top level of a Python file"):
        autopar.plan(lambda **c: None, **ON_CPU)
    with pytest.raises(AutoparError, match="not int"):
        autopar.plan(3, **ON_CPU)
    with pytest.raises(AutoparError, match="fix must be"):
        autopar.plan("gpt", config=SMALL, fix=[("tp", 2)], **ON_CPU)


def test_seq_len_given_to_both_build_model_and_example_inputs(tmp_path):
    # the README's convention: both take seq_len; --seq-len reaches build_model through the config and
    # example_inputs by position, once
    path = tmp_path / "both.py"
    path.write_text(textwrap.dedent('''
        import torch
        from autopar.models.gpt import build_model as _gpt

        def build_model(seq_len=16, **config):
            return _gpt(layers=2, hidden=64, heads=4, vocab=256, seq_len=seq_len)

        def example_inputs(batch_size, seq_len, **config):
            return (torch.randint(0, 256, (batch_size, seq_len)),)
    '''))
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", str(path), "--seq-len", "32", "--cluster",
                          "cpu", "--gpus", "2", "--global-batch", "4", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["seq_len"] == 32
