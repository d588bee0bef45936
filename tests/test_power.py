"""The clock under the power cap (autopar.power) and what a collective beside compute costs it
(autopar.interference)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import axis_link, load_cluster
from autopar.interference import comm_sms, compute_rate, overlapped_s
from autopar.power import PowerMix, clock_fraction, comm_demand, memory_demand, product_demand, tensor_demand

H100 = load_cluster("h100-80gb").with_overrides(gpus=16)
A100 = load_cluster("a100-80gb").with_overrides(gpus=16)
NVLINK = axis_link(H100, 8, 1)
NETWORK = axis_link(H100, 2, 8)  # two nodes: one rank per node


def _products(seconds: float = 1.0, fp8: bool = False) -> PowerMix:
    return PowerMix(seconds, seconds * product_demand(H100, fp8), 0.0)


def test_dense_16bit_products_hold_the_loaded_clock_and_fp8_ones_the_boost_clock():
    # DeepGEMM#120: products at the cap hold 1575 MHz; its FP8 products held 1980 MHz alone
    assert clock_fraction(H100, _products()) * H100.boost_clock_hz == pytest.approx(H100.loaded_clock_hz, rel=1e-6)
    assert clock_fraction(H100, _products(fp8=True)) == 1.0
    # ... and fall to the loaded clock beside a collective at the full NVLink rate
    full = H100.intra_node_bandwidth_bytes_per_s * H100.intra_node_collective_efficiency
    assert clock_fraction(H100, _products(fp8=True), full) * H100.boost_clock_hz == pytest.approx(H100.loaded_clock_hz,
                                                                                                  rel=1e-6)


def test_a_device_capped_lower_draws_the_same_watts_and_holds_a_lower_clock(tmp_path):
    # Grand Teton's H100s run at 500 W: the chip draws at each clock what it draws at 700 W, so the smaller budget
    # holds products at loaded x (430 / 630)^(1/3) (the f^3 rule), FP8 products below the boost clock, and the
    # watts a collective and memory-bound kernels draw are unchanged
    capped = H100.with_overrides(power_cap_w=500.0)
    ratio = (500.0 - H100.idle_power_w) / (700.0 - H100.idle_power_w)

    def clock_hz(cluster, fp8=False, comm=0.0):
        return clock_fraction(cluster, PowerMix(1.0, product_demand(cluster, fp8), 0.0), comm) * cluster.boost_clock_hz

    assert clock_hz(capped) == pytest.approx(H100.loaded_clock_hz * ratio ** (1 / 3), rel=1e-6)
    assert clock_hz(capped, fp8=True) == pytest.approx(H100.boost_clock_hz * ratio ** (1 / 3), rel=1e-6)
    full = H100.intra_node_bandwidth_bytes_per_s * H100.intra_node_collective_efficiency
    for cluster in (H100, capped):  # the collective's watts: what drops FP8 products to the loaded clock at 700 W
        watts = comm_demand(cluster, full) * (cluster.power_cap_w - cluster.idle_power_w)
        assert watts == pytest.approx((1 - (H100.loaded_clock_hz / H100.boost_clock_hz) ** 3) * 630.0)
    assert memory_demand(capped) * 430.0 == pytest.approx(memory_demand(H100) * 630.0)
    # a spec file based on the preset at a lower cap is the same device capped: it keeps the observed cap
    (tmp_path / "capped.toml").write_text('base = "h100-80gb"\nname = "h100-500w"\npower_cap_w = 500\n')
    from_file = load_cluster(str(tmp_path / "capped.toml"))
    assert from_file.loaded_clock_power_w == 700 and clock_hz(from_file) == pytest.approx(clock_hz(capped))


def test_memory_bound_work_beside_products_lifts_their_clock():
    alone = clock_fraction(H100, _products())
    memory = memory_demand(H100)
    assert 0 < memory < 1  # a memory-bound H200 draws 300 W of its 700 W
    mixed = clock_fraction(H100, _products() + PowerMix(0.0, 0.0, 1.0))
    assert alone < mixed < 1.0
    # the window's average power is at the cap: products' draw at the clock, the memory-bound kernels' own
    tensor_time = 1.0 / mixed
    average = (tensor_time * product_demand(H100) * mixed ** 3 + 1.0 * memory) / (tensor_time + 1.0)
    assert average == pytest.approx(1.0, rel=1e-6)
    # little tensor-core work under much memory traffic stays at the boost clock
    assert clock_fraction(H100, _products(0.1) + PowerMix(0.0, 0.0, 1.0)) == 1.0


def test_attention_draws_in_proportion_to_its_share_of_peak():
    assert tensor_demand(H100, H100.gemm_efficiency) == pytest.approx(product_demand(H100))
    assert tensor_demand(H100, H100.gemm_efficiency / 2) == pytest.approx(product_demand(H100) / 2)
    # FlashAttention v1 on H100 (~0.13 of peak) never reaches the cap alone
    low = PowerMix(1.0, tensor_demand(H100, 0.13), 0.0)
    assert clock_fraction(H100, low) == 1.0


def test_a_collective_takes_its_channels_sms_from_tensor_core_work():
    products = _products(fp8=True)  # at the boost clock alone: only the SMs and the clock the link costs change
    assert comm_sms(H100, NVLINK) == 24 and comm_sms(H100, NETWORK) == 16
    no_power = dataclasses.replace(H100, loaded_clock_hz=H100.boost_clock_hz)
    assert compute_rate(no_power, NVLINK, products) == pytest.approx((132 - 24) / 132)
    assert compute_rate(no_power, NETWORK, products) == pytest.approx((132 - 16) / 132)
    # a runtime that drives its own collectives on fewer SMs (Transformer Engine's userbuffers) costs less
    assert compute_rate(no_power, NVLINK, products, sms=1) == pytest.approx(131 / 132)


def test_a_collective_takes_hbm_bandwidth_from_memory_bound_work():
    memory = PowerMix(0.0, 0.0, 1.0)
    rate = compute_rate(H100, NVLINK, memory)
    # 3 HBM bytes per byte sent at the NVLink bus bandwidth, of the streaming bandwidth
    taken = 3 * NVLINK.bus_bandwidth_bytes_per_s / (H100.hbm_bandwidth_bytes_per_s * H100.memory_efficiency)
    assert rate == pytest.approx(1 - taken)
    assert compute_rate(H100, NETWORK, memory) > rate  # a NIC's rate takes less
    # memory-bound work keeps its clock: no SMs or power enter its rate
    assert compute_rate(dataclasses.replace(H100, nccl_channels=100), NVLINK, memory) == pytest.approx(rate)


def test_a_collective_beside_products_drops_their_clock_by_the_power_of_its_rate():
    products = _products(fp8=True)
    no_sms = dataclasses.replace(H100, nccl_channels=0, nccl_network_channels=0)
    nvlink, network = compute_rate(no_sms, NVLINK, products), compute_rate(no_sms, NETWORK, products)
    # at the full NVLink rate: boost -> loaded (DeepGEMM#120); over one NIC, a fraction of that power
    assert nvlink == pytest.approx(H100.loaded_clock_hz / H100.boost_clock_hz, rel=0.01)
    assert nvlink < network < 1.0
    # PyTorch PR #172714 (8x H100): a product beside a copy-engine all-gather ran 1.25x slower
    assert 1 / nvlink == pytest.approx(1.25, abs=0.03)


def test_overlapped_time_is_what_does_not_fit_or_what_the_compute_loses():
    assert overlapped_s(0.0, 1.0, 0.5) == 0.0
    assert overlapped_s(1.0, 0.0, 0.5) == 1.0  # nothing to hide under
    assert overlapped_s(0.2, 1.0, 0.75) == pytest.approx(0.05)  # the compute loses a quarter of 0.2 s
    assert overlapped_s(2.0, 1.0, 0.75) == pytest.approx(1.0)  # the collective outlasts the compute


def test_power_caps_differ_by_device():
    # A100's cap holds products at 1305 of 1410 MHz (its HPL clock); H100's at 1575 of 1980
    a100 = clock_fraction(A100, PowerMix(1.0, product_demand(A100), 0.0))
    h100 = clock_fraction(H100, _products())
    assert a100 == pytest.approx(1305 / 1410, rel=1e-6) and h100 == pytest.approx(1575 / 1980, rel=1e-6)
