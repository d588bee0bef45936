"""Pipeline stages in one process: chaining a plan's stages computes what the whole model computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar import modelfile
from autopar.cli import main
from autopar.plan_file import Plan
from autopar.runtime.stages import FIRST_INPUT_KWARG, prune_to_stage

SMALL = "layers=4,hidden=64,heads=4,vocab=128,seq_len=16"


def _plan(tmp_path, model: str, config: str, fix: str = "pp=2,schedule=gpipe") -> Plan:
    assert main(["plan", model, "--config", config, "--cluster", "cpu", "--global-batch", "4", "--fix", fix,
                 "-o", str(tmp_path)]) == 0
    return Plan.load(tmp_path / "plan.json")


def _whole_and_chained(plan: Plan) -> tuple[torch.Tensor, torch.Tensor, list[nn.Module]]:
    module = modelfile.load_for(plan.model)
    torch.manual_seed(0)
    model = modelfile.build(module, dict(plan.model["config"]), plan.model["ref"]).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    whole = model(ids)
    whole = whole.logits if hasattr(whole, "logits") else whole
    stages = [prune_to_stage(model, plan, c) for c in range(plan.layout["pp"] * plan.layout["v"])]
    x = ids
    for stage in stages:
        x = stage(x)
    return whole, x, stages


@pytest.mark.parametrize("model", ["hf_llama", "hf_gpt2"])  # every other architecture: tests/test_hf_decoders.py
def test_huggingface_stages_chain_to_the_whole_model(tmp_path, capsys, examples, model):
    config = SMALL + (",ffn=128,kv_heads=4" if model == "hf_llama" else "")
    plan = _plan(tmp_path, str(examples / f"{model}.py"), config)
    whole, chained, stages = _whole_and_chained(plan)
    torch.testing.assert_close(chained, whole, rtol=1e-5, atol=1e-5)
    # the first stage holds no head and the last no embedding; FQNs are those of the whole model
    first = {n for n, _ in stages[0].named_parameters()}
    last = {n for n, _ in stages[-1].named_parameters()}
    assert not first & last and (first | last) <= set(plan.parameters) | {"lm_head.weight"}


def test_zoo_stages_chain_to_the_whole_model(tmp_path, capsys):
    plan = _plan(tmp_path, "gpt", SMALL, "pp=2,schedule=interleaved,v=2")
    whole, chained, stages = _whole_and_chained(plan)
    torch.testing.assert_close(chained, whole, rtol=1e-5, atol=1e-5)
    assert [list(s.blocks.keys()) for s in stages] == [["0"], ["1"], ["2"], ["3"]]


def _chained_with_inputs(plan: Plan, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's logits and those of its stages run one after the other, each taking what the one before
    handed on (the hidden state, then what it carries) and the model's other inputs by keyword."""
    module = modelfile.load_for(plan.model)
    torch.manual_seed(0)
    model = modelfile.build(module, dict(plan.model["config"]), plan.model["ref"]).eval()
    whole = model(**inputs, use_cache=False).logits
    lead, *rest = inputs
    others = {k: inputs[k] for k in rest}
    handed: tuple[torch.Tensor, ...] = (inputs[lead],)
    for c in range(plan.layout["pp"] * plan.layout["v"]):
        stage = prune_to_stage(model, plan, c)
        # a model that reads features first (Whisper) gets them on every stage, as the runtime hands them
        first = {FIRST_INPUT_KWARG: inputs[lead]} if c and getattr(stage, "wants_first_input", False) else {}
        out = stage(*handed, **others, **first)
        handed = out if isinstance(out, tuple) else (out,)
    return whole, handed[0]


@pytest.mark.parametrize(("arch", "fix"), [("t5", "pp=4,schedule=gpipe"), ("bart", "pp=4,schedule=1f1b"),
                                           ("whisper", "pp=2,schedule=interleaved,v=2")])
def test_encoder_decoder_stages_split_both_stacks(tmp_path, capsys, examples, arch, fix):
    """An encoder-decoder's stages run the encoder's blocks, then the decoder's: a stage ending inside the encoder
    hands on its hidden state (and T5's position bias), the one ending the encoder the decoder's embedded input
    and the encoder's output, and the later ones that output beside the decoder's hidden state."""
    plan = _plan(tmp_path, str(examples / "hf_models.py"), f"arch={arch},layers=3,seq_len=16", fix)
    stacks = plan.model["stack_ends"]["stacks"]
    assert [s["layers"] for s in stacks] == [3, 3] and plan.model["num_layers"] == 6
    ranges = [tuple(r) for r in plan.schedule["chunks"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == 6 and any(lo < 3 for lo, _ in ranges[1:])  # the encoder is split
    generator = torch.Generator().manual_seed(1)
    decoder = torch.randint(2, 128, (2, 16), generator=generator)
    if arch == "whisper":
        inputs = {"input_features": torch.randn(2, 16, 32, generator=generator), "decoder_input_ids": decoder}
    else:
        inputs = {"input_ids": torch.randint(2, 128, (2, 16), generator=generator), "decoder_input_ids": decoder}
    whole, chained = _chained_with_inputs(plan, inputs)
    torch.testing.assert_close(chained, whole, rtol=1e-5, atol=1e-5)
