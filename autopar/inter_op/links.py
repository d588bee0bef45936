"""The links of a layout's mesh axes, which every technique's communication is priced on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.cluster import AxisLink, Cluster, axis_link
from autopar.inter_op.layout import Layout


@functools.lru_cache(maxsize=4096)
def cached_axis_link(cluster: Cluster, size: int, stride: int) -> AxisLink:
    return axis_link(cluster, size, stride)


@dataclass(frozen=True, slots=True)
class Links:
    """The links of a layout's mesh axes (``autopar.cluster.axis_link``)."""

    dp: AxisLink  # dp x cp: the replicas of the dense weights
    cp: AxisLink
    tp: AxisLink
    ep: AxisLink  # an expert-parallel group: the innermost ``ep`` ranks of dp
    expert_dp: AxisLink  # the ``dp / ep`` replicas of the same experts


def layout_links(cluster: Cluster, layout: Layout) -> Links:
    """The links of ``layout``'s mesh axes: (pp, dp, cp, tp), where dp x cp is contiguous; the ep ranks are the
    innermost ``ep`` of dp (pp, dp / ep, ep, cp, tp), and cp > 1 never comes with ep > 1."""
    return Links(cached_axis_link(cluster, layout.replicas, layout.tp), cached_axis_link(cluster, layout.cp, layout.tp),
                  cached_axis_link(cluster, layout.tp, 1), cached_axis_link(cluster, layout.ep, layout.tp),
                  cached_axis_link(cluster, layout.expert_replicas, layout.tp * layout.ep))


__all__ = ["Links", "cached_axis_link", "layout_links"]
