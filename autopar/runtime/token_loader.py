"""One data-parallel rank's batches of a token corpus, through torchdata's ``StatefulDataLoader``.

The stream is cut into windows of ``seq_len`` tokens (sequences packed end to end, as Megatron and
torchtitan pack them).  The run reads windows by a *global sample index*: step ``s`` takes samples
``s * global_batch ... (s + 1) * global_batch - 1`` and rank ``r`` of ``dp`` its ``r``-th slice of them.
Sample ``g`` is window ``perm_e(g mod W)`` of epoch ``e = g // W``, where ``perm_e`` is a pseudo-random
permutation of the ``W`` windows keyed by the seed and the epoch (a Feistel network with cycle walking: any
window is found in O(1) memory, for corpora of billions of windows).  So the position of a run is one
number, the samples consumed, which a checkpoint keeps and which holds under any dp.

With document masking, each sample also carries the document index of each token (``0`` for the window's
first document), for attention that keeps documents apart.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from autopar.errors import AutoparError
from autopar.runtime.token_corpus import TokenCorpus

_FEISTEL_ROUNDS = 6
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """SplitMix64's finalizer of ``x + key`` (uint64, wrapping): a well-mixed round function."""
    x = x + np.uint64(key & _MASK64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def window_permutation(index: np.ndarray, size: int, seed: int, epoch: int) -> np.ndarray:
    """``perm(index)`` for a pseudo-random permutation of ``range(size)`` keyed by ``seed`` and ``epoch``."""
    half = max(1, (max(size - 1, 1).bit_length() + 1) // 2)  # a domain of 4**half >= size
    low = np.uint64((1 << half) - 1)
    keys = [int(_mix(np.array([(seed * 1_000_003 + epoch * 7919 + r) & _MASK64], dtype=np.uint64),
                     0x9E3779B97F4A7C15)[0]) for r in range(_FEISTEL_ROUNDS)]
    out = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(out.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():  # cycle walking: apply the network again until the value lies in range
            left, right = out[todo] >> np.uint64(half), out[todo] & low
            for key in keys:
                left, right = right, left ^ (_mix(right, key) & low)
            out[todo] = (left << np.uint64(half)) | right
            todo = out >= np.uint64(size)
    return out.astype(np.int64)


class WindowDataset(torch.utils.data.Dataset):
    """Window ``w`` of the stream: its token ids, and with ``documents`` each token's document index."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, documents: bool = False) -> None:
        self.corpus, self.seq_len, self.documents = corpus, seq_len, documents

    def __len__(self) -> int:
        return self.corpus.num_tokens // self.seq_len

    def __getitem__(self, window: int) -> tuple[torch.Tensor, ...]:
        start = int(window) * self.seq_len
        ids = torch.from_numpy(self.corpus.read(start, self.seq_len))
        if not self.documents:
            return (ids,)
        return ids, torch.from_numpy(self.corpus.document_ids(start, self.seq_len))


class GlobalBatchSampler:
    """The windows of this rank's share of every step from a global position on: an endless iterator of
    index lists, ``Stateful`` for the ``StatefulDataLoader`` (its state is the global samples consumed)."""

    def __init__(self, windows: int, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True, samples: int = 0) -> None:
        if global_batch % dp_size:
            raise AutoparError(f"the global batch {global_batch} does not split over {dp_size} data-parallel ranks")
        self.windows, self.global_batch, self.seed, self.shuffle = windows, global_batch, seed, shuffle
        self.local = global_batch // dp_size
        self.first = dp_rank * self.local
        self.samples = samples  # global samples consumed before the next batch this iterator gives

    def windows_of(self, samples: np.ndarray) -> np.ndarray:
        """The window each global sample index reads."""
        epoch, index = np.divmod(samples, self.windows)
        if not self.shuffle:
            return index
        out = np.empty_like(index)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = window_permutation(index[sel], self.windows, self.seed, int(e))
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        begin = self.samples + self.first
        self.samples += self.global_batch
        return self.windows_of(np.arange(begin, begin + self.local, dtype=np.int64)).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state["samples"])


def token_loader(corpus: TokenCorpus, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 samples: int = 0, shuffle: bool = True, documents: bool = False, workers: int = 0):
    """A ``StatefulDataLoader`` of this rank's batches from global sample ``samples`` on: tuples of
    ``[global_batch // dp_size, seq_len]`` token ids (and document indices with ``documents``)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise AutoparError("--data needs torchdata (pip install 'autopar[data]')") from None
    dataset = WindowDataset(corpus, seq_len, documents)
    if len(dataset) < global_batch:
        raise AutoparError(f"the token data holds {corpus.num_tokens} tokens, fewer than one global batch of "
                           f"{global_batch} x {seq_len}")
    sampler = GlobalBatchSampler(len(dataset), global_batch, dp_rank, dp_size, seed, shuffle, samples)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                  persistent_workers=workers > 0)


__all__ = ["GlobalBatchSampler", "WindowDataset", "token_loader", "window_permutation"]
