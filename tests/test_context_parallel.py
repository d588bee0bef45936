"""Context parallelism: the load-balanced slices, the labels, and what the cost model charges for it."""

from __future__ import annotations

import pytest
import torch

from autopar.api import plan
from autopar.errors import AutoparError
from autopar.inputs import ModelInputs
from autopar.runtime.context_parallel import ContextParallel, gathered_positions, rank_positions

LLAMA_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256,
            "seq_len": 32768}


def test_each_rank_takes_a_chunk_from_either_end():
    assert rank_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rank_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_positions(16, 4).tolist()) == list(range(16))
    # under a causal mask every rank sees the same number of (query, key) pairs
    pairs = [int((rank_positions(64, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(pairs)) == 1
    with pytest.raises(AutoparError, match="8 equal chunks"):
        rank_positions(20, 4, 0)


def test_labels_are_shifted_on_the_whole_sequence_before_slicing():
    cp = ContextParallel(None, 2, 1, 8)
    ids = torch.arange(8).view(1, 8) * 10
    local, labels = cp.shard_inputs(ModelInputs((ids,)))
    assert local.first.tolist() == [[20, 30, 40, 50]] and labels.tolist() == [[30, 40, 50, 60]]
    local, labels = ContextParallel(None, 2, 0, 8).shard_inputs(ModelInputs((), {"ids": ids}))
    assert local.first.tolist() == [[0, 10, 60, 70]] and labels.tolist() == [[10, 20, 70, -100]]  # the last has none


@pytest.mark.parametrize("cp", [2, 4])
def test_each_query_chunk_attends_causally_to_the_keys_before_its_end(monkeypatch, cp):
    """A rank's attention (its two chunks of queries against the all-gathered keys, each under a causal mask
    aligned to its end) equals its rows of whole-sequence causal attention, grouped-query heads included; and it
    scores only the (query, key) pairs up to each chunk's end: the causal share, not every gathered key."""
    import torch.distributed._functional_collectives as collectives
    from torch.nn import functional as F

    from autopar.runtime.context_parallel import ContextParallelAttention

    torch.manual_seed(0)
    seq = 8 * cp
    q, k, v = (torch.randn(2, heads, seq, 8, dtype=torch.float64) for heads in (4, 2, 2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    scored = []
    real_sdpa = F.scaled_dot_product_attention

    def counted(query, key, *args, **kwargs):
        scored.append(query.shape[-2] * key.shape[-2])
        return real_sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    for rank in range(cp):
        part = ContextParallel(None, cp, rank, seq)
        mine = part.positions(torch.device("cpu"))
        slices = {name: t.index_select(2, mine).contiguous() for name, t in (("k", k), ("v", v))}
        everyone = {name: torch.cat([t.index_select(2, rank_positions(seq, cp, r)) for r in range(cp)], 2)
                    for name, t in (("k", k), ("v", v))}
        monkeypatch.setattr(collectives, "all_gather_single_autograd",
                            lambda t, gather_dim, group, everyone=everyone, slices=slices:
                            everyone["k" if t is slices["k"] else "v"])
        scored.clear()
        out = ContextParallelAttention(part, part.key_order(torch.device("cpu")))._attend(
            q.index_select(2, mine), slices["k"], slices["v"], is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, whole.index_select(2, mine))
        chunk = seq // (2 * cp)
        assert sum(scored) == chunk * chunk * (2 * cp + 1)  # not 2 chunk x seq


def test_on_cuda_a_chunk_calls_flash_attention_causal_aligned_to_the_end(monkeypatch):
    """The CUDA branch (which this machine cannot run): the chunk goes to ``aten._scaled_dot_product_flash_attention``
    with ``is_causal=True``, whose mask FlashAttention aligns to the end of the keys, and its output is taken;
    stood in for here by attention under that mask."""
    from torch.nn import functional as F

    import autopar.runtime.context_parallel as context_parallel

    calls = []

    def flash(query, key, value, dropout_p, is_causal, scale=None):
        calls.append((tuple(query.shape), tuple(key.shape), dropout_p, is_causal, scale))
        length, seen = query.shape[-2], key.shape[-2]
        mask = torch.ones(length, seen, dtype=torch.bool).tril(seen - length)
        return (F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale), None)

    monkeypatch.setattr(context_parallel, "runs_flash", lambda query: True)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", flash)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    out = context_parallel._causal_to_end(q, k, v, 0.0, {"scale": 0.5})
    assert calls == [((1, 2, 4, 8), (1, 2, 12, 8), 0.0, True, 0.5)]
    monkeypatch.setattr(context_parallel, "runs_flash", lambda query: False)  # the explicit mask: the same
    torch.testing.assert_close(out, context_parallel._causal_to_end(q, k, v, 0.0, {"scale": 0.5}))
    assert not context_parallel.runs_flash(torch.randn(1, 2, 4, 8, dtype=torch.bfloat16))  # not on CUDA


def _plan(**fix):
    return plan("llama", config=LLAMA_8B, cluster="h100-80gb", gpus=16, global_batch=8,
                fix={"tp": 8, "pp": 1, "mbs": 1, "recompute": "full", "zero": 1, "sp": False, **fix})


def _estimate(**fix) -> dict:
    return _plan(**fix).estimate


def test_a_plan_says_which_attention_kernel_each_device_runs_under_cp(tmp_path):
    from autopar.plan_file import Plan

    with_cp, without = _plan(dp=1, cp=2), _plan(dp=2, cp=1)
    assert set(with_cp.context_parallel["attention"]) == {"cuda", "other"}
    assert "FlashAttention" in with_cp.context_parallel["attention"]["cuda"]
    assert "context_parallel" not in without.to_dict()  # plans without cp are written as before
    with_cp.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").context_parallel == with_cp.context_parallel


def test_context_parallelism_splits_the_work_and_pays_for_the_keys_and_values():
    one, two = _estimate(dp=2, cp=1), _estimate(dp=1, cp=2)
    b1, b2 = one["breakdown"], two["breakdown"]
    assert b1["cp_comm_s"] == 0 and b2["cp_comm_s"] > 0
    # the same 16 GPUs work on the same tokens: compute per GPU is about the same, micro-batches are halved
    # into half-sequences, so the per-micro-batch work is half and there are twice as many of them
    assert b2["compute_s"] == pytest.approx(b1["compute_s"], rel=0.05)
    assert two["peak_memory_bytes"] < one["peak_memory_bytes"]
    # the K/V all-gather of 8 KV heads over 2 ranks is small next to the compute it feeds
    assert b2["cp_comm_s"] < 0.05 * b2["compute_s"]


def test_pinned_cp_must_cut_the_sequence_evenly():
    with pytest.raises(AutoparError, match="2 \\* cp = 6 equal chunks"):
        plan("llama", config={**LLAMA_8B, "seq_len": 32764}, cluster="h100-80gb", gpus=24, global_batch=8,
             fix={"cp": 3, "tp": 8})
