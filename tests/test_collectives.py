"""The NCCL collective model: ring and tree steps, protocols by message size, NICs, pods, list copies."""

from __future__ import annotations

import pytest

from autopar.cluster import axis_link, load_cluster, mesh_links
from autopar.collectives import all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s, send_recv_s

A100 = load_cluster("a100-80gb").with_overrides(gpus=64)
INTRA_BW = 300e9 * 0.78  # NVLink x NCCL efficiency
NIC_BW = 25e9 * 0.85  # HDR x NCCL efficiency
LL, LL128, SIMPLE = 0, 1, 2
BASE, INTRA, INTER = A100.collective_base_latency_s, A100.intra_node_latency_s, A100.inter_node_latency_s
L = A100.kernel_gap_s
MB = 1e6


def test_ring_inside_a_node_at_a_large_size_is_simple_protocol():
    link = axis_link(A100, 8, 1)
    assert not link.crosses_nodes and link.bus_bandwidth_bytes_per_s == pytest.approx(INTRA_BW)
    # 2 (n - 1) NVLink steps of the Simple protocol, then the ring's bandwidth term
    expected = L + BASE[SIMPLE] + 2 * 7 * INTRA[SIMPLE] + 2 * 7 / 8 * 100 * MB / INTRA_BW
    assert all_reduce_s(100 * MB, link) == pytest.approx(expected)
    assert all_gather_s(100 * MB, link) == pytest.approx(L + BASE[SIMPLE] + 7 * INTRA[SIMPLE] + 7 / 8 * 100 * MB
                                                         / INTRA_BW)
    assert reduce_scatter_s(40 * MB, link) == all_gather_s(40 * MB, link)


def test_small_messages_take_the_low_latency_protocol():
    link = axis_link(A100, 8, 1)
    small = 4096
    expected_ll = L + BASE[LL] + 7 * INTRA[LL] + 7 / 8 * small / (INTRA_BW * A100.protocol_bandwidth_fraction[LL])
    assert all_gather_s(small, link) == pytest.approx(expected_ll)
    # achieved bus bandwidth grows with the message size towards the link's
    sizes = [1e3, 1e5, 1e7, 1e9]
    achieved = [7 / 8 * s / (all_gather_s(s, link) - L) for s in sizes]
    assert achieved == sorted(achieved) and achieved[-1] > 0.95 * INTRA_BW and achieved[0] < 0.01 * INTRA_BW


def test_a_ring_across_nodes_leaves_each_node_once():
    link = axis_link(A100, 16, 1)  # 2 nodes of 8: 15 steps, one of them across the network
    assert link.nodes == 2 and link.ranks_per_node == 8
    expected = L + BASE[SIMPLE] + 14 * INTRA[SIMPLE] + 1 * INTER[SIMPLE] + 15 / 16 * 1e9 / min(INTRA_BW, 8 * NIC_BW)
    assert all_gather_s(1e9, link) == pytest.approx(expected)


def test_ring_latency_grows_with_the_ranks():
    big = load_cluster("a100-80gb").with_overrides(gpus=2048)
    small, large = axis_link(big, 96, 1), axis_link(big, 1536, 1)
    t_small, t_large = all_gather_s(1e6, small), all_gather_s(1e6, large)
    assert t_large > 10 * t_small
    assert t_large > 1e-3  # thousands of ranks: milliseconds per collective, whatever its size


def test_tree_wins_for_small_all_reduce_on_many_nodes_ring_for_large():
    big = load_cluster("a100-80gb").with_overrides(gpus=1024)
    link = axis_link(big, 128, 8)  # one rank per node on 128 nodes
    n = 128

    def ring(nbytes, p):
        return (BASE[p] + 2 * (n - 1) * INTER[p]
                + 2 * (n - 1) / n * nbytes / (NIC_BW * A100.protocol_bandwidth_fraction[p]))

    small = 1e3
    assert all_reduce_s(small, link) < L + min(ring(small, p) for p in range(3))  # the tree is faster
    large = 1e10
    assert all_reduce_s(large, link) == pytest.approx(L + ring(large, SIMPLE))


def test_group_bandwidth_counts_the_nics_its_ranks_drive():
    assert axis_link(A100, 64, 1).bus_bandwidth_bytes_per_s == pytest.approx(min(INTRA_BW, 8 * NIC_BW))
    assert axis_link(A100, 16, 4).bus_bandwidth_bytes_per_s == pytest.approx(2 * NIC_BW)  # 2 ranks per node
    assert axis_link(A100, 8, 8).bus_bandwidth_bytes_per_s == pytest.approx(NIC_BW)  # dp across 8 nodes
    shared = A100.with_overrides(nics_per_node=2)  # 8 GPUs share 2 NICs
    assert axis_link(shared, 8, 8).bus_bandwidth_bytes_per_s == pytest.approx(NIC_BW / 4)
    assert axis_link(shared, 64, 1).bus_bandwidth_bytes_per_s == pytest.approx(2 * NIC_BW)


def test_pods_share_their_oversubscribed_uplinks():
    fabric = load_cluster("h100-80gb-roce").with_overrides(gpus=8192)
    nic = 50e9 * 0.85
    inside = axis_link(fabric, 64, 8)  # 64 nodes: one pod
    assert inside.pods == 1 and inside.bus_bandwidth_bytes_per_s == pytest.approx(nic)
    wide = axis_link(fabric, 64, 128)  # members 128 GPUs apart span 3 pods, ~21 members in each
    assert wide.pods == 3
    # each pod sends one ring channel per group out, over uplinks of 1/7 of its NICs: ample for rings
    assert wide.bus_bandwidth_bytes_per_s == pytest.approx(nic)
    sparse = axis_link(fabric, 2, 4096)  # one member in each of two pods: every group's ring crosses
    assert sparse.pods == 2 and sparse.bus_bandwidth_bytes_per_s == pytest.approx(nic / 7)
    # point to point across pods: every GPU sends at once, so it gets 1/7 of its NIC
    pp = axis_link(fabric, 16, 512)
    assert pp.pods > 1
    assert send_recv_s(1e9, pp) == pytest.approx(L + BASE[SIMPLE] + INTER[SIMPLE] + 1e9 / (nic / 7))


def test_list_collectives_copy_every_rank_out():
    link = axis_link(A100.with_overrides(gpus=512), 512, 1)
    plain, listed = all_gather_s(1e8, link), all_gather_s(1e8, link, copies_per_rank=True)
    assert listed - plain == pytest.approx(512 * L)


def test_all_to_all_and_send_recv():
    link = axis_link(A100, 4, 1)
    assert all_to_all_s(40 * MB, link) == pytest.approx(L + BASE[SIMPLE] + 3 * INTRA[SIMPLE] + 3 / 4 * 40 * MB
                                                        / INTRA_BW)
    across = axis_link(A100, 16, 1)  # half of the buffer leaves the node through each rank's own NIC
    assert all_to_all_s(16 * MB, across) == pytest.approx(L + BASE[SIMPLE] + 15 * INTER[SIMPLE] + 8 / 16 * 16 * MB
                                                          / NIC_BW)
    assert send_recv_s(10 * MB, axis_link(A100, 2, 1)) == pytest.approx(L + BASE[SIMPLE] + INTRA[SIMPLE]
                                                                        + 10 * MB / INTRA_BW)
    assert send_recv_s(10 * MB, axis_link(A100, 8, 8)) == pytest.approx(L + BASE[SIMPLE] + INTER[SIMPLE]
                                                                        + 10 * MB / NIC_BW)


def test_size_one_axis_is_free():
    link = axis_link(A100, 1, 1)
    assert all_reduce_s(1e9, link) == 0 and all_gather_s(1e9, link) == 0 and all_to_all_s(1e9, link) == 0


def test_mesh_links_row_major():
    pp, dp, tp = mesh_links(A100, (2, 4, 8))
    assert not tp.crosses_nodes and tp.size == 8
    assert dp.crosses_nodes and dp.ranks_per_node == 1
    assert pp.crosses_nodes
