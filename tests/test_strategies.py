"""Sharding strategies: DTensor's rules through our mapping, and the hand-written rules checked numerically."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from autopar.frontend import trace_model
from autopar.intra_op.strategies import R, axis_strategies, mesh_strategies

SMALL = {"layers": 1, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}


def _node(graph, op):
    return next(n for n in graph.ops() if n.op == op)


def test_rules_have_replicate_first_and_no_duplicates():
    g = trace_model("gpt", SMALL).graph
    for n in g.ops():
        rules = axis_strategies(g, n, 4)
        assert rules[0].outputs == (R,) * len(n.outputs)
        assert len(set(rules)) == len(rules)


def test_linear_rules_come_from_einsum():
    g = trace_model("gpt", SMALL).graph
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.linear.default"), 4)}
    assert (("S(2)",), ("R", "S(0)", "S(0)")) in rules  # column-parallel, bias sharded with the output
    assert (("P",), ("S(2)", "S(1)", "P")) in rules  # row-parallel, partial output
    assert (("S(0)",), ("S(0)", "R", "R")) in rules  # batch


def test_uneven_shardings_are_excluded():
    g = trace_model("gpt", {**SMALL, "heads": 6, "hidden": 96}).graph
    sdpa = _node(g, "aten.scaled_dot_product_attention.default")
    four = {s[0].outputs for s in mesh_strategies(g, sdpa, 4, (4,))}
    assert ("S(1)",) not in four  # 6 heads do not split 4 ways
    assert ("S(1)",) in {s[0].outputs for s in mesh_strategies(g, sdpa, 4, (2,))}


def test_attention_batch_rule_is_exact():
    q, k, v = (torch.randn(4, 2, 8, 16) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    shards = [F.scaled_dot_product_attention(q[i:i + 2], k[i:i + 2], v[i:i + 2], is_causal=True) for i in (0, 2)]
    torch.testing.assert_close(torch.cat(shards), full)
    g = trace_model("gpt", SMALL).graph
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.scaled_dot_product_attention.default"),
                                                               4)}
    assert (("S(0)",), ("S(0)",) * 3) in rules and (("S(1)",), ("S(1)",) * 3) in rules


def test_cross_entropy_rules_are_exact():
    logits, target = torch.randn(8, 10), torch.randint(0, 10, (8,))
    full = F.cross_entropy(logits, target)
    # batch-sharded: per-shard means, then the average of equal shards (a pending average)
    batch = torch.stack([F.cross_entropy(logits[i:i + 4], target[i:i + 4]) for i in (0, 4)]).mean()
    torch.testing.assert_close(batch, full)
    # vocab-parallel: each rank holds 5 classes; max, sum-exp and the target logit are all-reduced
    parts = [logits[:, :5], logits[:, 5:]]
    gmax = torch.stack([p.max(dim=1).values for p in parts]).max(dim=0).values
    sumexp = sum((p - gmax[:, None]).exp().sum(dim=1) for p in parts)
    tgt = sum(torch.where((target >= lo) & (target < lo + 5), p.gather(1, (target - lo).clamp(0, 4)[:, None])[:, 0],
                          torch.zeros(8)) for lo, p in ((0, parts[0]), (5, parts[1])))
    torch.testing.assert_close((sumexp.log() + gmax - tgt).mean(), full)
    g = trace_model("gpt", SMALL).graph
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.cross_entropy_loss.default"), 4)}
    assert (("P",), ("S(0)", "S(0)")) in rules and (("R",), ("S(1)", "R")) in rules


def test_one_hot_rule_is_exact():
    idx = torch.randint(0, 5, (4, 6))
    full = F.one_hot(idx, 5)
    torch.testing.assert_close(torch.cat([F.one_hot(idx[:, :3], 5), F.one_hot(idx[:, 3:], 5)], dim=1), full)
    g = trace_model("moe", {"layers": 1, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16, "experts": 4}).graph
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.one_hot.default"), 4)}
    assert (("S(1)",), ("S(1)",)) in rules


MOE = {"layers": 1, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16, "experts": 4}


def test_gather_never_splits_the_index_along_the_gathered_dim_of_a_whole_input():
    g = trace_model("moe", MOE).graph
    node = _node(g, "aten.gather.default")  # padded.gather(1, index): tokens into expert slots
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, node, 4)}
    assert (("S(0)",), ("S(0)", "S(0)")) in rules  # split on another dim: its backward is local too
    assert not any(inputs == ("R", "S(1)") for _, inputs in rules)  # backward would need a pending scatter


def test_a_metadata_check_takes_its_input_as_it_is():
    g = trace_model("moe", MOE).graph
    node = _node(g, "aten._assert_tensor_metadata.default")  # what export writes for .to(dtype)
    rules = axis_strategies(g, node, 4)
    assert {r.inputs for r in rules} == {("R",), ("S(0)",), ("S(1)",), ("S(2)",), ("P",)}
    assert len(rules) == 5


def test_unknown_op_falls_back_to_replicate(caplog):
    from autopar.ir import Node, OpGraph, Ref, TensorInfo

    t = TensorInfo((1, 4), "float32", 0, True)
    nodes = [Node("x", "input", "input", outputs=(t,)),
             Node("y", "op", "aten.some_new_op.default", args=(Ref("x"),), outputs=(t,), batch_scaled=True)]
    g = OpGraph(nodes=nodes, params={}, layers=[], layer_container=None, seq_len=1)
    with caplog.at_level("WARNING"):
        rules = axis_strategies(g, nodes[1], 2)
    assert [(r.outputs, r.inputs) for r in rules] == [(("R",), ("R",))]
    assert "aten.some_new_op.default" in caplog.text


def test_convolutions_and_group_norm_split_the_batch_by_dtensors_rules():
    """``conv1d/2d`` and ``group_norm`` map onto DTensor's ``convolution`` and ``native_group_norm`` rules: the
    batch splits (every sample is convolved and normalized alone), the weights stay whole."""
    conv, norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8)
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(torch.cat([norm(conv(x[i:i + 2])) for i in (0, 2)]), norm(conv(x)))
    fixtures = Path(__file__).parent / "fixtures"
    g = trace_model(str(fixtures / "conv_groupnorm.py")).graph
    batch_split = {(("R",), ("R", "R", "R")), (("S(0)",), ("S(0)", "R", "R"))}
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.group_norm.default"), 4)}
    assert rules == batch_split
    # and split on the channels, column- or row-parallel (autopar.conv_channels; tests/test_conv_channels.py)
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.conv2d.default"), 4)}
    assert rules == batch_split | {(("S(1)",), ("R", "S(0)", "S(0)")), (("P",), ("S(1)", "S(1)", "P"))}
    g = trace_model(str(fixtures / "conv_features.py"), {"seq_len": 16}).graph
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, _node(g, "aten.conv1d.default"), 4)}
    assert (("S(0)",), ("S(0)", "R", "R")) in rules


CROSS_ATTENTION = '''
import torch
from torch import nn
from torch.nn import functional as F


class CrossAttention(nn.Module):
    """A decoder of 8 tokens attending to an encoder output of 32 (an encoder-decoder's cross-attention)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(64, 64), nn.Linear(64, 128), nn.Linear(64, 64)

    def forward(self, decoder, encoder):
        b = decoder.shape[0]
        q = self.q(decoder).view(b, 8, 4, 16).transpose(1, 2)
        k, v = (t.view(b, 32, 4, 16).transpose(1, 2) for t in self.kv(encoder).chunk(2, dim=-1))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 8, 64))


def build_model(seq_len=None):
    return CrossAttention()


def example_inputs(batch_size, seq_len, **config):
    return torch.randn(batch_size, 8, 64), torch.randn(batch_size, 32, 64)


def loss_fn(output, decoder, encoder):
    return output.float().pow(2).mean()
'''


def test_cross_attention_splits_heads_or_batch_and_counts_queries_times_keys(tmp_path):
    """Cross-attention reads keys and values of another length (the encoder's): the heads split on q, k and v
    alike, or the batch; its FLOPs are ``4 b h s_q s_kv d`` (no causal halving)."""
    path = tmp_path / "cross.py"
    path.write_text(CROSS_ATTENTION)
    g = trace_model(str(path)).graph
    sdpa = _node(g, "aten.scaled_dot_product_attention.default")
    rules = {(r.outputs, r.inputs) for r in axis_strategies(g, sdpa, 4)}
    assert (("S(1)",), ("S(1)",) * 3) in rules and (("S(0)",), ("S(0)",) * 3) in rules
    assert sdpa.annotations["flops"].fwd == 4 * 1 * 4 * 8 * 32 * 16
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 32, 16), torch.randn(2, 4, 32, 16)
    full = F.scaled_dot_product_attention(q, k, v)
    heads = [F.scaled_dot_product_attention(q[:, h], k[:, h], v[:, h]) for h in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(torch.cat(heads, dim=1), full)


def test_every_op_of_the_zoo_decoders_and_their_default_loss_has_a_sharding_rule(caplog, monkeypatch):
    # an op with no rule runs replicated and `autopar plan` warns of it: the README's own plan must not
    import autopar.intra_op.strategies as strategies

    monkeypatch.setattr(strategies, "_WARNED", set())
    for name, config in (("gpt", SMALL), ("llama", {**SMALL, "kv_heads": 2, "ffn": 128})):
        graph = trace_model(name, config).graph
        with caplog.at_level("WARNING", logger=strategies.__name__):
            for node in graph.ops():
                axis_strategies(graph, node, 2)
    assert not [r.getMessage() for r in caplog.records if "no sharding rule" in r.getMessage()]
