"""Models beyond decoder LMs as a new user brings them: an initialization that reads values (a ViT), floating
inputs (a convolutional speech front end), and layouts the runtime cannot split refused in one line."""

from __future__ import annotations

import logging
from pathlib import Path

from autopar import modelfile
from autopar.cli import main
from autopar.frontend import trace_model

FIXTURES = Path(__file__).parent / "fixtures"


def test_a_model_whose_initialization_reads_values_is_built_on_the_meta_device(caplog):
    ref = str(FIXTURES / "hf_vit.py")
    with caplog.at_level(logging.WARNING, logger="autopar.frontend"):
        traced = trace_model(ref)
    assert "reads values as it initializes" in caplog.text and "built on the meta device" in caplog.text
    real = modelfile.build(modelfile.load_module(ref), {}, ref)
    assert sum(p.numel for p in traced.graph.params.values()) == sum(p.numel() for p in real.parameters())
    shapes = {name: tuple(p.shape) for name, p in real.named_parameters()}
    assert {name: p.shape for name, p in traced.graph.params.items()} == {k: shapes[k] for k in traced.graph.params}


def test_pipeline_stages_of_a_model_taking_images_first_are_refused_in_one_line(tmp_path, capsys):
    argv = ["plan", str(FIXTURES / "hf_vit.py"), "--cluster", "cpu", "--gpus", "4", "--global-batch", "8"]
    assert main([*argv, "--fix", "pp=2,dp=2", "-o", str(tmp_path / "pp")]) == 2
    err = capsys.readouterr().err
    assert "ViTForImageClassification.forward takes pixel_values first: plan with --fix pp=1" in err
    assert not (tmp_path / "pp" / "plan.json").exists()
    assert main([*argv, "-q", "-o", str(tmp_path / "free")]) == 0  # the search keeps to what can run
    assert '"pp": 1' in (tmp_path / "free" / "plan.json").read_text()


def test_floating_inputs_are_traced_in_the_training_dtype():
    """The model is traced in bf16, as it trains: its float features enter the convolution in bf16 too (they
    would meet bf16 weights in fp32 and fail otherwise), as FSDP2's mixed precision casts them."""
    traced = trace_model(str(FIXTURES / "conv_features.py"), seq_len=32)
    conv = next(n for n in traced.graph.nodes if n.op.startswith("aten.conv1d"))
    source = traced.graph.nodes[[n.name for n in traced.graph.nodes].index(conv.inputs[0])]
    assert source.out.dtype == "bfloat16"
    inputs = {n.out.dtype for n in traced.graph.nodes if n.kind == "input"}
    assert inputs == {"bfloat16", "int64"}  # the labels stay integers
