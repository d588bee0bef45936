"""Models from a HuggingFace ``config.json``: ``autopar plan hf:PATH`` (the file, or a folder holding one).

The model is the class the config's ``architectures`` names (``LlamaForCausalLM``, ``BertForMaskedLM``, ...),
else ``AutoModelForCausalLM``, built from the config alone: no weights, no download.  ``--config KEY=VALUE``
overrides the config's own keys (``num_hidden_layers=2`` for a small one).  The inputs and the loss follow
the head's task, as HuggingFace trains it:

- a causal LM (``...ForCausalLM``, ``...LMHeadModel``): token ids, next-token cross-entropy;
- a masked LM (``...ForMaskedLM``): ids with 15 % of the tokens replaced by the mask token, cross-entropy on
  those (summed, over the expected count, so that every split of the batch averages alike);
- an encoder-decoder (``...ForConditionalGeneration`` of an ``is_encoder_decoder`` config): ``input_ids`` and
  ``decoder_input_ids`` by keyword, cross-entropy on the decoder's next tokens;
- an image classifier (``...ForImageClassification``): ``pixel_values`` and ``labels``, cross-entropy.

A model file can give its own inputs and loss instead (``examples/hf_decoder.py`` shows the form).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autopar.errors import ModelFileError

PREFIX = "hf:"
MASKED_FRACTION = 0.15  # BERT's


def is_hf_ref(ref: str) -> bool:
    return ref.startswith(PREFIX)


def config_file(ref: str) -> Path:
    """The ``config.json`` an ``hf:`` reference names (a file, or a folder holding ``config.json``)."""
    path = Path(ref.removeprefix(PREFIX)).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{ref}: no config.json there (give hf:PATH/config.json or a folder holding one)")
    return path.resolve()


def locate(ref: str) -> str:
    """``ref`` as any process can load it: ``hf:`` and the config's absolute path."""
    return PREFIX + str(config_file(ref))


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: not a readable config.json ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelFileError(f"{path}: a HuggingFace config.json names its model_type; this one does not")
    return config


def _task(architecture: str | None, config: dict[str, Any]) -> str:
    if architecture is None or architecture.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if architecture.endswith("ForMaskedLM"):
        return "masked"
    if architecture.endswith("ForConditionalGeneration") and config.get("is_encoder_decoder"):
        return "seq2seq"
    if architecture.endswith("ForImageClassification"):
        return "image"
    raise ModelFileError(f"autopar has no default inputs and loss for {architecture}: give a model file with "
                         "build_model, example_inputs and loss_fn (see examples/hf_decoder.py)")


def hf_module(ref: str) -> ModuleType:
    """A model-file module for the ``config.json`` ``ref`` names: ``build_model``, and the task's
    ``example_inputs`` and ``loss_fn`` where they are not the defaults."""
    import transformers

    path = config_file(ref)
    raw = _read(path)
    architectures = raw.get("architectures") or [None]
    architecture = architectures[0]
    model_class = getattr(transformers, architecture, None) if architecture else transformers.AutoModelForCausalLM
    if model_class is None:
        raise ModelFileError(f"{path} names architecture {architecture}, which transformers "
                             f"{transformers.__version__} does not have")
    task = _task(architecture, raw)
    module = ModuleType("autopar_hf_" + hashlib.sha1(str(path).encode()).hexdigest()[:10])
    module.__file__ = str(path)
    module.__doc__ = f"{architecture or 'AutoModelForCausalLM'} from {path}"

    def build_model(**overrides: Any) -> nn.Module:
        overrides.pop("seq_len", None)  # the sequence is the trace's; positions are the config's
        values = dict(raw)
        model_type = values.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **values)
        for key, value in overrides.items():
            if not hasattr(config, key):
                raise TypeError(f"build_model() got an unexpected keyword argument '{key}'")
            setattr(config, key, value)
        build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
        try:
            return build(config, attn_implementation="sdpa")
        except ValueError:  # an architecture without an SDPA path (BLOOM, Gemma 2) runs its eager attention
            return build(config, attn_implementation="eager")

    module.build_model = build_model
    vocab = raw.get("vocab_size")
    if task == "masked":
        module.example_inputs = lambda batch_size, seq_len, **config: _masked_inputs(
            batch_size, seq_len, config.get("vocab_size", vocab), raw.get("mask_token_id"))
        module.loss_fn = _masked_loss
    elif task == "seq2seq":
        module.example_inputs = lambda batch_size, seq_len, **config: {
            "input_ids": torch.randint(0, config.get("vocab_size", vocab), (batch_size, seq_len)),
            "decoder_input_ids": torch.randint(0, config.get("vocab_size", vocab), (batch_size, seq_len))}
        module.loss_fn = _seq2seq_loss
    elif task == "image":
        module.example_inputs = lambda batch_size, seq_len, **config: _image_inputs(batch_size, {**raw, **config})
        module.loss_fn = _image_loss
    return module


def _masked_inputs(batch_size: int, seq_len: int, vocab: int, mask_id: int | None) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    masked = torch.rand(batch_size, seq_len) < MASKED_FRACTION
    labels = ids.masked_fill(~masked, -100)
    return {"input_ids": ids.masked_fill(masked, vocab - 1 if mask_id is None else mask_id), "labels": labels}


def _masked_loss(output: Any, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> torch.Tensor:
    """Cross-entropy on the masked tokens, over the number expected (``MASKED_FRACTION`` of the tokens) rather
    than the number drawn: the same mean whichever way the batch is split into ranks and micro-batches."""
    total = F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return total / (labels.numel() * MASKED_FRACTION)


def _seq2seq_loss(output: Any, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                  **_: Any) -> torch.Tensor:
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1).float(), decoder_input_ids[:, 1:].flatten())


def _image_inputs(batch_size: int, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    size = config.get("image_size", 224)
    classes = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    return {"pixel_values": torch.randn(batch_size, config.get("num_channels", 3), size, size),
            "labels": torch.randint(0, classes, (batch_size,))}


def _image_loss(output: Any, pixel_values: torch.Tensor, labels: torch.Tensor, **_: Any) -> torch.Tensor:
    return F.cross_entropy(output.logits.float(), labels)


__all__ = ["PREFIX", "config_file", "hf_module", "is_hf_ref", "locate"]
