"""Tokenized training data on disk, read as one stream of token ids with its document boundaries.

``--data`` names a file, a folder or a glob pattern of shards, read in sorted order:

- ``.bin``: a flat array of token ids (``uint16`` or ``uint32``, ``--data-dtype``), memory-mapped; documents
  are separated by an end-of-document token (``--eos-id``), as in nanoGPT's and Megatron's files;
- ``.npy``: the same, carrying its own dtype;
- ``.parquet`` and ``.arrow`` (what HuggingFace ``datasets`` writes, ``to_parquet`` or ``save_to_disk``):
  one document per row, a list of token ids in a column (``--data-column``, default ``input_ids``).  Arrow
  files are memory-mapped; parquet is decompressed into memory.

A shard's end is also a document's end.  Nothing of a shard is read until a window of it is.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.errors import AutoparError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FLAT_SUFFIXES = (".bin", ".npy")
ROW_SUFFIXES = (".parquet", ".arrow")


@dataclass(frozen=True)
class Shard:
    """One file's token ids, and where its documents start (``None``: at each token after ``eos_id``)."""

    path: Path
    tokens: np.ndarray
    doc_starts: np.ndarray | None


@dataclass(frozen=True)
class TokenCorpus:
    """The shards' token ids as one stream: ``read`` any span of it, and the documents of that span."""

    shards: tuple[Shard, ...]
    offsets: np.ndarray  # where each shard starts in the stream, and the stream's length last
    eos_id: int | None

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def _pieces(self, start: int, length: int):
        """``(shard index, begin, end)`` of each shard a span of the stream covers, in order."""
        end = start + length
        if start < 0 or end > self.num_tokens:
            raise IndexError(f"tokens {start}..{end} of a stream of {self.num_tokens}")
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        for i in range(first, len(self.shards)):
            lo = int(self.offsets[i])
            if lo >= end:
                break
            yield i, max(start, lo) - lo, min(end, int(self.offsets[i + 1])) - lo

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length`` of the stream, as ``int64``."""
        return np.concatenate([np.asarray(self.shards[i].tokens[a:b], dtype=np.int64)
                               for i, a, b in self._pieces(start, length)])

    def document_ids(self, start: int, length: int) -> np.ndarray:
        """For each token of the span, the index of its document counted from the span's first (``0``)."""
        ids, base = [], 0
        for i, a, b in self._pieces(start, length):
            shard = self.shards[i]
            if shard.doc_starts is not None:
                pos = np.arange(a, b)
                local = np.searchsorted(shard.doc_starts, pos, side="right")
            else:
                if self.eos_id is None:
                    raise AutoparError(f"{shard.path}: document boundaries of a flat token file need --eos-id "
                                       "(the token that ends each document)")
                tokens = np.asarray(shard.tokens[a:b])
                local = np.concatenate(([0], np.cumsum(tokens[:-1] == self.eos_id)))
            local = local - local[0]
            ids.append(local + base)
            base = int(ids[-1][-1]) + 1  # a shard ends a document
        return np.concatenate(ids)


def shard_paths(spec: str | Path) -> list[Path]:
    """The shard files ``spec`` names: a file, every shard in a folder, or a glob pattern; sorted."""
    spec = str(spec)
    path = Path(spec)
    suffixes = FLAT_SUFFIXES + ROW_SUFFIXES
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in suffixes and p.is_file())
        where = f"the folder {path}"
    elif any(ch in spec for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(spec) if Path(p).suffix in suffixes and Path(p).is_file())
        where = f"the pattern {spec}"
    else:
        if not path.is_file():
            raise AutoparError(f"token data not found: {path}")
        if path.suffix not in suffixes:
            raise AutoparError(f"{path}: token data must be {', '.join(suffixes)} files")
        return [path]
    if not found:
        raise AutoparError(f"{where} holds no token shards ({', '.join(suffixes)})")
    return found


def open_flat(path: Path, dtype: str) -> np.ndarray:
    """A flat token file as a read-only memory map (``.npy``: its own dtype; else ``dtype``)."""
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as exc:
            raise AutoparError(f"{path}: not a readable .npy file ({exc})") from None
    else:
        if dtype not in TOKEN_DTYPES:
            raise AutoparError(f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, not {dtype!r}")
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    if tokens.ndim != 1:
        raise AutoparError(f"{path}: a token file holds one flat sequence of ids, this one has shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise AutoparError(f"{path}: token ids must be integers, not {tokens.dtype}")
    return tokens


def open_rows(path: Path, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A parquet or Arrow file's documents: their tokens end to end, and where each starts."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise AutoparError(f"{path}: reading parquet or Arrow needs pyarrow (pip install 'autopar[data]')") from None
    try:
        if path.suffix == ".parquet":
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=[column]) if column in names else None
        else:
            source = pa.memory_map(str(path))
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:  # datasets' save_to_disk writes the stream format
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()
            names = table.column_names
    except (pa.ArrowException, OSError) as exc:
        raise AutoparError(f"{path}: not a readable {path.suffix[1:]} file ({exc})") from None
    if table is None or column not in names:
        raise AutoparError(f"{path} has no column {column!r} (it has {', '.join(names)}); "
                           "name the token column with --data-column")
    docs = table.column(column).combine_chunks()
    if not (pa.types.is_list(docs.type) or pa.types.is_large_list(docs.type)) \
            or not pa.types.is_integer(docs.type.value_type):
        raise AutoparError(f"{path}: column {column!r} must hold lists of token ids, not {docs.type}")
    lengths = pc.list_value_length(docs).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = pc.list_flatten(docs).to_numpy(zero_copy_only=False)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return tokens, starts[lengths > 0]


def open_corpus(spec: str | Path, dtype: str = "uint16", column: str = "input_ids",
                eos_id: int | None = None) -> TokenCorpus:
    """The token stream of the shards ``spec`` names (see the module docstring)."""
    shards = []
    for path in shard_paths(spec):
        if path.suffix in FLAT_SUFFIXES:
            shards.append(Shard(path, open_flat(path, dtype), None))
        else:
            shards.append(Shard(path, *open_rows(path, column)))
    offsets = np.concatenate(([0], np.cumsum([len(s.tokens) for s in shards]))).astype(np.int64)
    return TokenCorpus(tuple(shards), offsets, eos_id)


__all__ = ["TOKEN_DTYPES", "Shard", "TokenCorpus", "open_corpus", "open_flat", "open_rows", "shard_paths"]
