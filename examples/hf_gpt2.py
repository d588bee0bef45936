"""HuggingFace ``GPT2LMHeadModel`` built from a config (no weights, no download), as an autopar model file.

Config keys: ``layers, hidden, heads, vocab, seq_len, dropout`` (defaults: a small GPT-2).
"""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel


def build_model(layers: int = 4, hidden: int = 256, heads: int = 8, vocab: int = 1024, seq_len: int = 256,
                dropout: float = 0.0) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq_len,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation="sdpa", use_cache=False,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    return GPT2LMHeadModel(cfg)
