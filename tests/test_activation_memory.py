"""The activation memory a bf16 run really holds (torch's MemTracker / FSDPMemTracker on 4 CPU ranks) against
the plan's ``estimated_activation_bytes``, and the pieces of the bf16 path that make them agree."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from torch import nn

from autopar.cli import main
from autopar.runtime.training import bf16_parameters, fp32_loss

#: Small: a CPU without native bf16 (AVX2 only) multiplies bf16 about 50x slower than fp32. The ratios below
#: do not depend on the size (the same to 0.1 % at seq_len 32 and 64).
GPT = ["gpt", "--config", "layers=4,hidden=256,heads=4,vocab=256,seq_len=32", "--cluster", "cpu", "--gpus", "4",
       "--global-batch", "8", "--seq-len", "32"]

#: tensor, data and pipeline parallel (1F1B and GPipe), ZeRO 0-3 (with tp too: fully_shard over a dim tp
#: splits, whose gradient norm clipping once got 2.6 % wrong), every recomputation mode, micro-batch
#: accumulation.
LAYOUTS = {
    "tp4": "tp=4,sp=off,recompute=none",
    "dp2-tp2": "dp=2,tp=2,sp=off,zero=0,recompute=none",
    "dp4-zero3": "dp=4,zero=3,recompute=none",
    "pp2-dp2-1f1b": "pp=2,dp=2,mbs=2,schedule=1f1b,recompute=none",
    "dp4-zero1-selective": "dp=4,mbs=1,zero=1,recompute=selective",
    "pp2-tp2-gpipe-selective": "pp=2,tp=2,sp=off,mbs=4,schedule=gpipe,recompute=selective",
    "dp4-zero3-full": "dp=4,zero=3,recompute=full",
    "dp4-zero1-op": "dp=4,mbs=2,zero=1,recompute=op",
    "pp2-dp2-1f1b-full": "pp=2,dp=2,mbs=2,schedule=1f1b,recompute=full",
    "dp2-tp2-zero3-full": "dp=2,tp=2,sp=off,zero=3,recompute=full",
}


#: A mixture of experts in a DTensor region (its dispatch buffers, einsum's copies), whose bf16 gradients
#: exceed the tolerance where router logits tie differently than in one process (README); memory only.
MOE = ["moe", "--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4", "--cluster", "cpu",
       "--gpus", "4", "--global-batch", "8", "--fix", "dp=2,tp=2,sp=off"]


@pytest.mark.slow
def test_bf16_runs_hold_the_activations_the_plan_estimates(tmp_path):
    paths = []
    with contextlib.redirect_stdout(io.StringIO()):
        # MoE first, in fresh processes as a launch of it alone (1.14x, close to the bound, a gap this test
        # names; after the GPT plans in the same processes it measured up to 1.17x once)
        assert main(["plan", *MOE, "-o", str(tmp_path / "moe")]) == 0
        paths.append(str(tmp_path / "moe" / "plan.json"))
        for name, fix in LAYOUTS.items():
            assert main(["plan", *GPT, "--fix", fix, "-o", str(tmp_path / name)]) == 0, name
            paths.append(str(tmp_path / name / "plan.json"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", *paths, "--numerics", "bf16", "--memory", "--steps", "2", "--json"])
    reports = json.loads(out.getvalue())
    assert code in (0, 1), out.getvalue()[-2000:]
    for name, report in zip(["moe", *LAYOUTS], reports, strict=True):
        assert report["ok"] or name == "moe", (name, report)
        for stage in report["activations"]:
            ratio = stage["measured_bytes"] / stage["estimated_bytes"]
            assert 0.85 <= ratio <= 1.15, (name, stage, ratio)


def test_bf16_parameters_run_forward_and_backward_in_bf16_and_hand_back_fp32_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    masters = [p.detach().clone() for p in model.parameters()]
    loss_fn = fp32_loss(nn.functional.cross_entropy, torch.device("cpu"), "bf16")
    with bf16_parameters(list(model.parameters())):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        logits = model(x.bfloat16())  # FSDP2 casts floating inputs too; token ids need nothing
        loss = loss_fn(logits, y)
        loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32  # the loss itself runs in fp32
    for p, master in zip(model.parameters(), masters, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master)  # the fp32 weights come back whole
        assert p.grad.dtype == torch.float32
    # the same step by hand on a bf16 copy: the gradients are bf16 ones, widened
    copy = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    copy.load_state_dict(model.state_dict())
    copy.to(torch.bfloat16)
    nn.functional.cross_entropy(copy(x.bfloat16()).float(), y).backward()
    for p, q in zip(model.parameters(), copy.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad.float())


def test_fp32_training_keeps_the_loss_function_as_it_is():
    fn = nn.functional.cross_entropy
    assert fp32_loss(fn, torch.device("cpu"), "fp32") is fn
