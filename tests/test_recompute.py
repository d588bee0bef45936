"""Activation checkpointing in the runtime: per-op checkpointing recomputes what the cost model prices."""

from __future__ import annotations

from pathlib import Path

import torch
from autopar.models import gpt
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.recompute import apply_recompute

PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _CountProducts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS:
            self.products += 1
        return func(*args, **(kwargs or {}))


def _run(mode: str) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = gpt.build_model(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
    apply_recompute(model, "blocks", mode)
    ids = torch.randint(0, 64, (2, 16))
    counter = _CountProducts()
    with counter:
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return counter.products, grads


def test_op_checkpointing_recomputes_every_second_product():
    none, g_none = _run("none")
    full, g_full = _run("full")
    op, g_op = _run("op")
    per_layer = 6  # q, k, v, o, fc, proj: the forward products of one block
    # non-reentrant checkpointing stops once backward has its tensors: the last product (proj), whose output
    # nothing saves, is never re-run
    assert full - none == 2 * (per_layer - 1)
    assert op - none == 2 * 2  # op: k and o, the products whose outputs were not kept (proj: early stop)
    for name, g in g_none.items():
        assert torch.allclose(g_op[name], g, atol=1e-6) and torch.allclose(g_full[name], g, atol=1e-6), name


def test_selective_checkpoints_the_attention_module():
    model = gpt.build_model(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
    apply_recompute(model, "blocks", "selective")
    assert all("CheckpointWrapper" in type(b.attn).__name__ for b in model.blocks.values())
    assert not any("CheckpointWrapper" in type(b).__name__ for b in model.blocks.values())


def test_an_encoder_decoder_recomputes_its_decoder_layers_as_they_ran():
    """HuggingFace encoder-decoders cache their cross-attention's keys and values on the first call when their KV
    cache is on (their default), so a recomputed decoder layer would skip those projections and checkpointing would
    fail on the count of saved tensors; models are built for training, without the cache, and both modes give the
    gradients of no recomputation."""
    from autopar import modelfile

    module = modelfile.load_module(str(Path(__file__).resolve().parents[1] / "examples" / "hf_models.py"))
    inputs = {"input_ids": torch.randint(2, 128, (2, 8)), "decoder_input_ids": torch.randint(2, 128, (2, 8))}
    grads = {}
    for mode in ("none", "full", "op"):
        torch.manual_seed(0)
        model = modelfile.build(module, {"arch": "bart", "layers": 2, "seq_len": 8})
        assert all(not m.config.use_cache for m in model.modules() if hasattr(m, "config"))
        apply_recompute(model, "model.decoder.layers", mode)
        module.loss_fn(model(**inputs), **inputs).backward()
        grads[mode] = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        assert torch.allclose(grads["full"][name], g, atol=1e-6) and torch.allclose(grads["op"][name], g, atol=1e-6)
