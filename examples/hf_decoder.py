"""Any of sixteen HuggingFace causal-LM architectures, built from a config of its kind (no weights, no download).

Config keys: ``arch`` (one of ``ARCHS``), ``layers, hidden, heads, kv_heads, ffn, vocab, seq_len`` and
``dropout`` (``None``: the architecture's own defaults, e.g. GPT-2's and OPT's 0.1).  ``kv_heads=None``
keeps the architecture's own attention: multi-head, except Falcon's multi-query (one key/value head).  The
mixture-of-experts ones (Mixtral, Qwen2-MoE) get 4 experts, 2 per token, in the grouped-matmul experts
implementation (HuggingFace's eager experts loop over ``nonzero()``, which ``torch.export`` cannot trace; its
batched-matmul one gathers every token's expert weights, which at full size moves terabytes per layer; the
grouped one is the dropless kernel real runs use, ``torch.nn.functional.grouped_mm``).
BLOOM and Gemma 2 run their eager attention (they have no SDPA path).

    autopar plan examples/hf_decoder.py --config arch=falcon,layers=2,hidden=64,heads=4 --cluster cpu --fix tp=2
"""

from __future__ import annotations

import inspect
from typing import Any

import transformers

#: The config keys of (layers, hidden size, heads, kv heads, ffn width, positions) of the Llama-like families.
_LLAMA_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "max_position_embeddings")
_ATTENTION_DROPOUT = ("attention_dropout",)
#: arch -> (the config keys of layers, hidden size, heads, kv heads, ffn width, positions; ``None``: the
#: architecture has no such key), and the config keys of its dropouts.  The arch is its ``model_type``.
ARCHS: dict[str, tuple[tuple[str | None, ...], tuple[str, ...]]] = {
    "gpt2": (("n_layer", "n_embd", "n_head", None, "n_inner", "n_positions"), ("resid_pdrop", "embd_pdrop",
                                                                               "attn_pdrop")),
    **{arch: (_LLAMA_KEYS, _ATTENTION_DROPOUT) for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                                                            "olmo2", "granite", "mixtral")},
    "phi3": (_LLAMA_KEYS, ("resid_pdrop", "embd_pdrop", "attention_dropout")),
    "falcon": (("num_hidden_layers", "hidden_size", "num_attention_heads", None, None, "max_position_embeddings"),
               ("hidden_dropout", "attention_dropout")),
    "opt": (("num_hidden_layers", "hidden_size", "num_attention_heads", None, "ffn_dim", "max_position_embeddings"),
            ("dropout", "attention_dropout")),
    "gpt_neox": (("num_hidden_layers", "hidden_size", "num_attention_heads", None, "intermediate_size",
                  "max_position_embeddings"), ("hidden_dropout", "attention_dropout")),
    "bloom": (("n_layer", "hidden_size", "n_head", None, None, None), ("hidden_dropout", "attention_dropout")),
    "qwen2_moe": ((*_LLAMA_KEYS[:4], "moe_intermediate_size", _LLAMA_KEYS[5]), _ATTENTION_DROPOUT),
}
#: What each architecture needs beyond the common keys, to stay small and traceable.
_EXTRA: dict[str, dict[str, Any]] = {
    "falcon": {"new_decoder_architecture": False, "multi_query": True, "alibi": False},
    "opt": {"word_embed_proj_dim": None},  # the hidden size (set below): no project_in / project_out
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": None,
                  "decoder_sparse_step": 1},
}


def build_model(arch: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int | None = None,
                ffn: int | None = None, vocab: int = 128, seq_len: int = 32,
                dropout: float | None = None) -> transformers.PreTrainedModel:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(sorted(ARCHS))}, got {arch!r}")
    keys, dropout_keys = ARCHS[arch]
    ffn = ffn or 4 * hidden
    values = (layers, hidden, heads, kv_heads or heads, ffn, seq_len)
    kwargs: dict[str, Any] = {k: v for k, v in zip(keys, values) if k is not None}
    kwargs.update(vocab_size=vocab, use_cache=False, tie_word_embeddings=arch in ("gpt2", "opt", "bloom"),
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)  # the defaults lie past a small vocab
    config_class = transformers.CONFIG_MAPPING[arch]
    if "head_dim" in inspect.signature(config_class.__init__).parameters:  # Gemma, Qwen3: not hidden / heads
        kwargs["head_dim"] = hidden // heads
    for key, value in _EXTRA.get(arch, {}).items():
        kwargs[key] = value if value is not None else (hidden if key == "word_embed_proj_dim" else ffn)
    if dropout is not None:
        kwargs.update({key: dropout for key in dropout_keys})
    config = config_class(**kwargs)
    config._attn_implementation = "eager" if arch in ("bloom", "gemma2") else "sdpa"  # they have no SDPA path
    if arch in ("mixtral", "qwen2_moe"):
        config._experts_implementation = "grouped_mm"
    return transformers.AutoModelForCausalLM.from_config(config)
