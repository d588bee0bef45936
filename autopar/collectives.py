r"""Alpha-beta cost model of NCCL-style collectives over one axis of a device mesh.

A logical mesh (e.g. ``(pp, dp, tp)``) maps onto ranks row-major, so the last axis has stride 1.  For an
axis of ``n`` ranks with stride ``st``, a group's members are ``st`` apart and ``k`` of them share a node
(``k = n`` when the whole group is inside one node).  The group runs on a ring whose slowest link decides:

- inside one node: bus bandwidth ``B = intra_bw * intra_eff``, per-step latency ``alpha = intra_latency``;
- across nodes: NCCL runs ``k`` rings in parallel, one per NIC of the group's ``k`` GPUs in a node, so the
  node boundary carries ``k * inter_bw * inter_eff``; ``B = min(intra_bw * intra_eff, k * inter_bw * inter_eff)``
  and ``alpha = inter_latency``.

With ``D`` the bytes of the full (unsharded) buffer on one rank:

=================  ===========================================================================
all-reduce         ring: ``2 (n-1) alpha + 2 (n-1)/n * D / B``;
                   tree: ``2 ceil(log2 n) alpha + 2 D / B``; NCCL picks the faster, so do we.
all-gather         ``(n-1) alpha + (n-1)/n * D / B``            (``D`` = gathered output size)
reduce-scatter     ``(n-1) alpha + (n-1)/n * D / B``            (``D`` = input size before scatter)
all-to-all         ``(n-1) alpha + max((k-1)/n * D / B_intra, (n-k)/n * D / B_nic)``: each rank
                   sends ``1/n`` of ``D`` to every peer; what leaves the node goes through its own NIC.
send/recv          ``alpha + D / B_link`` over the link between the two ranks.
=================  ===========================================================================

Every collective also pays a fixed ``launch`` cost (one kernel launch, the cluster's
``kernel_overhead_s``).  An axis of size 1 costs nothing.
"""

from __future__ import annotations

import math
from typing import Literal

from autopar.cluster import AxisLink, Cluster

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]


def all_reduce_s(nbytes: float, link: AxisLink) -> float:
    n = link.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    b, a = link.bus_bandwidth_bytes_per_s, link.latency_s
    ring = 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b
    tree = 2 * math.ceil(math.log2(n)) * a + 2 * nbytes / b
    return link.launch_s + min(ring, tree)


def all_gather_s(nbytes: float, link: AxisLink) -> float:
    """``nbytes``: size of the gathered (full) tensor on one rank."""
    n = link.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return link.launch_s + (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bus_bandwidth_bytes_per_s


def reduce_scatter_s(nbytes: float, link: AxisLink) -> float:
    """``nbytes``: size of the full (pre-scatter) tensor on one rank."""
    return all_gather_s(nbytes, link)


def all_to_all_s(nbytes: float, link: AxisLink) -> float:
    """``nbytes``: size of one rank's buffer, of which ``1/n`` goes to every peer."""
    n, k = link.size, link.ranks_per_node
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra = (k - 1) / n * nbytes / link.intra_bandwidth_bytes_per_s
    inter = (n - k) / n * nbytes / link.nic_bandwidth_bytes_per_s
    return link.launch_s + (n - 1) * link.latency_s + max(intra, inter)


def send_recv_s(nbytes: float, cluster: Cluster, across_nodes: bool) -> float:
    """Point-to-point transfer between two ranks (pipeline stages)."""
    if nbytes <= 0:
        return 0.0
    if across_nodes:
        bw = cluster.inter_node_bandwidth_bytes_per_s * cluster.inter_node_collective_efficiency
        return cluster.inter_node_latency_s + nbytes / bw
    bw = cluster.intra_node_bandwidth_bytes_per_s * cluster.intra_node_collective_efficiency
    return cluster.intra_node_latency_s + nbytes / bw


COLLECTIVES = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}


def collective_s(kind: Collective, nbytes: float, link: AxisLink) -> float:
    """Dispatch by collective name."""
    return COLLECTIVES[kind](nbytes, link)
