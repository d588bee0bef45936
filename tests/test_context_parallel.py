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


def _estimate(**fix) -> dict:
    p = plan("llama", config=LLAMA_8B, cluster="h100-80gb", gpus=16, global_batch=8,
             fix={"tp": 8, "pp": 1, "mbs": 1, "recompute": "full", "zero": 1, "sp": False, **fix})
    return p.estimate


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
