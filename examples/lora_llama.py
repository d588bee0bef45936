"""LoRA fine-tuning of a HuggingFace ``LlamaForCausalLM`` built from a config (no weights, no download), as an
autopar model file.  Needs the ``peft`` extra (``pip install -c constraints.txt -e '.[peft]'``).

The base model is frozen (``requires_grad=False``): autopar prices it as 16-bit weights with no gradients and no
optimizer state, and the runtime holds it so; only the adapters train.  The batches are padded: every other
sample's last quarter is padding, masked in attention (``attention_mask``) and in the loss.  Context parallelism
cannot apply a padding mask to the keys of other ranks, so its layouts are refused.

Config keys: ``layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rank, targets``.  The defaults are Llama 3
8B's (meta-llama/Meta-Llama-3-8B config.json) with rank-16 adapters on the attention projections; a tiny one is a
``--config`` away, e.g. ``layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq_len=32,rank=8``.
``full=True`` builds the same model with every parameter trainable (and no adapters), to compare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

ATTENTION_PROJECTIONS = "q_proj,k_proj,v_proj,o_proj"


def build_model(layers: int = 32, hidden: int = 4096, heads: int = 32, kv_heads: int = 8, ffn: int = 14336,
                vocab: int = 128256, seq_len: int = 8192, rank: int = 16, targets: str = ATTENTION_PROJECTIONS,
                full: bool = False) -> nn.Module:
    """``targets``: the Linears (by name, comma-separated) that get adapters."""
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                      max_position_embeddings=seq_len, rope_theta=500000.0, attn_implementation="sdpa",
                      use_cache=False)
    model = LlamaForCausalLM(cfg)
    if full:
        return model
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets.split(","))
    return get_peft_model(model, lora)


def example_inputs(batch_size: int, seq_len: int, vocab: int = 128256, **_: object) -> dict[str, torch.Tensor]:
    """Token ids and a padding mask: every other sample ends in a quarter of padding."""
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[::2, seq_len - seq_len // 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def loss_fn(output: object, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the tokens that are not padding, summed and divided by every target position
    (padding included): the same for every split of the batch into ranks and micro-batches.  (A mean over the
    micro-batch's own unpadded tokens would weigh a micro-batch with more padding more.)"""
    logits = output.logits[:, :-1].float()  # type: ignore[attr-defined]
    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return total / labels.numel()
