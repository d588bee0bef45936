"""The model-file convention: what ``autopar plan MODEL`` loads.

A model file defines

- ``build_model(**config) -> nn.Module`` (required);
- ``example_inputs(batch_size, seq_len, **config)`` (optional; default: one LongTensor of token ids
  ``[batch, seq]``): a tensor, a tuple of them (positional), a dict (keyword) or an ``(args, kwargs)`` pair
  (``autopar.inputs.ModelInputs``);
- ``loss_fn(output, *args, **kwargs) -> Tensor`` (optional; default: next-token cross-entropy on the
  logits, also when the output is a HuggingFace ``ModelOutput``), given the inputs as the model gets them;
- ``batches(dp_rank, dp_size, batch_size, seq_len, **config)`` (optional): training data for generated
  scripts, an iterator of inputs of the same forms (``autopar.runtime.data``).

The model may define ``init_parameter(name, tensor)`` to initialize one parameter in place
(``autopar.runtime.materialize``).

``MODEL`` is a path to such a file or the name of a zoo model (``gpt``, ``llama``, ``mlp``, ``moe``), or
``SOURCE:FACTORY``: a module-level class or function of a file (``path/model.py:GPT``) or of an importable
module (``mypkg.models:build``) that builds the model from the config, in place of ``build_model``.  The
source's optional functions (``example_inputs``, ``loss_fn``, ...) apply to it as well.
"""

from __future__ import annotations

import ast
import contextvars
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

from autopar import hf_config
from autopar.errors import ModelFileError
from autopar.hf_masks import is_transformers_object
from autopar.inputs import ModelInputs
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


_QUALNAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
#: The functions of a model file that a ``SOURCE:FACTORY`` model takes from its source.
HOOKS = ("example_inputs", "loss_fn", "batches", "init_parameter")


def split_ref(ref: str) -> tuple[str, str | None]:
    """``SOURCE:FACTORY`` -> (``SOURCE``, ``FACTORY``); a plain file or zoo name -> (``ref``, ``None``)."""
    source, sep, factory = ref.rpartition(":")
    if sep and source and _QUALNAME.match(factory) and not (len(source) == 1 and source.isalpha()):
        return source, factory
    return ref, None


def factory_ref(factory: Callable[..., Any]) -> str:
    """The reference of a module-level class or function, which every rank re-imports: ``module:QUALNAME`` for
    one of a package (its relative imports need the package), else ``FILE:QUALNAME`` (a script or a top-level
    file, which a rank need not find on its import path)."""
    qualname = getattr(factory, "__qualname__", None)
    name = getattr(factory, "__module__", None) or ""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname or module is None:
        raise ModelFileError(f"{qualname or factory!r}: a model factory must be a class or function defined at the "
                             "top level of a Python file, so that every rank can import it by name")
    if getattr(module, "__package__", None) and name != "__main__":
        return f"{name}:{qualname}"
    if not path:
        raise ModelFileError(f"{qualname}: its module {name} has no file to import it from")
    return f"{Path(path).resolve()}:{qualname}"


#: Set while autopar itself builds a model (tracing, the runtime's meta builds): a class under
#: ``@autopar.parallelize`` then constructs as the plain class, even inside torchrun.
BUILDING: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_building", default=False)


def resolve(ref: str) -> Path:
    """The file behind a zoo name or a path (an ``hf:`` reference: its config.json); raises ``ModelFileError``
    when there is none."""
    if hf_config.is_hf_ref(ref):
        return hf_config.config_file(ref)
    ref = split_ref(ref)[0]
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


def locate(ref: str) -> str:
    """``ref`` as any process can load it: a zoo model's file, an absolute file path (with its ``:FACTORY``),
    or an importable ``module:FACTORY`` as given, or ``hf:`` and a config.json's absolute path."""
    if hf_config.is_hf_ref(ref):
        return hf_config.locate(ref)
    source, factory = split_ref(ref)
    if factory is not None and not (source.endswith(".py") or Path(source).is_file()):
        return ref
    path = str(resolve(source).resolve())
    return f"{path}:{factory}" if factory else path


def load_module(ref: str, example_inputs: str | None = None) -> ModuleType:
    """Import the model file (by path, under a private module name) or the zoo module; for ``SOURCE:FACTORY``,
    a module whose ``build_model`` is the factory, beside the source's own optional functions.
    ``example_inputs``: a ``SOURCE:FUNCTION`` that replaces the model's ``example_inputs``.  ``hf:PATH``: the
    model a HuggingFace config.json describes (``autopar.hf_config``)."""
    source, factory = split_ref(ref)
    if hf_config.is_hf_ref(ref):
        module = hf_config.hf_module(ref)
    elif factory is not None:
        module = _factory_module(ref, source, factory)
    elif ref in ZOO:
        module = importlib.import_module(f"autopar.models.{ref}")
    else:
        module = _import_file(ref, require_build_model=True)
    if example_inputs is None:
        return module
    view = ModuleType(f"{module.__name__}+example_inputs")
    view.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    view.example_inputs = load_callable(example_inputs)  # type: ignore[attr-defined]
    return view


def load_for(model: dict[str, Any]) -> ModuleType:
    """The module of a plan's ``model`` entry (its ``path`` or ``ref``, and its ``example_inputs``)."""
    return load_module(model.get("path") or model["ref"], model.get("example_inputs"))


def load_callable(ref: str) -> Callable[..., Any]:
    """The class or function a ``SOURCE:NAME`` reference names."""
    source, name = split_ref(ref)
    if name is None:
        raise ModelFileError(f"{ref}: expected SOURCE:NAME (a file or module, and a name defined in it)")
    return _factory_module(ref, source, name).build_model


def _factory_module(ref: str, source: str, factory: str) -> ModuleType:
    if source.endswith(".py") or Path(source).is_file():
        module = _import_file(source, require_build_model=False)
    else:
        try:
            module = importlib.import_module(source)
        except Exception as exc:
            raise ModelFileError(f"{ref}: cannot import module {source!r}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in factory.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ModelFileError(f"{ref}: {source} defines no {factory}")
    obj = getattr(obj, "__autopar_factory__", obj)  # a class under @autopar.parallelize builds as itself
    if not callable(obj):
        raise ModelFileError(f"{ref}: {factory} is not a class or function")
    view = ModuleType(f"{module.__name__}:{factory}")
    view.build_model = obj  # type: ignore[attr-defined]
    for hook in HOOKS:
        if callable(getattr(module, hook, None)):
            setattr(view, hook, getattr(module, hook))
    return view


def _import_file(ref: str, require_build_model: bool) -> ModuleType:
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
    if require_build_model and not callable(getattr(module, "build_model", None)):
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
    token = BUILDING.set(True)
    try:
        model = module.build_model(**config)
    except TypeError as exc:
        m = _UNEXPECTED_KW.search(str(exc))
        if m:
            raise ModelFileError(f"{ref}: unknown config key {m.group(1)!r}") from exc
        raise ModelFileError(f"{ref}: build_model rejected the config: {exc}") from exc
    except (ValueError, AssertionError) as exc:
        raise ModelFileError(f"{ref}: build_model rejected the config: {exc}") from exc
    except Exception as exc:
        raise ModelFileError(f"{ref}: build_model raised {type(exc).__name__}: {exc}") from exc
    finally:
        BUILDING.reset(token)
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{ref}: build_model returned {type(model).__name__}, not an nn.Module")
    _train_without_kv_cache(model)
    return model


def _train_without_kv_cache(model: nn.Module) -> None:
    """Turn off the key/value cache of every HuggingFace model inside ``model``: training has no use for it, and
    activation checkpointing breaks on it (an encoder-decoder caches its cross-attention's keys and values on the
    first call, so a recomputed layer skips their projections and saves fewer tensors than its forward did).
    HuggingFace's own gradient checkpointing sets ``use_cache=False`` for the same reason."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and is_transformers_object(config):  # a PretrainedConfig
            config.use_cache = False


def infer_seq_len(model: nn.Module, config: dict[str, Any]) -> int:
    """The sequence length to trace with when the user gives none: the config's, the model's, or 2048."""
    declared = declared_seq_len(model, config)
    return DEFAULT_SEQ_LEN if declared is None else declared


def declared_seq_len(model: nn.Module, config: dict[str, Any]) -> int | None:
    """The sequence length the config or the model states (``seq_len``, ``max_position_embeddings``,
    ``n_positions``), if any."""
    if isinstance(config.get("seq_len"), int):
        return config["seq_len"]
    for owner in (getattr(model, "cfg", None), getattr(model, "config", None)):
        for key in ("seq_len", "max_position_embeddings", "n_positions"):
            value = getattr(owner, key, None)
            if isinstance(value, int):
                return value
    return None


def vocab_size(model: nn.Module, config: dict[str, Any]) -> int:
    """Vocabulary size for synthetic token ids: the config's ``vocab``, else the first embedding's rows."""
    if isinstance(config.get("vocab"), int):
        return config["vocab"]
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            return mod.num_embeddings
    return 2


def example_inputs(module: ModuleType, model: nn.Module, batch_size: int, seq_len: int,
                   config: dict[str, Any], generator: torch.Generator | None = None) -> ModelInputs:
    """The model file's ``example_inputs`` or, by default, random token ids ``[batch, seq]``."""
    fn = getattr(module, "example_inputs", None)
    if fn is not None:
        rest = {k: v for k, v in config.items() if k != "seq_len"}  # seq_len is passed by position
        try:
            inputs = fn(batch_size, seq_len, **rest)
        except Exception as exc:
            raise ModelFileError(f"example_inputs(batch_size={batch_size}, seq_len={seq_len}, **config) raised "
                                 f"{type(exc).__name__}: {exc}") from exc
        return ModelInputs.of(inputs)
    vocab = vocab_size(model, config)
    return ModelInputs((torch.randint(0, vocab, (batch_size, seq_len), generator=generator),))


def loss_fn_of(module: ModuleType) -> Callable[..., torch.Tensor]:
    """The model file's ``loss_fn`` or the default next-token cross-entropy."""
    return getattr(module, "loss_fn", None) or default_loss_fn
