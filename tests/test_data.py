"""Training data of generated scripts: token shards on disk, read per data-parallel rank through torchdata's
StatefulDataLoader by a global sample position; the model file's batches; synthetic tokens."""

from __future__ import annotations

import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from autopar.errors import AutoparError
from autopar.runtime.data import TokenData, run_batches, token_batches
from autopar.runtime.token_corpus import open_corpus
from autopar.runtime.token_loader import GlobalBatchSampler, token_loader, window_permutation


def _flat(tmp_path, tokens, name: str = "tokens.bin", dtype=np.uint16):
    data = np.asarray(tokens, dtype=dtype)
    path = tmp_path / name
    if path.suffix == ".npy":
        np.save(path, data)
    else:
        data.tofile(path)
    return path


def _global_batch(data: TokenData, step: int, dp: int, global_batch: int = 8, seq_len: int = 8):
    """Step ``step``'s global batch, the ranks' shares in rank order."""
    parts = [next(token_batches(data, global_batch, seq_len, r, dp, start_step=step)) for r in range(dp)]
    return [torch.cat([inputs.first for inputs, _ in parts])]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4099])
def test_the_shuffle_is_a_permutation_of_the_windows(n):
    out = window_permutation(np.arange(n), n, seed=3, epoch=1)
    assert sorted(out.tolist()) == list(range(n))


def test_the_shuffle_depends_on_the_seed_and_the_epoch():
    base = window_permutation(np.arange(64), 64, seed=0, epoch=0)
    assert not np.array_equal(base, np.arange(64))
    assert not np.array_equal(base, window_permutation(np.arange(64), 64, seed=1, epoch=0))
    assert not np.array_equal(base, window_permutation(np.arange(64), 64, seed=0, epoch=1))
    assert np.array_equal(base, window_permutation(np.arange(64), 64, seed=0, epoch=0))


def test_ranks_read_disjoint_windows_that_make_the_global_batch_in_file_order_without_shuffle(tmp_path):
    data = TokenData(str(_flat(tmp_path, np.arange(3 * 8 * 8))), shuffle=False)  # 3 steps of 8 windows of 8
    ids, = _global_batch(data, 0, dp=2)
    assert ids.shape == (8, 8) and ids.dtype == torch.int64
    assert torch.equal(ids.flatten(), torch.arange(64))
    it = token_batches(data, 8, 8, 1, 2, start_step=2)
    assert int(next(it)[0].first[0, 0]) == (2 * 8 + 4) * 8  # step 2, rank 1: window 20


def test_an_epoch_reads_every_window_once_and_the_next_epoch_reshuffles(tmp_path):
    data = TokenData(str(_flat(tmp_path, np.arange(4 * 8 * 8))), seed=7)  # 32 windows: 4 steps an epoch
    epoch = [_global_batch(data, step, dp=2)[0][:, 0] // 8 for step in range(8)]
    first, second = torch.cat(epoch[:4]), torch.cat(epoch[4:])
    assert sorted(first.tolist()) == list(range(32)) == sorted(second.tolist())
    assert not torch.equal(first, torch.arange(32)) and not torch.equal(first, second)


def test_the_position_is_global_so_a_change_of_dp_reads_the_same_global_batches(tmp_path):
    data = TokenData(str(_flat(tmp_path, np.arange(40 * 8) % 1000)))  # 40 windows: steps wrap into epoch 1
    for step in (0, 3, 6):
        assert torch.equal(_global_batch(data, step, dp=1)[0], _global_batch(data, step, dp=4)[0])


def test_the_loaders_own_state_resumes_at_the_same_batch_with_workers(tmp_path):
    corpus = open_corpus(_flat(tmp_path, np.arange(64 * 8)))
    loader = token_loader(corpus, 8, 8, 0, 2, seed=1, workers=2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    want = [next(it)[0] for _ in range(3)]
    again = token_loader(corpus, 8, 8, 0, 2, seed=1, workers=2)
    again.load_state_dict(state)
    got = [b[0] for b, _ in zip(again, range(3))]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    fresh = GlobalBatchSampler(64, 8, 0, 2, seed=1, samples=2 * 8)  # the same, from the global position
    assert next(fresh) == (want[0][:, 0] // 8).tolist()


def test_parquet_and_arrow_shards_read_as_one_stream_with_their_documents(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [], [9, 10, 11, 12]]
    pq.write_table(pa.table({"input_ids": docs[:2], "text": ["a", "b"]}), folder / "a.parquet")
    table = pa.table({"input_ids": pa.array(docs[2:], pa.list_(pa.int32()))})
    with pa.ipc.new_stream(str(folder / "b.arrow"), table.schema) as writer:  # datasets' save_to_disk format
        writer.write_table(table)
    _flat(folder, [13, 0, 14, 15], "c.npy", np.uint32)
    (folder / "notes.txt").write_text("not a shard")
    corpus = open_corpus(folder, eos_id=0)
    assert corpus.num_tokens == 16
    assert corpus.read(0, 16).tolist() == [*range(1, 14), 0, 14, 15]
    # parquet rows, the arrow file's rows, then the npy shard split after its eos token
    assert corpus.document_ids(0, 16).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4]
    assert corpus.document_ids(5, 6).tolist() == [0, 0, 0, 1, 1, 1]  # counted from the span's first document
    data = TokenData(str(folder / "*.parquet"), documents=True, shuffle=False)
    inputs, documents = next(token_batches(data, 2, 4, 0, 1))
    assert inputs.first.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]] and documents.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]


def test_bad_token_data_is_refused_in_one_line(tmp_path):
    with pytest.raises(AutoparError, match="token data not found"):
        open_corpus(tmp_path / "missing.bin")
    with pytest.raises(AutoparError, match="holds no token shards"):
        open_corpus(tmp_path)
    with pytest.raises(AutoparError, match="--data-dtype must be one of uint16, uint32"):
        open_corpus(_flat(tmp_path, range(16)), "int8")
    with pytest.raises(AutoparError, match="fewer than one global batch of 4 x 8"):
        token_batches(TokenData(str(_flat(tmp_path, range(16)))), 4, 8, 0, 2)
    with pytest.raises(AutoparError, match="beyond the model's vocabulary of 10"):
        next(token_batches(TokenData(str(_flat(tmp_path, range(64)))), 2, 8, 0, 1, vocab=10))
    with pytest.raises(AutoparError, match="need --eos-id"):
        token_batches(TokenData(str(_flat(tmp_path, range(64))), documents=True), 2, 8, 0, 1)
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(AutoparError, match=r"no column 'input_ids' \(it has text\); name the token column"):
        open_corpus(tmp_path / "t.parquet")
    with pytest.raises(AutoparError, match="must hold lists of token ids"):
        open_corpus(tmp_path / "t.parquet", column="text")
    (tmp_path / "bad.arrow").write_bytes(b"not arrow")
    with pytest.raises(AutoparError, match="not a readable arrow file"):
        open_corpus(tmp_path / "bad.arrow")


def test_run_batches_prefers_the_token_data_then_the_model_files_batches(tmp_path):
    def batches(dp_rank, dp_size, batch_size, seq_len, **config):
        while True:
            yield torch.full((batch_size, seq_len), dp_rank)

    module = types.SimpleNamespace(batches=batches)
    model = torch.nn.Embedding(1000, 4)
    own, source = run_batches(module, model, {}, 8, 8, dp_rank=1, dp_size=2, seed=0)
    assert source == "the model file's batches()" and torch.equal(next(own)[0].first, torch.full((4, 8), 1))
    path = _flat(tmp_path, range(256))
    data = TokenData(str(path), shuffle=False)
    from_file, source = run_batches(module, model, {}, 8, 8, dp_rank=0, dp_size=2, seed=0, data=data)
    assert source == str(path) and torch.equal(next(from_file)[0].first.flatten(), torch.arange(32))
    synthetic, source = run_batches(types.SimpleNamespace(), model, {}, 8, 8, dp_rank=0, dp_size=2, seed=0)
    assert source.startswith("synthetic") and next(synthetic)[0].first.shape == (4, 8)
