"""HuggingFace ``GPT2LMHeadModel`` built from a config (no weights, no download), as an autopar model file.

Config keys: ``layers, hidden, heads, vocab, seq_len, dropout``.  The defaults are GPT-2 small's (124M: the
openai-community/gpt2 config.json's 12 layers, hidden 768, 12 heads, vocabulary 50257, 1024 positions; dropout
off for planning and verify); a tiny one is a ``--config`` away, e.g. ``layers=2,hidden=64,heads=4,vocab=256``.
"""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel


def build_model(layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 50257, seq_len: int = 1024,
                dropout: float = 0.0) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq_len,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation="sdpa", use_cache=False,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    return GPT2LMHeadModel(cfg)
