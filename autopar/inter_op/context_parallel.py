"""Context parallelism on top of unit costs: what one of ``cp`` ranks sharing a sequence does and holds.

The runtime (``autopar.runtime.context_parallel``) cuts every sample's sequence into ``2 * cp`` chunks and
gives rank ``i`` chunks ``i`` and ``2 * cp - 1 - i``, so that under a causal mask every rank has the same
share of the attention scores.  Every op but attention is token-wise, so a rank's compute, its
tensor-parallel traffic and its activations are ``1 / cp`` of the whole sequence's; attention gathers the
keys and values of the whole sequence (an all-gather over ``cp`` in forward, a reduce-scatter of their
gradients in backward, neither overlapped: the variant Llama 3 trained with, Dubey et al. 2024, sec. 3.3.2)
and computes ``1 / cp`` of the scores with them.  Attention saves the gathered keys and values for its
backward.  Parameters are whole on every cp rank.

Kernel launches are divided along with the compute they sit in: a rank's share of a long sequence is still
thousands of tokens, where the launches are a small part of every op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from autopar.cluster import AxisLink, Cluster
from autopar.collectives import all_gather_s, reduce_scatter_s
from autopar.errors import AutoparError
from autopar.framework import Framework
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.recompute import recompute_regathers
from autopar.inter_op.technique import Partial, SearchSpace, Technique, UnitLoadDraft, check_divides, divisors
from autopar.inter_op.unit_costs import UnitCost
from autopar.ir import OpGraph

#: Fields of ``UnitCost`` proportional to the tokens one rank processes.
_PER_TOKEN = (
    "fwd_s", "bwd_s", "tp_fwd_s", "tp_bwd_s", "activation_bytes", "input_bytes", "attention_fwd_s",
    "attention_saved_bytes", "fwd_flops", "attention_fwd_flops", "attention_module_recompute_s",
    "attention_module_saved_bytes", "attention_module_recompute_flops", "full_recompute_s", "full_recompute_flops",
    "op_recompute_s", "op_saved_bytes", "op_recompute_flops", "transient_bytes", "forward_transient_bytes",
    "after_backward_bytes",
    "bwd_weight_s", "weight_grad_residue_bytes", "product_s", "attention_s", "fp8_cast_s",
)


#: What the runtime runs for ``cp > 1`` and this module prices, as a plan states it (``Plan.context_parallel``):
#: per device kind, the attention kernel (``autopar.runtime.context_parallel.ContextParallelAttention``).
RUNTIME_PATH: dict[str, Any] = {
    "sequence": "2 * cp chunks; rank i holds chunks i and 2 cp - 1 - i (the same causal work on every rank)",
    "keys_values": "all-gathered over cp in forward (not overlapped); their gradients reduce-scattered in backward",
    "attention": {
        "cuda": "per query chunk, FlashAttention's causal kernel aligned to the chunk's end (16-bit; masked "
                "blocks skipped)",
        "other": "per query chunk, SDPA with the causal mask made explicit (what `autopar verify` runs on CPU)",
    },
}


def context_parallel_share(u: UnitCost, cp: int) -> UnitCost:
    """Unit ``u`` (costed on the whole sequence) as one of ``cp`` context-parallel ranks runs it.

    ``attention_kv_bytes`` stays the whole sequence's (what the all-gather makes); the gathered keys and
    values beyond the rank's own share are saved by attention for backward and made inside the attention
    module: selective recomputation frees them, and so does per-op checkpointing, whose policy recomputes
    every op but the products and attention (the all-gather among them)."""
    if cp <= 1:
        return u
    changes = {name: getattr(u, name) / cp for name in _PER_TOKEN}
    gathered = u.attention_kv_bytes * (cp - 1) / cp
    changes["activation_bytes"] += gathered
    changes["attention_module_saved_bytes"] += gathered
    changes["tp_fwd_bytes"] = {k: b / cp for k, b in u.tp_fwd_bytes.items()}
    changes["tp_bwd_bytes"] = {k: b / cp for k, b in u.tp_bwd_bytes.items()}
    return dataclasses.replace(u, **changes)


#: A bound on the search space, not physics: context parallelism is offered unpinned only while every rank
#: keeps this many tokens of a sample.  Below it a rank's GEMMs shrink toward sizes where kernels lose
#: efficiency and per-op launches stop being small, which the cp model (dividing the costed work by cp)
#: does not see.  A pinned cp may go below it.
MIN_CP_TOKENS = 1024


def context_parallel_refuses(cp: int, seq_len: int) -> str | None:
    """Why ``cp`` ranks cannot share a sample of ``seq_len`` tokens, or ``None``: the runtime cuts the sequence
    into ``2 * cp`` equal chunks (rank ``i`` takes chunks ``i`` and ``2 cp - 1 - i``)."""
    if cp > 1 and seq_len % (2 * cp):
        return f"cp={cp} needs the sequence ({seq_len} tokens) to split into 2 * cp = {2 * cp} equal chunks"
    return None


def context_parallel_options(degrees: list[int], seq_len: int, fw: Framework) -> list[int]:
    """The cp degrees the search offers unpinned among ``degrees``: 1, and where the framework has context
    parallelism those that run (``context_parallel_refuses``) keeping ``MIN_CP_TOKENS`` tokens per rank."""
    if not fw.context_parallel:
        return [1]
    return [1] + [d for d in degrees if d > 1 and context_parallel_refuses(d, seq_len) is None
                  and seq_len // d >= MIN_CP_TOKENS]

def kv_exchange_s(u: UnitCost, cp_link: AxisLink) -> tuple[float, float]:
    """The all-gather of ``u``'s keys and values over the ``cp`` ranks (its forward's part) and, with the
    reduce-scatter of their gradients, the whole exchange per micro-batch (not overlapped, as the runtime runs
    them); zero with one rank."""
    fwd = all_gather_s(u.attention_kv_bytes, cp_link)
    return fwd, fwd + reduce_scatter_s(u.attention_kv_bytes, cp_link)


def _expand(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    ranks = space.gpus // p["tp"]  # what tp leaves for cp x pp x dp
    options = context_parallel_options(divisors(space.gpus), space.seq_len, space.fw)
    for cp in space.allowed("cp", options):
        if ranks % cp == 0:  # a pinned cp too
            yield {**p, "cp": cp}


def _check_fixed(space: SearchSpace, graph: OpGraph) -> None:
    check_divides(space, "cp")
    if (why := context_parallel_refuses(space.fixed.get("cp", 1), space.seq_len)) is not None:
        raise AutoparError(f"--fix {why}")


def _share(u: UnitCost, layout: Layout, cluster: Cluster) -> UnitCost:
    return context_parallel_share(u, layout.cp)


def _unit_step(d: UnitLoadDraft) -> None:
    d.cp_fwd_s, d.cp_s = kv_exchange_s(d.u, d.links.cp)
    if recompute_regathers(d.mode, d.ctx.framework):
        d.recompute_s += d.cp_fwd_s


TECHNIQUE = Technique("context_parallel", (Knob("cp"),), expand=_expand, check_fixed=_check_fixed, share=_share,
                      shares_at=lambda layout: layout.cp, unit_step=_unit_step)

__all__ = ["MIN_CP_TOKENS", "RUNTIME_PATH", "TECHNIQUE", "context_parallel_options", "context_parallel_refuses",
           "context_parallel_share", "kv_exchange_s"]
