"""Training batches of one data-parallel rank: the model file's ``batches``, a token file, or synthetic tokens.

- A model file may define ``batches(dp_rank, dp_size, batch_size, seq_len, **config)``: an iterator of input
  tuples of ``batch_size`` samples (this rank's share of the global batch).
- ``token_batches`` memory-maps a flat file of token ids (``.bin`` of ``uint16``/``uint32``, or ``.npy``,
  which carries its own dtype) and cuts it into windows of ``seq_len`` tokens: step ``s`` reads windows
  ``s * global_batch + dp_rank * batch_size ...``, so the ranks of a step read disjoint slices and together
  the global batch, in file order, wrapping at the end.
- Otherwise synthetic tokens: the same global batch on every rank (seeded by the step), sliced per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from autopar import modelfile
from autopar.errors import AutoparError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def open_tokens(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """The token ids of ``path`` as a read-only memory map (``.npy``: its own dtype; else ``dtype``)."""
    path = Path(path)
    if not path.is_file():
        raise AutoparError(f"token file not found: {path}")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        if dtype not in TOKEN_DTYPES:
            raise AutoparError(f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, not {dtype!r}")
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    if tokens.ndim != 1:
        raise AutoparError(f"{path}: a token file holds one flat sequence of ids, this one has shape {tokens.shape}")
    return tokens


def token_batches(tokens: np.ndarray, dp_rank: int, dp_size: int, batch_size: int, seq_len: int,
                  start_step: int = 0, vocab: int | None = None) -> Iterator[tuple[torch.Tensor]]:
    """This rank's ``[batch_size, seq_len]`` windows of ``tokens`` for steps ``start_step, start_step + 1, ...``."""
    windows = len(tokens) // seq_len
    if windows < batch_size * dp_size:
        raise AutoparError(f"the token file holds {len(tokens)} tokens, fewer than one global batch of "
                           f"{batch_size * dp_size} x {seq_len}")
    for step in itertools.count(start_step):
        first = step * batch_size * dp_size + dp_rank * batch_size
        rows = [np.asarray(tokens[(w % windows) * seq_len:(w % windows + 1) * seq_len])
                for w in range(first, first + batch_size)]
        ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        if vocab is not None and int(ids.max()) >= vocab:
            raise AutoparError(f"the token file holds id {int(ids.max())}, beyond the model's vocabulary of {vocab}")
        yield (ids,)


def synthetic_batches(module: ModuleType, model: nn.Module, config: dict[str, Any], global_batch: int,
                      seq_len: int, dp_rank: int, dp_size: int, seed: int,
                      start_step: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """The seeded synthetic global batch of each step (``example_inputs`` or random ids), this rank's slice."""
    local = global_batch // dp_size
    for step in itertools.count(start_step):
        torch.manual_seed(seed + 1000 + step)
        gen = torch.Generator().manual_seed(seed + 1000 + step)
        inputs = modelfile.example_inputs(module, model, global_batch, seq_len, config, generator=gen)
        yield tuple(x[dp_rank * local:(dp_rank + 1) * local] for x in inputs)


def model_batches(module: ModuleType, dp_rank: int, dp_size: int, batch_size: int, seq_len: int,
                  config: dict[str, Any]) -> Iterator[tuple[torch.Tensor, ...]] | None:
    """The model file's own ``batches`` iterator, or ``None`` when it defines none.  The config's own ``seq_len``
    (most models take one) is the ``seq_len`` argument, not a second one."""
    fn = getattr(module, "batches", None)
    if fn is None:
        return None
    rest = {k: v for k, v in config.items() if k not in ("dp_rank", "dp_size", "batch_size", "seq_len")}
    return (tuple(b) if isinstance(b, (tuple, list)) else (b,)
            for b in fn(dp_rank, dp_size, batch_size, seq_len, **rest))





def run_batches(module: ModuleType, model: nn.Module, config: dict[str, Any], global_batch: int, seq_len: int,
                dp_rank: int, dp_size: int, seed: int, data: str | None = None,
                data_dtype: str = "uint16", start_step: int = 0) -> tuple[Iterator[tuple[torch.Tensor, ...]], str]:
    """This rank's batches for a run from step ``start_step`` on, and where they come from: the model file's
    ``batches`` (its first ``start_step`` batches drawn and dropped: it cannot seek), else the token file ``data``,
    else synthetic tokens.  ``model`` may be a meta-device build (only its vocabulary is read)."""
    local = global_batch // dp_size
    if data:
        vocab = modelfile.vocab_size(model, config)
        return token_batches(open_tokens(data, data_dtype), dp_rank, dp_size, local, seq_len, start_step=start_step,
                             vocab=vocab), data
    own = model_batches(module, dp_rank, dp_size, local, seq_len, config)
    if own is not None:
        return itertools.islice(own, start_step, None), "the model file's batches()"
    return (synthetic_batches(module, model, config, global_batch, seq_len, dp_rank, dp_size, seed, start_step),
            "synthetic random tokens (no --data file and no batches() in the model file)")
__all__ = ["model_batches", "open_tokens", "run_batches", "synthetic_batches", "token_batches"]
