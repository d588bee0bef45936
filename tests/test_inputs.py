"""Model inputs by position and by keyword (``autopar.inputs.ModelInputs``), as example_inputs and batches give
them, and how pipeline stages take them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.cli import main
from autopar.errors import AutoparError, ModelFileError
from autopar.frontend import trace_model
from autopar.inputs import ModelInputs
from autopar.plan_file import Plan
from autopar.runtime.pipeline import stage_inputs

FIXTURES = Path(__file__).parent / "fixtures"
IDS, MASK = torch.arange(8).view(2, 4), torch.ones(2, 4, dtype=torch.long)


def test_every_form_example_inputs_may_return():
    assert ModelInputs.of(IDS) == ModelInputs((IDS,))
    assert ModelInputs.of([IDS, MASK]).args == (IDS, MASK)
    keyword = ModelInputs.of({"input_ids": IDS, "attention_mask": MASK})
    assert keyword.args == () and list(keyword.kwargs) == ["input_ids", "attention_mask"] and keyword.first is IDS
    pair = ModelInputs.of(((IDS,), {"attention_mask": MASK}))
    assert pair.args == (IDS,) and pair.kwargs == {"attention_mask": MASK}
    with pytest.raises(ModelFileError, match="must return a tensor, a tuple of tensors, a dict of them or an"):
        ModelInputs.of(3)
    with pytest.raises(ModelFileError, match="keys must be the forward's parameter names, not 0"):
        ModelInputs.of({0: IDS})


def test_rows_and_calls_keep_positions_and_names():
    inputs = ModelInputs((IDS,), {"mask": MASK})
    half = inputs.rows(1, 2)
    assert half.args[0].tolist() == [[4, 5, 6, 7]] and half.kwargs["mask"].shape == (1, 4)
    assert inputs.call(lambda *a, **k: (len(a), sorted(k))) == (1, ["mask"])
    assert inputs.call(lambda out, ids, mask: out, "output") == "output"  # the loss: the output first


class _TwoInputs(nn.Module):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, *rest: torch.Tensor) -> torch.Tensor:
        return ids


def test_a_pipeline_stage_takes_the_first_input_by_position_and_the_rest_by_name():
    model = _TwoInputs()
    first, named = stage_inputs(model, ModelInputs((IDS, MASK)))
    assert first is IDS and named == {"mask": MASK}
    first, named = stage_inputs(model, ModelInputs((), {"mask": MASK, "ids": IDS}))  # by name, in any order
    assert first is IDS and named == {"mask": MASK}
    with pytest.raises(AutoparError, match="forward's first parameter is 'ids', which the inputs \\(mask\\) do not"):
        stage_inputs(model, ModelInputs((), {"mask": MASK}))
    with pytest.raises(AutoparError, match="names no parameter 2 it can take by keyword"):
        stage_inputs(model, ModelInputs((IDS, MASK, MASK)))


def test_an_encoder_decoder_plans_on_keyword_inputs(tmp_path, capsys):
    """T5's second positional parameter is attention_mask: its decoder's ids come by keyword; its pipeline stages
    hand on the encoder's output and the relative position bias its first decoder layer makes."""
    ref = str(FIXTURES / "hf_t5.py")
    graph = trace_model(ref, seq_len=16).graph
    assert {n.target for n in graph.nodes if n.kind == "input"} >= {"input_ids", "decoder_input_ids"}
    argv = ["plan", ref, "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "16"]
    assert main([*argv, "--fix", "pp=2", "-q", "-o", str(tmp_path / "pp")]) == 0
    ends = Plan.load(tmp_path / "pp" / "plan.json").model["stack_ends"]
    assert ends["carried"] == ["encoder"] and ends["layer_args"] == ["2"]  # T5Block's position_bias, by position
