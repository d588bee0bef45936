"""Sharding strategies: DTensor's rules through our mapping, and the hand-written rules checked numerically."""

from __future__ import annotations

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
