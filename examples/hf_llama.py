"""HuggingFace ``LlamaForCausalLM`` built from a config (no weights, no download), as an autopar model file.

Config keys: ``layers, hidden, heads, kv_heads, ffn, vocab, seq_len`` (defaults: a small Llama).
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM


def build_model(layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int | None = None,
                ffn: int = 688, vocab: int = 1024, seq_len: int = 256) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads, intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=seq_len, attn_implementation="sdpa", use_cache=False,
    )
    return LlamaForCausalLM(cfg)
