"""Mamba's selective scan traced as one fused op (``autopar.fused_kernels``): the same numbers as HuggingFace's
unrolled fallback, a graph that does not grow with the sequence, sharding rules that are exact, and a plan that
splits the scan's channels on tensor-parallel CPU ranks and trains as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.frontend import trace_model
from autopar.fused_kernels import SELECTIVE_SCAN
from autopar.intra_op.strategies import axis_strategies

modeling_mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")

ROOT = Path(__file__).parent.parent
MAMBA = str(ROOT / "tests" / "fixtures" / "hf_mamba.py")


def _inputs(b: int = 2, d: int = 8, s: int = 12, n: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    u, dt, z = (torch.randn(b, d, s, generator=g) for _ in range(3))
    A = -torch.rand(d, n, generator=g)
    B, C = torch.randn(b, n, s, generator=g), torch.randn(b, n, s, generator=g)
    return u, dt, A, B, C, torch.randn(d, generator=g), z, torch.randn(d, generator=g)


def test_the_fused_scan_computes_what_huggingface_unrolls_and_its_gradients():
    inputs = [t.requires_grad_() for t in _inputs()]
    u, dt, A, B, C, D, z, bias = inputs
    want = modeling_mamba.mamba_selective_scan(u, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True)
    got = torch.ops.autopar.selective_scan(u, dt, A, B, C, D, z, bias, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    grad = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(want, inputs, grad), torch.autograd.grad(got, inputs, grad)):
        torch.testing.assert_close(b, a)


def test_channel_and_batch_splits_of_the_scan_are_exact():
    u, dt, A, B, C, D, z, bias = _inputs()
    full = torch.ops.autopar.selective_scan(u, dt, A, B, C, D, z, bias, True)
    halves = [torch.ops.autopar.selective_scan(u[:, c], dt[:, c], A[c], B, C, D[c], z[:, c], bias[c], True)
              for c in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(torch.cat(halves, dim=1), full)
    rows = [torch.ops.autopar.selective_scan(u[r], dt[r], A, B[r], C[r], D, z[r], bias, True)
            for r in (slice(0, 1), slice(1, 2))]
    torch.testing.assert_close(torch.cat(rows, dim=0), full)


def test_the_trace_has_one_scan_per_layer_whatever_the_sequence():
    graphs = [trace_model(MAMBA, {"seq_len": s}).graph for s in (16, 64)]
    assert [sum(n.op == SELECTIVE_SCAN for n in g.ops()) for g in graphs] == [2, 2]
    assert len(graphs[0].nodes) == len(graphs[1].nodes)
    scan = next(n for n in graphs[0].ops() if n.op == SELECTIVE_SCAN)
    rules = {(r.outputs, r.inputs) for r in axis_strategies(graphs[0], scan, 4)}
    assert (("S(1)",), ("S(1)", "S(1)", "S(0)", "R", "R", "S(0)", "S(1)", "S(0)")) in rules  # channels
    assert (("S(0)",), ("S(0)", "S(0)", "R", "S(0)", "S(0)", "R", "S(0)", "R")) in rules  # batch
    # the fused kernel's traffic: its inputs read once and its output written, not [b, d, s, n] states
    saved = {t.key.split(":")[0] for t in scan.annotations["saved"]}
    assert len(saved) == 7  # u, dt, A, B and C (views of one x_proj output), D, z, delta_bias: each storage once


def test_a_plan_that_splits_the_scan_channels_trains_as_one_process(tmp_path):
    """tp4 on a Mamba wide enough that the ILP splits the mixer: its mixer runs as a region op by op, the scan
    and the depthwise convolution before it on a quarter of the channels per rank."""
    from autopar.api import plan_model
    from autopar.runtime.verify import verify

    config = {"arch": "mamba", "seq_len": 32, "hidden": 512}
    plan = plan_model(str(ROOT / "examples" / "hf_models.py"), config=config, cluster="cpu", gpus=4,
                      global_batch=8, fix={"tp": 4}).plans[0]
    scans = [s for s in plan.op_strategies.values() if s["op"] == SELECTIVE_SCAN]
    assert scans and all(s["tp"]["outputs"] == ["S(1)"] for s in scans)
    # the depthwise conv1d before the scan splits on the same channels (autopar.conv_channels)
    convs = [s for s in plan.op_strategies.values() if s["op"] == "aten.conv1d.default"]
    assert convs and all(s["tp"]["inputs"][:2] == ["S(1)", "S(0)"] for s in convs)
    plan.save(tmp_path / "plan.json")
    result = verify(tmp_path / "plan.json", steps=2)
    assert result.ok, result
