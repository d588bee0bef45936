"""Cost passes against closed forms: GPT-3 parameter and FLOP counts, Korthikanti activation memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from autopar.passes import PassContext
from autopar.passes.flops import causal_block_fraction, total_flops
from autopar.passes.traffic import tensor_bytes

from autopar.cluster import MeshSpec, load_cluster
from autopar.framework import load_framework
from autopar.frontend import trace_model
from autopar.inter_op.unit_costs import solve_tp, unit_costs, unit_sequence
from autopar.intra_op.sharding_costs import saved_bytes
from autopar.intra_op.strategies import AxisStrategy

GPT3 = {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq_len": 2048}


@pytest.fixture(scope="module")
def gpt3():
    return trace_model("gpt", GPT3).graph


def test_gpt3_175b_parameter_count(gpt3):
    n_layers, h, V, s = GPT3["layers"], GPT3["hidden"], GPT3["vocab"], GPT3["seq_len"]
    expected = 12 * n_layers * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * n_layers * h))
    assert abs(gpt3.num_parameters / expected - 1) < 0.005


@pytest.mark.parametrize("batch", [1, 1536])
def test_gpt3_175b_flops_per_iteration(gpt3, batch):
    n_layers, h, V, s = GPT3["layers"], GPT3["hidden"], GPT3["vocab"], GPT3["seq_len"]
    expected = 72 * batch * s * n_layers * h**2 * (1 + s / (6 * h) + V / (12 * n_layers * h))
    assert abs(total_flops(gpt3, batch, "model") / expected - 1) < 0.02


def test_flash_backward_recomputes_scores_and_skips_masked_blocks(gpt3):
    sdpa = next(n for n in gpt3.ops() if n.op == "aten.scaled_dot_product_attention.default")
    f = sdpa.annotations["flops"]
    assert f.bwd_model == pytest.approx(2 * f.fwd)  # the model-FLOPs convention counts every score
    # causal: of 16 x 16 blocks of 128 the kernel runs the 136 on or below the diagonal
    assert causal_block_fraction(2048, 2048, 128) == pytest.approx(136 / 256)
    assert f.fwd_hw == pytest.approx(f.fwd * 136 / 256)
    assert f.bwd == pytest.approx(2.5 * f.fwd * 136 / 256)  # flash: QK^T recomputed in backward


def test_causal_block_fraction():
    assert causal_block_fraction(128, 128, 128) == 1.0  # one block: nothing to skip
    assert causal_block_fraction(64 * 1024, 64 * 1024, 128) == pytest.approx(0.5, abs=2e-3)
    assert causal_block_fraction(1000, 1000, 128) == pytest.approx(36 / 64)  # 8 partial blocks


def test_unfused_attention_computes_every_score():
    cfg = {"layers": 1, "hidden": 256, "heads": 8, "vocab": 64, "seq_len": 1024}
    g = trace_model("gpt", cfg, ctx=PassContext(attention="math")).graph
    sdpa = next(n for n in g.ops() if n.op == "aten.scaled_dot_product_attention.default")
    f = sdpa.annotations["flops"]
    assert f.fwd_executed == f.fwd and f.bwd == f.bwd_model


def _layer_bytes(attention: str, seq: int, heads: int = 16, hidden: int = 1024, dropout: float = 0.1) -> float:
    cfg = {"layers": 2, "hidden": hidden, "heads": heads, "vocab": 512, "seq_len": seq, "dropout": dropout}
    g = trace_model("gpt", cfg, ctx=PassContext(attention=attention)).graph
    return g.annotations["activations"].per_layer[0]


@pytest.mark.parametrize("batch", [1, 4])
def test_math_attention_activation_memory_matches_korthikanti(batch):
    s, h, a = 1024, 1024, 16
    per_layer = _layer_bytes("math", s, a, h).at(batch)
    expected = s * batch * h * (34 + 5 * a * s / h)
    assert abs(per_layer / expected - 1) < 0.05


def test_flash_attention_has_no_quadratic_term():
    b1, b2 = _layer_bytes("flash", 512).at(1), _layer_bytes("flash", 1024).at(1)
    assert b2 == pytest.approx(2 * b1, rel=1e-9)  # linear in s: no s^2 tensor saved
    m1, m2 = _layer_bytes("math", 512).at(1), _layer_bytes("math", 1024).at(1)
    assert m2 > 2.5 * m1


def test_math_attention_traffic_has_quadratic_term():
    def attn_bytes(attention: str) -> float:
        cfg = {"layers": 1, "hidden": 256, "heads": 8, "vocab": 64, "seq_len": 1024}
        g = trace_model("gpt", cfg, ctx=PassContext(attention=attention)).graph
        sdpa = next(n for n in g.ops() if n.op == "aten.scaled_dot_product_attention.default")
        return sdpa.annotations["traffic"].fwd_bytes.at(1)

    # 8 heads x 1024^2 scores x 4 passes x 2 bytes on top of q, k, v, o
    assert attn_bytes("math") - attn_bytes("flash") == pytest.approx(8 * 1024 * 1024 * 4 * 2)


def test_state_memory_byte_counts():
    g = trace_model("gpt", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}).graph
    state = g.annotations["state_memory"]
    n = g.num_parameters
    # the torch profile stores state as FSDP2 does: fp32 parameters (the master weights), fp32 gradients,
    # and two fp32 Adam moments
    assert state.total.weights == 4 * n and state.total.grads == 4 * n and state.total.optimizer == 8 * n
    assert sum(state.per_layer_parameters.values()) + state.outside_layer_parameters == n


def test_tensor_bytes_use_activation_width():
    from autopar.ir import TensorInfo

    ctx = PassContext()
    t = TensorInfo((1, 8, 4), "float32", batch_dim=0)
    assert tensor_bytes(t, ctx).at(3) == 3 * 32 * 2
    ids = TensorInfo((1, 8), "int64", batch_dim=0)
    assert tensor_bytes(ids, ctx).at(2) == 2 * 8 * 8


def test_models_trace_in_bf16_and_their_fp32_upcasts_cost_four_bytes():
    cfg = {"layers": 2, "hidden": 128, "heads": 4, "ffn": 256, "vocab": 128, "seq_len": 2048}
    plain = trace_model("llama", cfg).graph
    upcast = trace_model("llama", {**cfg, "rms_norm": "fp32", "rope": "fp32"}).graph
    assert plain.compute_itemsize == 2 and {p.dtype for p in plain.params.values()} == {"bfloat16"}
    fp32_ops = [n for n in upcast.ops() if n.out is not None and n.out.dtype == "float32" and n.alias_of is None]
    assert fp32_ops and all(upcast.width(n.out, 2) == 4 for n in fp32_ops)
    assert not any(n.out is not None and n.out.dtype == "float32" for n in plain.ops())

    def layer_bytes(g):
        return sum(n.annotations["traffic"].fwd_bytes.at(1) for n in g.ops() if n.layer == 1)

    assert layer_bytes(upcast) > 1.2 * layer_bytes(plain)


def test_a_conversion_to_the_same_dtype_is_free():
    g = trace_model("llama", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32}).graph
    same = [n for n in g.ops() if n.op == "aten.type_as.default"]
    assert same and all(n.alias_of is not None and n.annotations["traffic"].fwd_kernels == 0 for n in same)


def test_saved_input_counts_as_the_op_consumes_it():
    """A column-parallel Linear fed a sequence-sharded stream runs on (and autograd saves) the all-gathered
    input; Megatron-LM's Linear saves the sharded one and gathers it again in backward."""
    cfg = {"layers": 2, "hidden": 256, "heads": 4, "vocab": 128, "seq_len": 64}
    g = trace_model("gpt", cfg).graph
    mesh = MeshSpec.on_cluster(load_cluster("a100-80gb"), ("tp",), (8,))
    linear = next(n for n in g.ops() if n.op == "aten.linear.default" and n.layer == 1)
    saved = list(linear.annotations["saved"])
    (x,) = saved  # the input X, for dW = dY^T X
    whole = x.nbytes.at(2)
    colwise = (AxisStrategy(outputs=("S(2)",), inputs=("R", "S(0)", "S(0)")),)
    seq_sharded = {x.key: ("S(1)",)}
    assert saved_bytes(g, linear, colwise, mesh, 2, saved) == [whole]
    assert saved_bytes(g, linear, colwise, mesh, 2, saved, produced=seq_sharded) == [whole / 8]
    assert load_framework("megatron-lm").sp_saves_sharded_input
    assert not load_framework("torchtitan").sp_saves_sharded_input

    # an input consumed sharded counts sharded (GELU on the column-parallel Linear's output)
    gelu = next(n for n in g.ops() if n.op == "aten.gelu.default" and n.layer == 1)
    (y,) = gelu.annotations["saved"]
    assert saved_bytes(g, gelu, (AxisStrategy(outputs=("S(2)",), inputs=("S(2)",)),), mesh, 2, [y]) == [
        y.nbytes.at(2) / 8]


def test_megatron_keeps_sequence_parallel_linear_inputs_sharded():
    """A sequence-parallel layer whose MLP is column-parallel on the sequence-sharded stream: DTensor's layer
    keeps the all-gathered input of the first Linear, Megatron-LM's the sharded one (7/8 less at tp=8)."""
    cluster = load_cluster("a100-80gb")
    torch_ctx = PassContext(cluster=cluster, framework=load_framework("torch"))
    megatron_ctx = dataclasses.replace(torch_ctx, framework=load_framework("megatron-lm"))
    cfg = {"layers": 3, "hidden": 512, "heads": 8, "vocab": 512, "seq_len": 256}
    g = trace_model("gpt", cfg, ctx=torch_ctx).graph
    mesh, strategies, _ = solve_tp(g, cluster, torch_ctx, 8, 1, True)
    fc1 = [n for n in g.ops() if n.layer == 1 and n.op == "aten.linear.default"][4]  # q, k, v, out, fc1
    norm = g[fc1.args[0].name]
    assert norm.op == "aten.layer_norm.default"
    placed = {**strategies,
              norm.name: (AxisStrategy(outputs=("S(1)",), inputs=strategies[norm.name][0].inputs),),
              fc1.name: (AxisStrategy(outputs=("S(2)",), inputs=("R", "S(0)", "S(0)")),)}
    layer = unit_sequence(g)[2]
    dtensor = unit_costs(g, placed, mesh, 1, cluster, torch_ctx)[layer].activation_bytes
    megatron = unit_costs(g, placed, mesh, 1, cluster, megatron_ctx)[layer].activation_bytes
    whole = g.tensor(fc1.args[0]).numel_at(1) * 2
    assert dtensor - megatron == pytest.approx(whole * 7 / 8)


def test_where_saves_its_condition_alone():
    """torch's backward of ``where`` reads the condition only: a floating operand (T5's position bias, masked on its
    way into every layer's scores) is not saved for it."""
    import torch
    from autopar.passes import run_pipeline
    from torch import nn

    from autopar.tracing import trace

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            return torch.where(y > 0, y, 0.0) + torch.where(x > 0, 1.0, y)

    g = run_pipeline(trace(Masked(), [torch.randn(2, 8)], lambda out, x: out.sum()), PassContext())
    wheres = [n for n in g.ops() if n.op.startswith("aten.where.")]
    assert {n.op for n in wheres} == {"aten.where.ScalarOther", "aten.where.ScalarSelf"}
    for n in wheres:
        assert [g[t.key.split(":")[0]].op for t in n.annotations["saved"]] == ["aten.gt.Scalar"], n.op


def test_a_transposed_weight_is_no_activation():
    """Falcon multiplies by ``weight.T`` (a view of the parameter, ``aten.numpy_T``) and adds its attention output to
    its MLP's in place: neither the weight nor the in-place sum's operands are activations (its layers once counted
    every weight as saved, once per micro-batch in flight)."""
    graph = trace_model(str(Path(__file__).resolve().parents[1] / "examples" / "hf_decoder.py"),
                        {"arch": "falcon", "layers": 2, "hidden": 64, "heads": 4, "vocab": 128}, seq_len=16).graph
    ops = {n.op for n in graph.ops()}
    assert {"aten.numpy_T.default", "aten.add_.Tensor"} <= ops
    assert graph.annotations["activations"].unknown_ops == ()
    saved_roots = {graph[t.key.split(":")[0]].op for n in graph.ops() for t in n.annotations["saved"]}
    assert "aten.numpy_T.default" not in saved_roots
    # what a layer saves whatever the batch (its rotary tables) is smaller than its smallest weight (64 x 64 in bf16)
    assert graph.annotations["activations"].per_layer[1].fixed < 64 * 64 * 2
