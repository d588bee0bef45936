"""HuggingFace ``LlamaForCausalLM`` built from a config (no weights, no download), as an autopar model file.

Config keys: ``layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rope_theta``.  The defaults are Llama 3
8B's (meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 query and 8 key/value heads, SwiGLU
14336, vocabulary 128256, 8192 positions, RoPE theta 500000); a tiny one is a ``--config`` away, e.g.
``layers=2,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=256,seq_len=32``.
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM


def build_model(layers: int = 32, hidden: int = 4096, heads: int = 32, kv_heads: int | None = 8,
                ffn: int = 14336, vocab: int = 128256, seq_len: int = 8192,
                rope_theta: float = 500000.0) -> LlamaForCausalLM:
    """``kv_heads=None``: one key/value head per query head (multi-head attention)."""
    cfg = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads, intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=seq_len, rope_theta=rope_theta, attn_implementation="sdpa", use_cache=False,
    )
    return LlamaForCausalLM(cfg)
