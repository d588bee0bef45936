"""Recomputation (activation checkpointing): what each mode re-runs and keeps, per layer, as a framework runs it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from autopar.framework import Framework
from autopar.inter_op.layout import RECOMPUTE, Knob
from autopar.inter_op.technique import Partial, SearchSpace, Technique, UnitLoadDraft
from autopar.inter_op.unit_costs import UnitCost


@dataclass(frozen=True, slots=True)
class LayerRecompute:
    """What a recomputation mode does to one layer, per micro-batch."""

    time_s: float  # forward re-run in backward (with its tensor-parallel collectives for ``full``)
    flops: float  # hardware FLOPs of that re-run
    saved_bytes: float  # activations kept from forward to backward
    transient_bytes: float  # alive only while the layer's recomputation and backward run


def layer_recompute(u: UnitCost, mode: str, fw: Framework) -> LayerRecompute:
    """``mode`` (none/selective/op/full) on layer ``u``, as ``fw`` runs it."""
    # transient: what the recomputation re-creates beside what the layer kept (its checkpointed input, the
    # products per-op checkpointing saves), as for ``selective``
    if mode == "full":
        return LayerRecompute(u.full_recompute_s + u.tp_fwd_s, u.full_recompute_flops, u.input_bytes,
                              max(0.0, u.activation_bytes - u.input_bytes))
    if mode == "selective" and fw.selective_recompute == "attention_module":
        return LayerRecompute(u.attention_module_recompute_s, u.attention_module_recompute_flops,
                              u.activation_bytes - u.attention_module_saved_bytes, u.attention_module_saved_bytes)
    if mode == "selective":
        return LayerRecompute(u.attention_fwd_s, u.attention_fwd_flops, u.activation_bytes - u.attention_saved_bytes,
                              0.0)
    if mode == "op":
        kept = min(u.op_saved_bytes, u.activation_bytes)
        return LayerRecompute(u.op_recompute_s, u.op_recompute_flops, kept, u.activation_bytes - kept)
    return LayerRecompute(0.0, 0.0, u.activation_bytes, 0.0)


def recompute_regathers(mode: str, fw: Framework) -> bool:
    """Whether recomputation ``mode`` re-runs context parallelism's key/value all-gather: full recomputation
    and a checkpointed attention module re-run everything in it, and per-op checkpointing re-runs every op
    but the products and attention (``autopar.runtime.recompute``), the all-gather among them."""
    return mode in ("full", "op") or (mode == "selective" and fw.selective_recompute == "attention_module")

def unit_recompute(u: UnitCost, mode: str, fw: Framework) -> tuple[float, float, float]:
    """``mode`` on unit ``u`` as a stage runs it: the bytes it keeps from forward to backward, the time its
    recomputation takes (at least the host's re-issuing of the recomputed ops), and what is alive only while the
    recomputation and backward run."""
    rc = layer_recompute(u, mode, fw)
    recompute = rc.time_s
    if u.fwd_s > 0:  # re-issuing the recomputed ops on the host
        recompute = max(recompute, u.fwd_host_s * min(1.0, rc.time_s / u.fwd_s))
    return rc.saved_bytes, recompute, rc.transient_bytes


def _expand(space: SearchSpace, p: Partial) -> Iterator[Partial]:
    for mode in space.allowed("recompute", list(RECOMPUTE)):
        yield {**p, "recompute": mode}


def _unit_step(d: UnitLoadDraft) -> None:
    d.activation_bytes, d.recompute_s, transient = unit_recompute(d.u, d.mode, d.ctx.framework)
    d.extra_bytes = max(d.extra_bytes, transient)


TECHNIQUE = Technique("recompute", (Knob("recompute", "choice", choices=RECOMPUTE),), expand=_expand,
                      unit_step=_unit_step)

__all__ = ["TECHNIQUE", "LayerRecompute", "layer_recompute", "recompute_regathers", "unit_recompute"]
