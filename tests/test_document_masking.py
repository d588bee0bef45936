"""Document masking: attention within each packed document, in forward and in recomputation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from autopar import modelfile
from autopar.errors import AutoparError
from autopar.runtime.document_masking import DocumentMask, block_causal_mask
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.support import check_document_masking

LLAMA = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 128, "seq_len": 32}


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return modelfile.build(modelfile.load_module("llama"), LLAMA, "llama")


def test_the_mask_is_causal_within_each_document():
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0],
                                         [0, 0, 1, 0, 0],
                                         [0, 0, 1, 1, 0],
                                         [0, 0, 1, 1, 1]]


def test_a_packed_document_computes_what_it_computes_alone():
    """RoPE sees relative positions only, so under the mask the second of two packed documents gets the logits
    it gets alone; without the mask it attends to the first and does not."""
    model = _llama().eval()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * 12 + [1] * 20, [0] * 32])
    with torch.no_grad(), DocumentMask(documents):
        packed = model(ids)
    with torch.no_grad():
        first, second, whole = model(ids[:1, :12]), model(ids[:1, 12:]), model(ids)
    torch.testing.assert_close(packed[:1, :12], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:1, 12:], second, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[1:], whole[1:])  # one document: causal attention as it was
    assert not torch.allclose(whole[:1, 12:], second, atol=1e-3)


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_recomputation_runs_in_the_mask_its_forward_ran_in(mode):
    """The trainer leaves the mask when forward ends; checkpointed blocks recompute in it all the same."""
    model = _llama()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    documents = torch.tensor([[0] * 7 + [1] * 25, [0] * 20 + [1] * 12])

    def grads(m: torch.nn.Module, masked: bool = True) -> dict[str, torch.Tensor]:
        if masked:
            with DocumentMask(documents):
                out = m(ids)
        else:
            out = m(ids)
        F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    plain = grads(model)
    recomputed = copy.deepcopy(model)
    recomputed.zero_grad(set_to_none=True)
    apply_recompute(recomputed, "blocks", mode)
    again = grads(recomputed)
    for name, grad in plain.items():
        key = next(k for k in again if k.replace("._checkpoint_wrapped_module", "") == name)
        torch.testing.assert_close(again[key], grad, rtol=1e-5, atol=1e-6, msg=name)
    unmasked = grads(copy.deepcopy(model), masked=False)
    assert not torch.allclose(unmasked["blocks.0.attn.q.weight"], plain["blocks.0.attn.q.weight"])


def test_what_document_masking_cannot_run_is_one_line():
    q = torch.randn(1, 2, 4, 8)
    with DocumentMask(torch.zeros(1, 4, dtype=torch.long)), pytest.raises(AutoparError, match="its own attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with DocumentMask(torch.zeros(1, 8, dtype=torch.long)), pytest.raises(AutoparError, match="4 queries"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with pytest.raises(AutoparError, match="needs --data"):
        check_document_masking(None, 1, False)
    with pytest.raises(AutoparError, match="context parallelism"):
        check_document_masking("tokens.bin", 2, False)
    with pytest.raises(AutoparError, match="--no-compile"):
        check_document_masking("tokens.bin", 1, True)
