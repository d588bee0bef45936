"""Losses that compare the samples of a batch (CLIP's contrastive loss): ``autopar.gather_batch`` gathers the
data-parallel ranks' rows, the planner keeps such a model to one micro-batch per step, scalar parameters stay out of
FSDP2 with their gradients averaged by the trainer, and a second tower refuses pipeline stages in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import autopar
from autopar import modelfile
from autopar.api import plan_model
from autopar.batch_loss import gathering_over
from autopar.cli import main
from autopar.errors import AutoparError
from autopar.frontend import trace_model
from autopar.runtime.materialize import build_on_meta, initial_value
from autopar.runtime.support import other_stacks
from autopar.runtime.verify import _rel

ROOT = Path(__file__).parent.parent
TOWERS = str(ROOT / "tests" / "fixtures" / "two_towers.py")


def test_gather_batch_is_the_identity_in_one_process_and_refuses_micro_batches():
    t = torch.randn(4, 3)
    assert autopar.gather_batch(t) is t
    with gathering_over(None) as calls:
        assert autopar.gather_batch(t) is t
    assert calls == [1]
    with gathering_over(None, num_microbatches=2), pytest.raises(AutoparError, match="one micro-batch per step"):
        autopar.gather_batch(t)


def test_a_loss_that_gathers_the_batch_plans_one_micro_batch(tmp_path, capsys):
    assert trace_model(TOWERS).graph.loss_gathers_batch
    assert not trace_model("gpt", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}
                           ).graph.loss_gathers_batch
    # 32 samples per rank: twice the largest micro-batch the search offers other models
    plan = plan_model(TOWERS, cluster="cpu", gpus=2, global_batch=64, fix={"dp": 2}).plans[0]
    assert (plan.layout["mbs"], plan.layout["num_microbatches"]) == (32, 1)
    argv = ["plan", TOWERS, "--cluster", "cpu", "--gpus", "4", "--global-batch", "16", "-o", str(tmp_path)]
    assert main([*argv, "--fix", "dp=2,mbs=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "mbs must be global batch / dp = 8, not 4" in err
    assert main([*argv, "--fix", "pp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "TwoTowers has another beside text_blocks (image_blocks" in err and err.endswith("--fix pp=1")
    assert not (tmp_path / "plan.json").exists()


def test_a_second_tower_is_another_stack():
    hf_models = _hf_models()
    with torch.device("meta"):
        clip = hf_models.build_model("clip")
        bert = hf_models.build_model("bert")
    assert other_stacks(clip, "text_model.encoder.layers") == ["vision_model.encoder.layers"]
    assert other_stacks(bert, "bert.encoder.layer") == []


def _hf_models():
    return modelfile.load_module(str(ROOT / "examples" / "hf_models.py"))


def test_parameters_initialized_only_by_their_constructor_keep_its_value():
    """CLIP sets ``logit_scale`` in ``__init__`` and its ``_init_weights`` leaves it alone; a module with no
    ``reset_parameters`` has the constructor's value as its only recipe.  Either was what ``to_empty`` left."""
    towers = build_on_meta(lambda: modelfile.build(modelfile.load_module(TOWERS), {}, TOWERS))
    for seed in (0, 1):
        assert float(initial_value(towers, "logit_scale", seed)) == pytest.approx(math.log(1 / 0.07))
        assert float(initial_value(towers, "image_gain", seed)) == 0.5
    clip = build_on_meta(lambda: _hf_models().build_model("clip"))
    assert float(initial_value(clip, "logit_scale", 0)) == pytest.approx(math.log(1 / 0.07), rel=1e-4)


def test_the_rounding_floor_widens_only_where_the_reference_itself_rounds():
    """A tensor is judged against its own magnitude, or, when fp32 took the reference far from float64, against
    the magnitude at which the tolerance allows ``ROUNDING_MULTIPLE`` (8) times that distance."""
    exact = torch.tensor([1e-3], dtype=torch.float64)
    want = exact + 2e-7  # the reference's own rounding error: 2e-4 of the tensor
    within = want + 3e-7  # a layout's rounding: 1.5x the reference's
    beyond = want + 1e-5  # a real difference: 50x
    assert _rel(within, want) > 1e-4 and _rel(within, want, exact=exact, tolerance=1e-4) <= 1e-4
    assert _rel(beyond, want, exact=exact, tolerance=1e-4) > 1e-4
    assert _rel(within, want, exact=want, tolerance=1e-4) == _rel(within, want)  # an exact reference: no widening


def test_two_towers_verify_on_data_parallel_and_tensor_parallel_ranks(tmp_path):
    """dp2 x tp2 at ZeRO-3: the loss gathers both ranks' embeddings, FSDP2 leaves the two scalars whole and the
    trainer averages their gradients; three steps agree with one process."""
    from autopar.runtime.verify import verify

    plan = plan_model(TOWERS, cluster="cpu", gpus=4, global_batch=16, fix={"dp": 2, "tp": 2, "zero": 3}).plans[0]
    path = tmp_path / "plan.json"
    plan.save(path)
    result = verify(path, steps=3)
    assert result.ok, result
    assert result.sharded_parameters
