"""Training data of generated scripts: token files cut per data-parallel rank, the model file's batches."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from autopar.errors import AutoparError
from autopar.runtime.data import open_tokens, run_batches, token_batches


def _tokens(tmp_path, n: int, suffix: str = ".bin", dtype=np.uint16):
    data = np.arange(n, dtype=dtype)
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".npy":
        np.save(path, data)
    else:
        data.tofile(path)
    return path


def test_ranks_read_disjoint_windows_that_make_the_global_batch(tmp_path):
    tokens = open_tokens(_tokens(tmp_path, 4 * 2 * 3 * 8), "uint16")  # 3 steps of 2 ranks x 4 samples x 8
    first = torch.cat([next(token_batches(tokens, rank, 2, 4, 8))[0] for rank in (0, 1)])  # step 0, rank order
    assert first.shape == (8, 8) and first.dtype == torch.int64
    assert torch.equal(first.flatten(), torch.arange(64))  # the file's first global batch, in order
    it = token_batches(tokens, 1, 2, 4, 8, start_step=2)
    assert int(next(it)[0][0, 0]) == (2 * 8 + 4) * 8  # step 2, rank 1: window 20


def test_token_files_wrap_and_npy_carries_its_dtype(tmp_path):
    tokens = open_tokens(_tokens(tmp_path, 2 * 8, ".npy", np.uint32))
    assert tokens.dtype == np.uint32
    it = token_batches(tokens, 0, 1, 2, 8)
    assert torch.equal(next(it)[0], next(it)[0])  # two windows in all: every step reads them again


def test_bad_token_files_are_refused(tmp_path):
    with pytest.raises(AutoparError, match="token file not found"):
        open_tokens(tmp_path / "missing.bin")
    with pytest.raises(AutoparError, match="--data-dtype must be one of uint16, uint32"):
        open_tokens(_tokens(tmp_path, 16), "int8")
    small = open_tokens(_tokens(tmp_path, 16))
    with pytest.raises(AutoparError, match="fewer than one global batch of 4 x 8"):
        next(token_batches(small, 0, 2, 2, 8))
    with pytest.raises(AutoparError, match="beyond the model's vocabulary of 10"):
        next(token_batches(open_tokens(_tokens(tmp_path, 64)), 0, 1, 2, 8, vocab=10))


def test_run_batches_prefers_the_token_file_then_the_model_files_batches(tmp_path):
    def batches(dp_rank, dp_size, batch_size, seq_len, **config):
        while True:
            yield torch.full((batch_size, seq_len), dp_rank)

    module = types.SimpleNamespace(batches=batches)
    model = torch.nn.Embedding(1000, 4)
    own, source = run_batches(module, model, {}, 8, 8, dp_rank=1, dp_size=2, seed=0)
    assert source == "the model file's batches()" and torch.equal(next(own)[0], torch.full((4, 8), 1))
    path = _tokens(tmp_path, 256)
    from_file, source = run_batches(module, model, {}, 8, 8, dp_rank=0, dp_size=2, seed=0, data=str(path))
    assert source == str(path) and torch.equal(next(from_file)[0].flatten(), torch.arange(32))
    synthetic, source = run_batches(types.SimpleNamespace(), model, {}, 8, 8, dp_rank=0, dp_size=2, seed=0)
    assert source.startswith("synthetic") and next(synthetic)[0].shape == (4, 8)
