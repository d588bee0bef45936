"""Training batches of one data-parallel rank: token data on disk, the model file's ``batches``, or synthetic tokens.

- ``--data`` (``TokenData``): shards of token ids (``token_corpus``), cut into windows and shuffled by seed
  through torchdata's ``StatefulDataLoader`` (``token_loader``); the position is the global samples consumed.
- A model file may define ``batches(dp_rank, dp_size, batch_size, seq_len, **config)``: an iterator of inputs
  of ``batch_size`` samples (this rank's share of the global batch), in any form ``example_inputs`` may return.
- Otherwise synthetic tokens: the same global batch on every rank (seeded by the step), sliced per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autopar import modelfile
from autopar.errors import AutoparError
from autopar.inputs import ModelInputs
from autopar.runtime.token_corpus import open_corpus
from autopar.runtime.token_loader import token_loader


@dataclass(frozen=True)
class TokenData:
    """Where the token data is and how to read it (``train.py``'s ``--data`` options)."""

    path: str
    dtype: str = "uint16"  # of .bin shards
    column: str = "input_ids"  # of parquet and Arrow shards
    eos_id: int | None = None  # ends each document of a flat shard
    shuffle: bool = True
    seed: int = 0
    documents: bool = False  # each sample also carries its tokens' document indices
    workers: int = 0  # loader worker processes


#: One step's batch on one data-parallel rank: the model's inputs, and each token's document index (``None``
#: unless the data carries documents, ``TokenData.documents``).
Batch = tuple[ModelInputs, torch.Tensor | None]


def checked_ids(batches: Iterable[tuple[torch.Tensor, ...]], vocab: int | None) -> Iterator[Batch]:
    """The loader's ``(ids,)`` or ``(ids, documents)`` as batches, refusing ids beyond the model's vocabulary."""
    for batch in batches:
        top = int(batch[0].max())
        if vocab is not None and top >= vocab:
            raise AutoparError(f"the token data holds id {top}, beyond the model's vocabulary of {vocab}")
        yield ModelInputs((batch[0],)), (batch[1] if len(batch) > 1 else None)


def token_batches(data: TokenData, global_batch: int, seq_len: int, dp_rank: int, dp_size: int,
                  start_step: int = 0, vocab: int | None = None) -> Iterator[Batch]:
    """This rank's batches of ``data`` for steps ``start_step, start_step + 1, ...``."""
    corpus = open_corpus(data.path, data.dtype, data.column, data.eos_id)
    if data.documents:
        corpus.document_ids(0, min(seq_len, corpus.num_tokens))  # a flat shard without --eos-id: say so now
    loader = token_loader(corpus, seq_len, global_batch, dp_rank, dp_size, data.seed,
                          samples=start_step * global_batch, shuffle=data.shuffle, documents=data.documents,
                          workers=data.workers)
    return checked_ids(loader, vocab)


def synthetic_batches(module: ModuleType, model: nn.Module, config: dict[str, Any], global_batch: int,
                      seq_len: int, dp_rank: int, dp_size: int, seed: int,
                      start_step: int = 0) -> Iterator[ModelInputs]:
    """The seeded synthetic global batch of each step (``example_inputs`` or random ids), this rank's slice."""
    local = global_batch // dp_size
    for step in itertools.count(start_step):
        torch.manual_seed(seed + 1000 + step)
        gen = torch.Generator().manual_seed(seed + 1000 + step)
        inputs = modelfile.example_inputs(module, model, global_batch, seq_len, config, generator=gen)
        yield inputs.rows(dp_rank * local, (dp_rank + 1) * local)


def model_batches(module: ModuleType, dp_rank: int, dp_size: int, batch_size: int, seq_len: int,
                  config: dict[str, Any]) -> Iterator[ModelInputs] | None:
    """The model file's own ``batches`` iterator, or ``None`` when it defines none.  The config's own ``seq_len``
    (most models take one) is the ``seq_len`` argument, not a second one."""
    fn = getattr(module, "batches", None)
    if fn is None:
        return None
    rest = {k: v for k, v in config.items() if k not in ("dp_rank", "dp_size", "batch_size", "seq_len")}
    return (ModelInputs.of(b, "batches()") for b in fn(dp_rank, dp_size, batch_size, seq_len, **rest))


def run_batches(module: ModuleType, model: nn.Module, config: dict[str, Any], global_batch: int, seq_len: int,
                dp_rank: int, dp_size: int, seed: int, data: TokenData | None = None,
                start_step: int = 0) -> tuple[Iterator[Batch], str]:
    """This rank's batches for a run from step ``start_step`` on, and where they come from: the token data
    ``data``, else the model file's ``batches`` (its first ``start_step`` batches drawn and dropped: it cannot
    seek), else synthetic tokens.  ``model`` may be a meta-device build (only its vocabulary is read)."""
    local = global_batch // dp_size
    if data is not None:
        vocab = modelfile.vocab_size(model, config)
        return token_batches(data, global_batch, seq_len, dp_rank, dp_size, start_step, vocab), data.path
    own = model_batches(module, dp_rank, dp_size, local, seq_len, config)
    if own is not None:
        return ((b, None) for b in itertools.islice(own, start_step, None)), "the model file's batches()"
    synthetic = synthetic_batches(module, model, config, global_batch, seq_len, dp_rank, dp_size, seed, start_step)
    return ((b, None) for b in synthetic), "synthetic random tokens (no --data file and no batches() in the model file)"


__all__ = ["Batch", "TokenData", "checked_ids", "model_batches", "run_batches", "synthetic_batches", "token_batches"]
