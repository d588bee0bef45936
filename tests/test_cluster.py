"""Cluster presets, TOML files and CLI overrides."""

from __future__ import annotations

import pytest

from autopar.cluster import PRESETS, cluster_from_args, load_cluster
from autopar.errors import ClusterSpecError


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load(name):
    c = load_cluster(name)
    assert c.name == name
    assert c.peak_flops > 0 and c.hbm_bytes > c.memory_reserve_bytes > 0
    assert 0 < c.gemm_efficiency <= 1


def test_a100_preset_matches_datasheet():
    c = load_cluster("a100-80gb")
    assert c.peak_flops == 312e12
    assert c.gpus_per_node == 8
    assert c.intra_node_bandwidth_bytes_per_s == 300e9
    assert c.inter_node_bandwidth_bytes_per_s == 25e9  # HDR 200 Gb/s per GPU
    h = load_cluster("h100-80gb")
    assert h.peak_flops == 989e12 and h.inter_node_bandwidth_bytes_per_s == 50e9  # NDR 400 Gb/s
    assert load_cluster("h200").hbm_bytes == 141e9


def test_toml_file_with_base(fixtures):
    c = load_cluster(str(fixtures / "small_cluster.toml"))
    assert c.name == "small_cluster" and c.gpus == 16 and c.num_nodes == 2
    assert c.inter_node_bandwidth_bytes_per_s == 12.5e9
    assert c.peak_flops == load_cluster("a100-80gb").peak_flops


def test_bad_toml_key_is_named(fixtures):
    with pytest.raises(ClusterSpecError, match="unknown key 'peak_flop'"):
        load_cluster(str(fixtures / "bad_key.toml"))


def test_unknown_preset():
    with pytest.raises(ClusterSpecError, match="unknown cluster 'b300'"):
        load_cluster("b300")


def test_invalid_toml(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("gpus = = 3\n")
    with pytest.raises(ClusterSpecError, match="invalid TOML"):
        load_cluster(str(p))


def test_cli_overrides():
    c = cluster_from_args("a100-80gb", gpus=64, gpus_per_node=4, inter_node_gbps=400)
    assert c.gpus == 64 and c.gpus_per_node == 4 and c.num_nodes == 16
    assert c.inter_node_bandwidth_bytes_per_s == 50e9
    assert cluster_from_args("a100-80gb", gpus=4).gpus_per_node == 4  # fewer GPUs than a node
    with pytest.raises(ClusterSpecError, match="multiple of gpus_per_node"):
        cluster_from_args("a100-80gb", gpus=12)


def test_new_presets_carry_their_fabric():
    small = load_cluster("a100-40gb")
    assert small.hbm_bytes == 40 * 2**30 and small.hbm_bandwidth_bytes_per_s == 1.555e12
    llama3 = load_cluster("h100-80gb-roce")
    assert llama3.inter_node_fabric == "roce" and llama3.pod_gpus == 3072 and llama3.pod_oversubscription == 7.0
    assert llama3.nics_per_node == 8 and llama3.inter_node_bandwidth_bytes_per_s == 50e9


def test_per_protocol_keys_and_fabric_are_validated(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('base = "a100-80gb"\ninter_node_latency_s = [1e-6, 2e-6]\n')
    with pytest.raises(ClusterSpecError, match="inter_node_latency_s must be a list of 3"):
        load_cluster(str(p))
    p.write_text('base = "a100-80gb"\ninter_node_fabric = "carrier pigeon"\n')
    with pytest.raises(ClusterSpecError, match="inter_node_fabric must be one of"):
        load_cluster(str(p))
    p.write_text('base = "a100-80gb"\npod_oversubscription = 0.5\n')
    with pytest.raises(ClusterSpecError, match="pod_oversubscription must be >= 1"):
        load_cluster(str(p))
    p.write_text('base = "a100-80gb"\ngemm_stores_after_main_loop = 1\n')
    with pytest.raises(ClusterSpecError, match="gemm_stores_after_main_loop must be true or false"):
        load_cluster(str(p))
    # the flag is the device's: a spec based on a preset keeps it, and Hopper's presets store beside the main loop
    p.write_text('base = "a100-80gb"\nname = "ours"\n')
    assert load_cluster(str(p)).gemm_stores_after_main_loop
    assert not load_cluster("h100-80gb").gemm_stores_after_main_loop


def test_a_plan_cluster_round_trips():
    from autopar.cluster import Cluster

    c = load_cluster("h100-80gb-roce").with_overrides(gpus=64)
    assert Cluster.from_dict(c.to_dict()) == c


def test_an_nvlink_domain_spans_nodes():
    from autopar.cluster import axis_link

    nvl72 = load_cluster("gb200-nvl72").with_overrides(gpus=144)
    assert nvl72.gpus_per_node == 4 and nvl72.nvlink_domain == 72
    inside, across = axis_link(nvl72, 64, 1), axis_link(nvl72, 2, 72)
    assert not inside.crosses_nodes and inside.nodes == 1  # 16 trays, one NVLink domain: NVLink bandwidth
    assert across.crosses_nodes and across.bus_bandwidth_bytes_per_s < inside.bus_bandwidth_bytes_per_s / 10
    # a DGX's domain is its node (the default, 0)
    dgx = load_cluster("a100-80gb").with_overrides(gpus=64)
    assert dgx.nvlink_domain_size == 0 and dgx.nvlink_domain == 8 and axis_link(dgx, 16, 1).nodes == 2
    assert load_cluster("gb200-nvl72").with_overrides(gpus=64).nvlink_domain == 64  # part of one rack


def test_nvlink_domains_are_whole_nodes_and_tile_the_cluster(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text('base = "a100-80gb"\nnvlink_domain_size = 12\n')
    with pytest.raises(ClusterSpecError, match="multiple of gpus_per_node"):
        load_cluster(str(bad))
    ragged = tmp_path / "r.toml"
    ragged.write_text('base = "gb200-nvl72"\ngpus = 100\n')
    with pytest.raises(ClusterSpecError, match="multiple of the NVLink domain"):
        load_cluster(str(ragged))


def test_a_job_that_does_not_fill_whole_racks_uses_the_same_part_of_each():
    """As Megatron-Bridge's launcher packs GB200 trays (Slurm segments: the largest divisor of the job's trays up
    to a rack's 18): 256 GPUs run as four racks of 64, 100 as five domains of 20, whole racks stay whole."""
    nvl72 = load_cluster("gb200-nvl72")
    assert nvl72.with_overrides(gpus=256).nvlink_domain == 64
    assert nvl72.with_overrides(gpus=100).nvlink_domain == 20
    assert nvl72.with_overrides(gpus=144).nvlink_domain == 72
    assert nvl72.with_overrides(gpus=8).nvlink_domain == 8
    assert load_cluster("h100-80gb").with_overrides(gpus=256).nvlink_domain == 8  # a DGX's domain is its node


def test_tp_is_searched_inside_a_domain_and_across_only_on_a_fast_network():
    from autopar.inter_op.tensor_parallel import tensor_parallel_degrees

    assert tensor_parallel_degrees(load_cluster("a100-80gb").with_overrides(gpus=64)) == [1, 2, 4, 8]
    assert tensor_parallel_degrees(load_cluster("gb200-nvl72").with_overrides(gpus=144))[-3:] == [24, 36, 72]
    fast = load_cluster("a100-80gb").with_overrides(gpus=64, inter_node_bandwidth_bytes_per_s=300e9)
    assert tensor_parallel_degrees(fast) == [1, 2, 4, 8, 16, 32, 64]
