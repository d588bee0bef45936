"""Pipeline stages from a plan: this rank's copy of the model, pruned to its layers, and how it runs.

Stages are built the way torchtitan builds them: every rank builds the whole model on the meta device
(no memory), once per chunk it runs, and drops what the chunk does not own. Blocks outside the stage's
layer range leave the block stack (a ``ModuleList`` becomes a ``ModuleDict`` keyed by the original
indices, so parameter FQNs survive the split). Along the path to the stack, modules with parameters
registered before it (embeddings) stay on the first stage only, those after it (final norm, head) on the
last only; parameter-free modules (dropout, rotary tables) stay everywhere. With ``v`` virtual stages
the layers are cut into ``pp * v`` chunks dealt out round-robin (chunk ``j`` on pipeline rank ``j %
pp``), as Megatron-LM interleaves them.

How a stage runs:

- models of the zoo run their own ``forward``, which takes hidden states when the embedding is missing
  and skips a missing norm or head;
- HuggingFace decoders shaped like Llama (``model.embed_tokens/layers/norm/rotary_emb``, ``lm_head``:
  Llama, Mistral, Qwen2, ...) or GPT-2 (``transformer.wte/wpe/h/ln_f``, ``lm_head``) get a stage forward
  that does what the decoder's own ``forward`` does (positions, the model's own causal mask, rotary or
  learned position embeddings, the decoder layers) on the pieces the stage holds, and returns hidden
  states, or logits on the last stage.  Other HuggingFace architectures are refused with a clear error.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.plan_file import Plan


def layer_chunks(num_layers: int, pp: int, v: int) -> list[tuple[int, int]]:
    """Layer ranges of the ``pp * v`` chunks (as even as possible, earlier chunks one longer)."""
    n = pp * v
    base, extra = divmod(num_layers, n)
    out, start = [], 0
    for j in range(n):
        size = base + (1 if j < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def stage_layer_ranges(plan: Plan) -> list[tuple[int, int]]:
    """Layer range of every chunk, in pipeline order (the plan's stages when ``v == 1``)."""
    lay = plan.layout
    if lay["v"] == 1:
        return [tuple(s["layers"]) for s in plan.stages]
    if "chunks" in plan.schedule:
        return [tuple(c) for c in plan.schedule["chunks"]]
    return layer_chunks(plan.model["num_layers"], lay["pp"], lay["v"])


def is_huggingface(model: nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def _block_dict(stage: nn.Module, container: str) -> nn.ModuleDict:
    """The block stack as a ``ModuleDict`` keyed by layer index (a ``ModuleList`` is converted in place)."""
    blocks = stage.get_submodule(container)
    if isinstance(blocks, nn.ModuleList):
        owner, _, attr = container.rpartition(".")
        blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        setattr(stage.get_submodule(owner) if owner else stage, attr, blocks)
    if not isinstance(blocks, nn.ModuleDict):
        raise AutoparError(f"pipeline stages need the block stack {container!r} to be a ModuleDict or "
                           f"ModuleList; it is a {type(blocks).__name__}")
    return blocks


def _drop_ends(stage: nn.Module, container: str, first: bool, last: bool) -> None:
    """Remove the parameterized modules before the stack (unless first) and after it (unless last)."""
    parent = stage
    for name in container.split("."):
        names = [n for n, _ in parent.named_children()]
        i = names.index(name)
        for other in (names[:i] if not first else []) + (names[i + 1:] if not last else []):
            if next(getattr(parent, other).parameters(), None) is not None:
                setattr(parent, other, None)
        parent = getattr(parent, name)


#: HuggingFace decoder shapes autopar can split: the attribute holding the decoder, and what it must have.
HF_DECODERS = {
    "llama": ("model", ("embed_tokens", "layers", "norm", "rotary_emb")),  # Llama, Mistral, Qwen2, ...
    "gpt2": ("transformer", ("wte", "wpe", "drop", "h", "ln_f")),
}


def hf_decoder_kind(model: nn.Module) -> str | None:
    """``"llama"`` or ``"gpt2"`` for a HuggingFace decoder autopar can split, else ``None``."""
    if not is_huggingface(model):
        return None
    for kind, (base, needed) in HF_DECODERS.items():
        decoder = getattr(model, base, None)
        if decoder is not None and hasattr(model, "lm_head") and all(hasattr(decoder, n) for n in needed):
            return kind
    return None


def check_splittable(model: nn.Module) -> None:
    """Raise a clear error when autopar cannot run ``model`` as pipeline stages."""
    if is_huggingface(model) and hf_decoder_kind(model) is None:
        raise AutoparError(f"pipeline stages of HuggingFace {type(model).__name__} are not supported: autopar "
                           "splits decoders shaped like Llama (model.embed_tokens/layers/norm/rotary_emb, "
                           "lm_head) or GPT-2 (transformer.wte/wpe/h/ln_f, lm_head)")


def _hf_layer_masks(base: nn.Module, h: torch.Tensor, positions: torch.Tensor) -> dict[str, object]:
    """The decoder's attention masks by layer type, built by the model's own masking functions."""
    modeling = sys.modules[type(base).__module__]
    kwargs = {"config": base.config, "inputs_embeds": h, "attention_mask": None, "cache": None,
              "position_ids": positions}
    masks = {"full_attention": modeling.create_causal_mask(**kwargs)}
    if getattr(base.config, "sliding_window", None) is not None:
        masks["sliding_attention"] = modeling.create_sliding_window_causal_mask(**kwargs)
    return masks


def _hf_layer_type(config: object, index: int) -> str:
    """``full_attention`` or ``sliding_attention``: per layer where the config lists them (Qwen2), else one
    kind for all (Mistral slides whenever it has a window)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def hf_stage_forward(stage: nn.Module, kind: str, first: bool, last: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the decoder's own ``forward`` does, on the pieces the stage holds (hidden states in and out)."""
    base = stage.model if kind == "llama" else stage.transformer

    def forward(x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if kind == "llama":
            h = base.embed_tokens(x) if first else x
            masks = _hf_layer_masks(base, h, positions)
            rotary = base.rotary_emb(h, position_ids=positions)
            for index, layer in base.layers.items():
                mask = masks[_hf_layer_type(base.config, int(index))]
                h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            return stage.lm_head(base.norm(h)) if last else h
        h = base.drop(base.wte(x) + base.wpe(positions)) if first else x  # GPT-2
        mask = _hf_layer_masks(base, h, positions)["full_attention"]
        for layer in base.h.values():
            h = layer(h, None, mask, position_ids=positions)
        return stage.lm_head(base.ln_f(h)) if last else h

    return forward


def prune(model: nn.Module, lo: int, hi: int, first: bool, last: bool, container: str) -> nn.Module:
    """``model`` itself, cut down to the layers ``[lo, hi)`` (plus the embeddings when ``first``, the head
    when ``last``); HuggingFace decoders get a stage forward."""
    check_splittable(model)
    blocks = _block_dict(model, container)
    for key in list(blocks.keys()):
        if not lo <= int(key) < hi:
            del blocks[key]
    _drop_ends(model, container, first, last)
    kind = hf_decoder_kind(model)
    if kind is not None:
        model.forward = hf_stage_forward(model, kind, first, last)
    return model


def prune_to_stage(model: nn.Module, plan: Plan, chunk: int) -> nn.Module:
    """A pruned deep copy of ``model`` for chunk ``chunk`` of the plan (for inspecting the stages of a model
    at hand; the runtime builds each chunk afresh on the meta device, ``autopar.runtime.parallelize.apply_pp``)."""
    lo, hi = stage_layer_ranges(plan)[chunk]
    last = len(stage_layer_ranges(plan)) - 1
    return prune(copy.deepcopy(model), lo, hi, chunk == 0, chunk == last, plan.model["layer_container"])
