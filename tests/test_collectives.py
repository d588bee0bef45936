"""Collective cost model against hand-computed alpha-beta values."""

from __future__ import annotations

import pytest

from autopar.cluster import axis_link, load_cluster, mesh_links
from autopar.collectives import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    reduce_scatter_s,
    send_recv_s,
)

A100 = load_cluster("a100-80gb").with_overrides(gpus=64)
INTRA_BW = 300e9 * 0.78  # NVLink x NCCL efficiency
NIC_BW = 25e9 * 0.85  # HDR x NCCL efficiency
MB = 1e6
L = 4e-6  # launch cost of one collective (kernel_overhead_s)


def test_axis_inside_a_node():
    link = axis_link(A100, 8, 1)
    assert not link.crosses_nodes
    assert link.bus_bandwidth_bytes_per_s == pytest.approx(INTRA_BW)
    # ring: 2*7*2us + 2*7/8*100MB/234GB/s
    expected = L + 2 * 7 * 2e-6 + 2 * 7 / 8 * 100 * MB / INTRA_BW
    assert all_reduce_s(100 * MB, link) == pytest.approx(expected)


def test_axis_across_nodes_one_rank_per_node():
    link = axis_link(A100, 8, 8)  # dp over 8 nodes, tp=8 inside
    assert link.crosses_nodes and link.ranks_per_node == 1
    assert link.bus_bandwidth_bytes_per_s == pytest.approx(NIC_BW)
    expected_ring = L + 2 * 7 * 6e-6 + 2 * 7 / 8 * 1000 * MB / NIC_BW
    assert all_reduce_s(1000 * MB, link) == pytest.approx(expected_ring)


def test_axis_across_nodes_uses_all_nics_of_the_group():
    link = axis_link(A100, 64, 1)  # all 64 GPUs: 8 per node, 8 NICs per node
    assert link.ranks_per_node == 8
    assert link.bus_bandwidth_bytes_per_s == pytest.approx(min(INTRA_BW, 8 * NIC_BW))
    partial = axis_link(A100, 16, 4)  # 2 ranks per node
    assert partial.ranks_per_node == 2
    assert partial.bus_bandwidth_bytes_per_s == pytest.approx(2 * NIC_BW)


def test_tree_wins_for_small_messages_on_large_groups():
    link = axis_link(A100.with_overrides(gpus=1024), 128, 8)
    n, a, b = 128, 6e-6, NIC_BW
    small = 1e3
    ring = 2 * (n - 1) * a + 2 * (n - 1) / n * small / b
    tree = 2 * 7 * a + 2 * small / b
    assert tree < ring
    assert all_reduce_s(small, link) == pytest.approx(L + tree)


def test_gather_scatter_and_all_to_all():
    link = axis_link(A100, 4, 1)
    assert all_gather_s(40 * MB, link) == pytest.approx(L + 3 * 2e-6 + 3 / 4 * 40 * MB / INTRA_BW)
    assert reduce_scatter_s(40 * MB, link) == all_gather_s(40 * MB, link)
    # all-to-all inside a node: 3/4 of the buffer leaves each rank over NVLink
    assert all_to_all_s(40 * MB, link) == pytest.approx(L + 3 * 2e-6 + 3 / 4 * 40 * MB / INTRA_BW)
    across = axis_link(A100, 16, 1)  # 8 ranks per node, 2 nodes
    # half of the buffer leaves the node through each rank's own NIC
    assert all_to_all_s(16 * MB, across) == pytest.approx(L + 15 * 6e-6 + 8 / 16 * 16 * MB / NIC_BW)


def test_size_one_axis_is_free():
    link = axis_link(A100, 1, 1)
    assert all_reduce_s(1e9, link) == 0 and all_gather_s(1e9, link) == 0 and all_to_all_s(1e9, link) == 0


def test_send_recv():
    assert send_recv_s(10 * MB, A100, across_nodes=False) == pytest.approx(2e-6 + 10 * MB / INTRA_BW)
    assert send_recv_s(10 * MB, A100, across_nodes=True) == pytest.approx(6e-6 + 10 * MB / NIC_BW)


def test_mesh_links_row_major():
    pp, dp, tp = mesh_links(A100, (2, 4, 8))
    assert not tp.crosses_nodes and tp.size == 8
    assert dp.crosses_nodes and dp.ranks_per_node == 1
    assert pp.crosses_nodes
