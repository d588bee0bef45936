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
    with pytest.raises(ClusterSpecError, match="unknown cluster 'b200'"):
        load_cluster("b200")


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
