"""HuggingFace models beyond decoder LMs, each built from a small config of its own kind (no weights, no
download), with the inputs and the loss it trains on, as one autopar model file.

``arch=``:

- ``bert``, ``roberta``: masked-LM encoders; 15 % of the tokens masked, cross-entropy on those.
- ``t5``, ``bart``: encoder-decoders; the encoder reads ``input_ids``, the decoder ``decoder_input_ids``,
  cross-entropy on the decoder's next tokens.
- ``vit``: an image classifier on ``pixel_values`` (patch embedding, blocks, head); cross-entropy on labels.
- ``clip``: a vision and a text tower trained contrastively (the symmetric InfoNCE loss over the whole batch:
  ``autopar.gather_batch`` gathers the data-parallel ranks' embeddings, so each step runs one micro-batch).
- ``whisper``: a speech encoder-decoder on log-mel ``input_features`` (two 1-d convolutions, then blocks).
- ``mamba``: a state-space LM (a causal 1-d convolution and a selective scan), next-token cross-entropy.

Config keys: ``arch, layers, hidden, heads, vocab, seq_len, ffn`` (``seq_len``: tokens for the text models, mel
frames over 2 for Whisper; the images are ``image`` pixels square in ``patch`` patches; ``ffn``: the MLP's width,
2 x hidden by default).  Every model computes in the
default eager kernels HuggingFace picks for it.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from torch.nn import functional as F

import autopar

ARCHS = ("bert", "roberta", "t5", "bart", "vit", "clip", "whisper", "mamba")
MASK_FRACTION = 0.15
MASK_ID = 1  # the token the masked positions read (a real tokenizer's [MASK])


def build_model(arch: str = "bert", layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128,
                seq_len: int = 32, image: int = 32, patch: int = 8, classes: int = 10,
                ffn: int | None = None) -> nn.Module:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, not {arch!r}")
    ffn = ffn or 2 * hidden
    if arch in ("bert", "roberta"):
        cls = transformers.BertConfig if arch == "bert" else transformers.RobertaConfig
        cfg = cls(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=ffn, max_position_embeddings=seq_len + 2, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, pad_token_id=0)
        model_cls = transformers.BertForMaskedLM if arch == "bert" else transformers.RobertaForMaskedLM
        return model_cls(cfg)
    if arch == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=ffn, num_layers=layers,
            num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    if arch == "bart":
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
            max_position_embeddings=seq_len, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            pad_token_id=0, decoder_start_token_id=2))
    if arch == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
            image_size=image, patch_size=patch, num_labels=classes))
    if arch == "clip":
        text = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
                "num_attention_heads": heads, "intermediate_size": ffn, "max_position_embeddings": seq_len}
        vision = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "intermediate_size": ffn, "image_size": image, "patch_size": patch}
        return ContrastiveCLIP(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=hidden))
    if arch == "whisper":
        return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
            vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
            num_mel_bins=16, max_source_positions=seq_len, max_target_positions=seq_len, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=0,
            begin_suppress_tokens=None, suppress_tokens=None))
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab, state_size=16, intermediate_size=ffn,
        use_cache=False))


class ContrastiveCLIP(transformers.CLIPModel):
    """CLIP returning what its contrastive loss compares, as OpenCLIP's model does: the normalized image and text
    embeddings and the temperature ``exp(logit_scale)``.  The loss scores them across the whole batch."""

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = super().forward(input_ids=input_ids, pixel_values=pixel_values)
        return out.image_embeds, out.text_embeds, self.logit_scale.exp()


def example_inputs(batch_size: int, seq_len: int, arch: str = "bert", vocab: int = 128, image: int = 32,
                   classes: int = 10, **_: object) -> object:
    ids = torch.randint(2, vocab, (batch_size, seq_len))
    if arch in ("bert", "roberta"):
        masked = torch.rand(batch_size, seq_len) < MASK_FRACTION
        return {"input_ids": ids.masked_fill(masked, MASK_ID), "labels": ids.masked_fill(~masked, -100)}
    if arch in ("t5", "bart"):
        return {"input_ids": ids, "decoder_input_ids": torch.randint(2, vocab, (batch_size, seq_len))}
    if arch == "vit":
        return {"pixel_values": torch.randn(batch_size, 3, image, image),
                "labels": torch.randint(0, classes, (batch_size,))}
    if arch == "clip":
        return {"input_ids": ids, "pixel_values": torch.randn(batch_size, 3, image, image)}
    if arch == "whisper":
        return {"input_features": torch.randn(batch_size, 16, 2 * seq_len),
                "decoder_input_ids": torch.randint(2, vocab, (batch_size, seq_len))}
    return ids


def loss_fn(output: object, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    """The loss of each kind on the model's own output (its ``ModelOutput``), given the inputs as it got them."""
    if "labels" in kwargs and kwargs.get("input_ids") is not None:  # masked LM: the masked positions only,
        # summed over the count expected rather than drawn: the same mean however the batch is split
        logits, labels = output.logits.float(), kwargs["labels"]  # type: ignore[attr-defined]
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return total / (labels.numel() * MASK_FRACTION)
    if "labels" in kwargs:  # image classification
        return F.cross_entropy(output.logits.float(), kwargs["labels"])  # type: ignore[attr-defined]
    if "decoder_input_ids" in kwargs:  # encoder-decoder: the decoder's next tokens
        logits = output.logits[:, :-1].float()  # type: ignore[attr-defined]
        return F.cross_entropy(logits.flatten(0, 1), kwargs["decoder_input_ids"][:, 1:].flatten())
    if "pixel_values" in kwargs:  # CLIP: each image against each caption of the whole batch, both ways
        image, text, scale = output  # type: ignore[misc]
        image, text = autopar.gather_batch(image.float()), autopar.gather_batch(text.float())
        logits = scale.float() * image @ text.t()
        target = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
    logits = output.logits[:, :-1].float()  # type: ignore[attr-defined]
    return F.cross_entropy(logits.flatten(0, 1), args[0][:, 1:].flatten())
