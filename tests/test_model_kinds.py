"""Models beyond decoder LMs as a new user brings them: an initialization that reads values (a ViT), floating
inputs (a convolutional speech front end), and the zoo's diffusion transformer (DiT), a conv net and a ViT trained
split on tensor- and pipeline-parallel ranks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from autopar import modelfile
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


def test_floating_inputs_are_traced_in_the_training_dtype():
    """The model is traced in bf16, as it trains: its float features enter the convolution in bf16 too (they
    would meet bf16 weights in fp32 and fail otherwise), as FSDP2's mixed precision casts them."""
    traced = trace_model(str(FIXTURES / "conv_features.py"), seq_len=32)
    conv = next(n for n in traced.graph.nodes if n.op.startswith("aten.conv1d"))
    source = traced.graph.nodes[[n.name for n in traced.graph.nodes].index(conv.inputs[0])]
    assert source.out.dtype == "bfloat16"
    inputs = {n.out.dtype for n in traced.graph.nodes if n.kind == "input"}
    assert inputs == {"bfloat16", "int64"}  # the labels stay integers


DIT = str(Path(__file__).parent.parent / "models" / "dit.py")
SMALL_DIT = {"layers": 2, "hidden": 256, "heads": 4, "image": 8, "classes": 10}


def test_dit_is_dit_xl_2_by_default_and_its_tokens_are_its_patches():
    """The zoo's DiT has DiT-XL/2's 675M parameters (Peebles & Xie, table 1), and its plan counts patches as
    tokens, (32 / 2)^2 = 256 per image, since no input is token ids."""
    module = modelfile.load_module(DIT)
    with torch.device("meta"):
        model = modelfile.build(module, {}, DIT)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(675e6, rel=1e-3)
    assert trace_model(DIT, SMALL_DIT).graph.seq_len == (8 // 2) ** 2
    with pytest.raises(modelfile.ModelFileError, match=r"seq_len is the tokens, \(image / patch\)\^2 = 16"):
        trace_model(DIT, SMALL_DIT, seq_len=64)


def test_dit_a_conv_net_and_a_vit_train_split_on_tensor_parallel_and_pipeline_ranks(tmp_path):
    """DiT: dp2 x tp2 splits the adaLN modulations, attention and MLP; pp2 x dp2 carries the conditioning across
    the stage boundary with the tokens.  A U-Net-style conv net (2-d convolutions, GroupNorm) under dp2 x tp2.
    A HuggingFace ViT in pipeline stages (its later stage reads the images' shape).  All train as one process
    does (one launch)."""
    from autopar.api import plan_model
    from autopar.runtime.verify import verify_many

    cases = [(DIT, SMALL_DIT, {"dp": 2, "tp": 2}), (DIT, SMALL_DIT, {"pp": 2, "dp": 2}),
             (str(FIXTURES / "conv_groupnorm.py"), {}, {"dp": 2, "tp": 2}),
             (str(FIXTURES / "hf_vit.py"), {}, {"pp": 2, "dp": 2})]  # a later stage gets the images too
    paths = []
    for ref, config, fixed in cases:
        plan = plan_model(ref, config=config, cluster="cpu", gpus=4, global_batch=8, fix=fixed).plans[0]
        paths.append(tmp_path / f"{len(paths)}.json")
        plan.save(paths[-1])
        if ref == DIT and fixed.get("tp"):
            split = {fqn for fqn, p in plan.parameters.items() if p["placements"]["tp"] != "R"}
            assert {"blocks.0.adaln.weight", "blocks.0.attn.q.weight", "blocks.0.fc1.weight"} <= split
    for result in verify_many(paths, steps=3):
        assert result.ok, result
