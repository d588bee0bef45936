r"""Cost of NCCL collectives over one axis of a device mesh, after NCCL's own model (``src/graph/tuning.cc``).

A mesh axis is an ``AxisLink`` (``autopar.cluster.axis_link``): ``n`` ranks, ``k`` of them per node on
``N`` nodes, the ring's bus bandwidth ``B`` (NICs in parallel and pod uplinks included) and the fabric's
per-protocol latencies.  NCCL prices every (algorithm, protocol) pair as ``latency + bytes / bandwidth``
and runs the cheapest; so does this module:

- **protocols** LL, LL128 and Simple: a fixed ``base`` latency, a latency per ring or tree step over NVLink
  (``intra``) and over the network (``inter``), and a share of ``B`` (LL spends half its bytes on flags).
  Small messages take LL, large ones Simple: efficiency grows with the message size.
- **ring**: all-gather and reduce-scatter take ``n - 1`` steps, ``N - 1`` of them across nodes (the ring
  enters and leaves each node once: the intra-then-inter hierarchy of NCCL's rings); all-reduce twice
  that.  Bandwidth term ``(n-1)/n * D / B`` (twice for all-reduce).  Latency grows with ``n``: at
  thousands of ranks one collective costs milliseconds whatever its size.
- **tree** (all-reduce across nodes): a chain inside each node and a double binary tree across nodes,
  ``2 ((k - 1) intra + log2(N) inter)`` steps of latency and ``2 D / (tree_fraction * B)``.

===============  ================================================================================
all-reduce       min over protocols of ring and (across nodes) tree
all-gather       ring; ``D`` = gathered output on one rank
reduce-scatter   ring; ``D`` = input before the scatter
all-to-all       ``(n - 1)`` steps of latency; ``(k-1)/n`` of ``D`` over NVLink and ``(n-k)/n`` through
                 the rank's own NIC share, whichever is slower
send/recv        one step of latency plus ``D`` over the link between the two ranks
===============  ================================================================================

Every collective also pays a fixed ``launch`` cost (one kernel launch).  An axis of size 1 costs nothing.
``copies_per_rank`` adds one copy kernel per rank, which ``torch.distributed``'s list-of-tensors
collectives issue (they gather into a flat buffer and copy every rank's part out).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from autopar.cluster import PROTOCOLS, AxisLink

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]

SIMPLE = PROTOCOLS.index("Simple")  # the per-protocol link values are in PROTOCOLS order


def _ring_s(nbytes: float, link: AxisLink, rounds: int) -> float:
    """``rounds`` passes of a ring (1: all-gather / reduce-scatter, 2: all-reduce), cheapest protocol."""
    n = link.size
    steps, inter = rounds * (n - 1), rounds * (link.nodes - 1)
    volume = rounds * (n - 1) / n * nbytes
    return min(link.base_latency_s[p] + (steps - inter) * link.intra_latency_s[p] + inter * link.inter_latency_s[p]
               + volume / (link.bus_bandwidth_bytes_per_s * link.protocol_fraction[p]) for p in range(len(PROTOCOLS)))


def _tree_s(nbytes: float, link: AxisLink) -> float:
    """NCCL's tree all-reduce (double binary tree across nodes, a chain inside each), cheapest protocol.  The
    step latencies are the ring's: NCCL's own tree values are equal for Simple, which large messages use."""
    intra_hops, inter_hops = 2 * (link.ranks_per_node - 1), 2 * math.ceil(math.log2(link.nodes))
    bw = link.bus_bandwidth_bytes_per_s * link.tree_fraction
    return min(link.base_latency_s[p] + intra_hops * link.intra_latency_s[p] + inter_hops * link.inter_latency_s[p]
               + 2 * nbytes / (bw * link.protocol_fraction[p]) for p in range(len(PROTOCOLS)))


def all_reduce_s(nbytes: float, link: AxisLink) -> float:
    if link.size <= 1 or nbytes <= 0:
        return 0.0
    t = _ring_s(nbytes, link, 2)
    if link.nodes > 1:
        t = min(t, _tree_s(nbytes, link))
    return link.launch_s + t


def all_gather_s(nbytes: float, link: AxisLink, copies_per_rank: bool = False) -> float:
    """``nbytes``: size of the gathered (full) tensor on one rank."""
    if link.size <= 1 or nbytes <= 0:
        return 0.0
    copies = link.size * link.launch_s if copies_per_rank else 0.0
    return link.launch_s + _ring_s(nbytes, link, 1) + copies


def reduce_scatter_s(nbytes: float, link: AxisLink, copies_per_rank: bool = False) -> float:
    """``nbytes``: size of the full (pre-scatter) tensor on one rank."""
    return all_gather_s(nbytes, link, copies_per_rank)


def all_to_all_s(nbytes: float, link: AxisLink) -> float:
    """``nbytes``: size of one rank's buffer, of which ``1/n`` goes to every peer."""
    n, k = link.size, link.ranks_per_node
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra = (k - 1) / n * nbytes / link.intra_bandwidth_bytes_per_s
    inter = (n - k) / n * nbytes / link.nic_bandwidth_bytes_per_s
    steps = (n - 1) * (link.inter_latency_s[SIMPLE] if link.crosses_nodes else link.intra_latency_s[SIMPLE])
    return link.launch_s + link.base_latency_s[SIMPLE] + steps + max(intra, inter)


def send_recv_s(nbytes: float, link: AxisLink) -> float:
    """Point-to-point transfer between neighbours on ``link`` (pipeline stages).  Every pair of the axis sends
    at once, so a transfer that leaves the node gets the rank's NIC share (and pod uplink share)."""
    if nbytes <= 0:
        return 0.0
    if link.crosses_nodes:
        return link.launch_s + link.base_latency_s[SIMPLE] + link.inter_latency_s[SIMPLE] + \
            nbytes / link.nic_bandwidth_bytes_per_s
    return link.launch_s + link.base_latency_s[SIMPLE] + link.intra_latency_s[SIMPLE] + \
        nbytes / link.intra_bandwidth_bytes_per_s


def bucketed_s(collective: Callable[[float, AxisLink], float], nbytes: float, link: AxisLink,
               bucket_bytes: float) -> tuple[float, float]:
    """``nbytes`` sent as buckets of at most ``bucket_bytes``, one collective each (DDP's and ZeRO's gradient
    buckets): the total time, and the time of the last bucket alone."""
    if nbytes <= 0 or link.size <= 1:
        return 0.0, 0.0
    buckets = max(1, math.ceil(nbytes / bucket_bytes))
    one = collective(nbytes / buckets, link)
    return buckets * one, one


def bucket_share_s(collective: Callable[[float, AxisLink], float], nbytes: float, link: AxisLink,
                   bucket_bytes: float) -> float:
    """One tensor's share of a bucketed collective (``bucketed_s``): its bytes, plus the bucket's latency pro rata
    (what the intra-op ILP charges each parameter, not knowing which others share its bucket)."""
    latency = collective(1.0, link)
    return collective(nbytes, link) - latency + latency * min(1.0, nbytes / bucket_bytes)


COLLECTIVES = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}


def collective_s(kind: Collective, nbytes: float, link: AxisLink) -> float:
    """Dispatch by collective name."""
    return COLLECTIVES[kind](nbytes, link)
