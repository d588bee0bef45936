"""The model-file convention: what ``autopar plan MODEL`` loads.

A model file defines

- ``build_model(**config) -> nn.Module`` (required);
- ``example_inputs(batch_size, seq_len, **config) -> tuple[Tensor, ...]`` (optional; default: one
  LongTensor of token ids ``[batch, seq]``);
- ``loss_fn(output, *inputs) -> Tensor`` (optional; default: next-token cross-entropy on the logits,
  also when the output is a HuggingFace ``ModelOutput``);
- ``batches(dp_rank, dp_size, batch_size, seq_len, **config)`` (optional): training data for generated
  scripts, an iterator of input tuples (``autopar.runtime.data``).

The model may define ``init_parameter(name, tensor)`` to initialize one parameter in place
(``autopar.runtime.materialize``).

``MODEL`` is a path to such a file or the name of a zoo model (``gpt``, ``llama``, ``mlp``, ``moe``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autopar.errors import ModelFileError
from autopar.tracing import default_loss_fn

ZOO = ("gpt", "llama", "mlp", "moe")
DEFAULT_SEQ_LEN = 2048


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from: a zoo name or a file path, and the config it is built with."""

    ref: str  # what the user typed: "gpt" or "path/to/model.py"
    path: Path
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_zoo(self) -> bool:
        return self.ref in ZOO


def resolve(ref: str) -> Path:
    """The file behind a zoo name or a path; raises ``ModelFileError`` when there is none."""
    if ref in ZOO:
        spec = importlib.util.find_spec(f"autopar.models.{ref}")
        assert spec is not None and spec.origin is not None
        return Path(spec.origin)
    path = Path(ref)
    if not path.is_file():
        zoo = ", ".join(ZOO)
        raise ModelFileError(f"model file not found: {ref} (give a path to a .py file or a zoo name: {zoo})")
    if path.suffix != ".py":
        raise ModelFileError(f"model file must be a Python file (.py): {ref}")
    return path


def load_module(ref: str) -> ModuleType:
    """Import the model file (by path, under a private module name) or the zoo module."""
    if ref in ZOO:
        return importlib.import_module(f"autopar.models.{ref}")
    path = resolve(ref).resolve()
    name = "autopar_user_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:10]
    if name in sys.modules:
        module = sys.modules[name]
    else:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise ModelFileError(f"{ref}: importing the model file failed: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(module, "build_model", None)):
        raise ModelFileError(f"{ref}: the model file defines no build_model(**config) function")
    return module


def parse_config(text: str | None) -> dict[str, Any]:
    """Parse ``k=v,k=v`` into a dict; values are Python literals (ints, floats, bools, None) or strings."""
    config: dict[str, Any] = {}
    if not text:
        return config
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ModelFileError(f"bad --config item {item!r}: expected key=value")
        key, raw = (s.strip() for s in item.split("=", 1))
        if not key.isidentifier():
            raise ModelFileError(f"bad --config key {key!r}: not an identifier")
        config[key] = _literal(raw)
    return config


def _literal(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


_UNEXPECTED_KW = re.compile(r"unexpected keyword argument '(\w+)'")


def build(module: ModuleType, config: dict[str, Any], ref: str = "model") -> nn.Module:
    """Call ``build_model(**config)``; an unknown key or a rejected value becomes a ``ModelFileError``."""
    try:
        model = module.build_model(**config)
    except TypeError as exc:
        m = _UNEXPECTED_KW.search(str(exc))
        if m:
            raise ModelFileError(f"{ref}: unknown config key {m.group(1)!r}") from exc
        raise ModelFileError(f"{ref}: build_model rejected the config: {exc}") from exc
    except (ValueError, AssertionError) as exc:
        raise ModelFileError(f"{ref}: build_model rejected the config: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{ref}: build_model returned {type(model).__name__}, not an nn.Module")
    return model


def infer_seq_len(model: nn.Module, config: dict[str, Any]) -> int:
    """The sequence length to trace with when the user gives none: the config's, the model's, or 2048."""
    if isinstance(config.get("seq_len"), int):
        return config["seq_len"]
    for owner in (getattr(model, "cfg", None), getattr(model, "config", None)):
        for key in ("seq_len", "max_position_embeddings", "n_positions"):
            value = getattr(owner, key, None)
            if isinstance(value, int):
                return value
    return DEFAULT_SEQ_LEN


def vocab_size(model: nn.Module, config: dict[str, Any]) -> int:
    """Vocabulary size for synthetic token ids: the config's ``vocab``, else the first embedding's rows."""
    if isinstance(config.get("vocab"), int):
        return config["vocab"]
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            return mod.num_embeddings
    return 2


def example_inputs(module: ModuleType, model: nn.Module, batch_size: int, seq_len: int,
                   config: dict[str, Any], generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """The model file's ``example_inputs`` or, by default, random token ids ``[batch, seq]``."""
    fn = getattr(module, "example_inputs", None)
    if fn is not None:
        inputs = fn(batch_size, seq_len, **config)
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    vocab = vocab_size(model, config)
    return (torch.randint(0, vocab, (batch_size, seq_len), generator=generator),)


def loss_fn_of(module: ModuleType) -> Callable[..., torch.Tensor]:
    """The model file's ``loss_fn`` or the default next-token cross-entropy."""
    return getattr(module, "loss_fn", None) or default_loss_fn
