"""What a technique gives the inter-op planner: the hooks of ``Technique``, and the types they read and write.

A technique (tensor parallelism, a pipeline schedule, recomputation, ZeRO, ...) lives in one module of
``autopar.inter_op``, which defines its rules and costs and one ``TECHNIQUE = Technique(...)`` naming its hooks;
``autopar.inter_op.techniques`` registers it.  The planner then reads every technique through these hooks:

- ``knobs`` and ``flags``: its layout knobs (``Knob``: what ``--fix`` may pin them to) and its framework flags.
- ``expand``: the search space.  Given a partial layout (the knobs of the techniques registered before it), the
  partial layouts with its own knobs set, as the cluster, the model, the framework and the pinned values
  (``SearchSpace``) allow.  Its validity rules are the ones ``check_fixed`` and the runtime use.
- ``check_fixed``: a one-line ``AutoparError`` for pinned values it cannot run.
- ``share`` and ``shares_at``: the unit costs as one of its ranks runs them, and the degree it splits them at
  (context and expert parallelism split a unit's work; 1: not applied).
- ``unit_step``: its part of one unit's load per micro-batch, written into a ``UnitLoadDraft``.
- ``time_bound_s`` and ``memory_bound_bytes``: its terms of the search's lower bounds (``autopar.inter_op.bound``),
  each never more than its part of the estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.framework import Framework
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.links import Links
from autopar.inter_op.unit_costs import UnitCost
from autopar.ir import OpGraph
from autopar.passes.context import PassContext

Partial = dict[str, Any]
"""A layout under construction: the knobs set so far, by ``Layout`` field name."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(space: SearchSpace, key: str) -> None:
    """A one-line ``AutoparError`` if the pinned mesh degree ``key`` does not divide the devices."""
    if key in space.fixed and space.gpus % space.fixed[key]:
        raise AutoparError(f"--fix {key}={space.fixed[key]} does not divide the {space.gpus} devices")


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What the techniques' options read: the cluster, the model's facts, the framework and the pinned values."""

    gpus: int
    layers: int
    global_batch: int
    seq_len: int
    heads: tuple[tuple[int, int], ...]  # (query heads, key/value heads) of every distinct attention op
    experts: int  # how many experts the model's expert modules hold (0: none to split)
    cluster: Cluster
    fw: Framework
    fixed: Mapping[str, Any]
    one_microbatch: bool = False
    """The loss compares the batch's samples (``autopar.gather_batch``): no gradient accumulation."""
    layer_loop: bool = False
    """The stack's loop hands a weight's output from layer to layer (``OpGraph.layer_loop_args``)."""

    def allowed(self, key: str, values: list[Any]) -> list[Any]:
        """``values``, or the pinned value alone."""
        return [self.fixed[key]] if key in self.fixed else values


@dataclass(slots=True)
class UnitLoadDraft:
    """One unit's load per micro-batch on one rank as the techniques fold it, each writing its part."""

    u: UnitCost
    is_layer: bool
    layout: Layout
    links: Links
    cluster: Cluster
    ctx: PassContext
    mode: str  # the unit's recomputation mode ("none" outside the layers)
    fwd_s: float  # each pass at the longer of the GPU's timeline and the host's issuing its ops ahead of it
    bwd_s: float
    compute_s: float
    extra_bytes: float  # alive only while the unit runs
    tp_s: float = 0.0
    tp_fwd_s: float = 0.0
    activation_bytes: float = 0.0
    recompute_s: float = 0.0
    cp_s: float = 0.0
    cp_fwd_s: float = 0.0
    ep_s: float = 0.0
    ep_fwd_s: float = 0.0
    state_bytes: float = 0.0
    zero3_exposed_s: float = 0.0
    gathered_bytes: float = 0.0
    weight_s: float = 0.0
    rerun_s: float = 0.0
    residue_bytes: float = 0.0

    @classmethod
    def start(cls, u: UnitCost, is_layer: bool, layout: Layout, links: Links, cluster: Cluster,
              ctx: PassContext) -> UnitLoadDraft:
        """The unit's own work, before any technique's part."""
        fwd, bwd = max(u.fwd_s, u.fwd_host_s), max(u.bwd_s, u.bwd_host_s)
        return cls(u, is_layer, layout, links, cluster, ctx, layout.recompute if is_layer else "none", fwd, bwd,
                   fwd + bwd, max(u.transient_bytes, u.forward_transient_bytes))


@dataclass(frozen=True, slots=True)
class UnitTotals:
    """Sums over the unit sequence (each unit as often as it occurs) of one micro-batch on one rank."""

    work_s: float  # forward and backward at the longer of the GPU and host timelines, unhidden tp communication
    recompute_s: float  # the layers' recomputation under the layout's mode
    tp_sync_s: float  # per iteration: gradients of parameters replicated on tp but computed split
    dense_params: float  # local parameters outside expert-parallel experts
    expert_params: float  # local parameters of expert-parallel experts (0 with ep = 1)
    activation_bytes: float  # saved for backward under the layout's recomputation mode
    tied_params: float  # local parameters ``pre`` and ``post`` share (tied embeddings)
    dense_frozen: float = 0.0  # of ``dense_params``, frozen ones (no gradient, no optimizer state)
    expert_frozen: float = 0.0  # of ``expert_params``, frozen ones
    tied_frozen: float = 0.0  # of ``tied_params``, frozen ones


@dataclass(frozen=True, slots=True)
class Technique:
    """One technique's hooks (see the module docstring); ``knobs``: the layout knobs its ``expand`` sets (a field of
    ``Layout``, or one of its ``options``), which ``--fix`` pins as they declare; ``flags``: the framework flags it
    reads beyond ``Framework``'s fields, (name, default) pairs (a profile sets them in the technique's TOML table,
    ``Framework.option`` reads them)."""

    name: str
    knobs: tuple[Knob, ...] = ()
    expand: Callable[[SearchSpace, Partial], Iterator[Partial]] | None = None
    check_fixed: Callable[[SearchSpace, OpGraph], None] | None = None
    share: Callable[[UnitCost, Layout, Cluster], UnitCost] | None = None
    shares_at: Callable[[Layout], int] | None = None  # the degree ``share`` splits at (1: ``share`` is not applied)
    unit_step: Callable[[UnitLoadDraft], None] | None = None
    time_bound_s: Callable[[UnitTotals, Layout, Links, Cluster, PassContext], float] | None = None
    memory_bound_bytes: Callable[[UnitTotals, Layout, PassContext], float] | None = None
    bound_reads: Callable[[Layout], tuple] | None = None
    """The layout fields ``time_bound_s`` reads beyond the totals and links: a search computes it once per them."""
    time_bound_floor_s: Callable[[UnitTotals, Layout, Links, Cluster, PassContext], float] | None = None
    """The least ``time_bound_s`` takes over every value of this technique's own knobs (the others as ``layout``
    has them).  The search bounds the layouts that differ only in the last registered technique's knobs with it, as
    one family, before it sets them; so no other technique's bound, nor the unit totals, may read those knobs."""
    flags: tuple[tuple[str, bool | int | float | str], ...] = ()

    def __post_init__(self) -> None:
        if (self.share is None) != (self.shares_at is None):
            raise ValueError(f"technique {self.name}: share and shares_at go together")


__all__ = ["Partial", "SearchSpace", "Technique", "UnitLoadDraft", "UnitTotals", "check_divides", "divisors"]
