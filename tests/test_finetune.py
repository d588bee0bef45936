"""Fine-tuning: frozen parameters (``requires_grad=False``) get no gradients and no optimizer state in the estimate
and the runtime; a PEFT LoRA model plans, verifies on dp2 x tp2 and pp2 x dp2 with a padding mask, and refuses
context parallelism in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from autopar.passes import PassContext
from torch import nn

from autopar.api import plan_model
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.frontend import trace_model
from autopar.plan_file import Plan

pytest.importorskip("peft")

LORA = str(Path(__file__).parent.parent / "examples" / "lora_llama.py")
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256, "seq_len": 32, "rank": 8}


def _counts(model: nn.Module) -> tuple[int, int]:
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    trained = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trained, sum(p.numel() for p in seen.values()) - trained


def test_the_trace_keeps_which_parameters_train():
    traced = trace_model(LORA, TINY)
    graph = traced.graph
    trained, frozen = _counts(traced.model)
    assert frozen > 10 * trained > 0
    assert graph.num_trainable_parameters == trained
    assert graph.num_parameters == trained + frozen
    lora = [p for fqn, p in graph.params.items() if ".lora_" in fqn]
    assert lora and all(p.trainable for p in lora)
    assert not any(p.trainable for fqn, p in graph.params.items() if ".lora_" not in fqn)
    # the model's state: fp32 parameters, gradients and Adam moments for what trains (torch's FSDP2 layout), the
    # frozen base in 16 bits alone
    state = graph.annotations["state_memory"].total
    assert state.weights == trained * 4 + frozen * 2
    assert state.grads == trained * 4
    assert state.optimizer == trained * 8
    # a frozen block is another layer type than a trainable one, and the fingerprint tells the two apart
    full = trace_model(LORA, {**TINY, "full": True}).graph
    assert full.num_trainable_parameters == full.num_parameters


def test_a_frozen_base_is_priced_without_gradients_or_optimizer_state():
    """At one layout, the plan's state per device is exactly the 16-bit frozen weights plus the trainable ones' fp32
    weights, gradients and moments (dp2, no ZeRO: everything replicated on the stage's ranks), and the estimate
    reduces only the trainable gradients: far less dp traffic than the same model trained in full."""
    fixed = {"dp": 2, "tp": 1, "pp": 1, "zero": 0, "mbs": 4}
    lora = plan_model(LORA, config=TINY, cluster="cpu", gpus=2, global_batch=8, fix=fixed).plans[0]
    stage = lora.stages[0]
    frozen = sum(math.prod(p["shape"]) for p in lora.parameters.values() if p.get("frozen"))
    trained = sum(math.prod(p["shape"]) for p in lora.parameters.values() if not p.get("frozen"))
    assert frozen and trained
    assert stage["estimated_state_parts_bytes"] == {"weights": trained * 4 + frozen * 2, "grads": trained * 4,
                                                    "optimizer": trained * 8}
    assert stage["estimated_state_bytes"] == pytest.approx(trained * 16 + frozen * 2)
    # wide enough that the gradients' bytes, not the collectives' latency, set the reduction's time
    wide = {**TINY, "hidden": 512, "heads": 8, "ffn": 1024, "vocab": 1024}
    lora, full = (plan_model(LORA, config={**wide, "full": full}, cluster="cpu", gpus=2, global_batch=8,
                             fix=fixed).plans[0] for full in (False, True))
    assert all(not p.get("frozen") for p in full.parameters.values())
    assert full.estimate["breakdown"]["dp_comm_exposed_s"] > 10 * lora.estimate["breakdown"]["dp_comm_exposed_s"]


def test_state_parts_add_up_to_the_state():
    """``PassContext.state_parts`` splits ``state_bytes`` in every state layout and ZeRO level."""
    from autopar.framework import load_framework

    for framework in ("torch", "megatron-core", "deepspeed"):
        ctx = PassContext(cluster=load_cluster("a100-80gb"), framework=load_framework(framework))
        for zero in range(4):
            for frozen in (0.0, 300.0, 1000.0):
                parts = ctx.state_parts(1000.0, 8, zero, frozen)
                assert sum(parts) == pytest.approx(ctx.state_bytes(1000.0, 8, zero, frozen))
                if frozen == 1000.0:  # nothing trains: no gradients, no optimizer state
                    assert parts[1] == parts[2] == 0.0
                else:
                    assert parts[2] > 0


def test_freeze_keeps_frozen_parameters_frozen_tied_and_in_bf16():
    from autopar.runtime.parallelize import freeze, frozen_parameters

    model = nn.ModuleDict({"emb": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False), "out": nn.Linear(4, 4)})
    model["head"].weight = model["emb"].weight  # tied
    model["emb"].weight.requires_grad_(False)
    model["out"].bias.requires_grad_(False)
    frozen = frozen_parameters(model)
    assert frozen == {"emb.weight", "head.weight", "out.bias"}
    for p in model.parameters():  # what parallelize_module does to the parameters it shards
        p.requires_grad_(True)
    freeze(model, frozen, torch.bfloat16)
    assert model["emb"].weight is model["head"].weight
    assert model["emb"].weight.dtype == torch.bfloat16 and not model["emb"].weight.requires_grad
    assert model["out"].bias.dtype == torch.bfloat16 and not model["out"].bias.requires_grad
    assert model["out"].weight.dtype == torch.float32 and model["out"].weight.requires_grad


def test_no_trainable_parameter_is_a_one_line_error(tmp_path):
    model_file = tmp_path / "frozen.py"
    model_file.write_text("from torch import nn\n\n\ndef build_model():\n"
                          "    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)).requires_grad_(False)\n")
    with pytest.raises(AutoparError, match="no parameter trains"):
        plan_model(str(model_file), cluster="cpu", gpus=2, seq_len=8)


def test_lora_verifies_on_tensor_and_pipeline_parallel_ranks_and_refuses_context_parallelism(tmp_path):
    """dp2 x tp2 and pp2 x dp2 (a zero-bubble schedule: a stage after the frozen embedding still finds its
    adapters' gradients) train the padded LoRA model as one process does, the frozen base unchanged; cp refuses."""
    from autopar.runtime.verify import verify_many

    paths = []
    for fixed in ({"dp": 2, "tp": 2}, {"dp": 2, "pp": 2, "schedule": "interleaved_zb"}):
        plan = plan_model(LORA, config=TINY, cluster="cpu", gpus=4, global_batch=32, fix=fixed).plans[0]
        path = tmp_path / f"{len(paths)}.json"
        plan.save(path)
        paths.append(path)
    # tp splits frozen weights (parallelize_module makes the parameters it shards trainable again)
    tp_plan = Plan.load(paths[0])
    assert any(p.get("frozen") and p["placements"]["tp"] != "R" and "mlp" in fqn
               for fqn, p in tp_plan.parameters.items())
    results = verify_many(paths, steps=2)
    for r in results:
        assert r.ok, r
    with pytest.raises(AutoparError, match="attention_mask") as err:
        plan_model(LORA, config=TINY, cluster="cpu", gpus=4, global_batch=8, fix={"cp": 2, "dp": 2})
    assert "\n" not in str(err.value) and "--fix cp=1" in str(err.value)
    saved = json.loads(paths[0].read_text())
    assert any(p.get("frozen") for p in saved["parameters"].values())
    assert Plan.load(paths[0]).parameters == saved["parameters"]
