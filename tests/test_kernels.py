"""The kernel time model: GEMM tile and wave quantization, split-K, pipeline fill; flash attention."""

from __future__ import annotations

import math

import pytest

from autopar.cluster import load_cluster
from autopar.kernels import flash_attention_s, gemm_efficiency, gemm_s, memory_s

A100 = load_cluster("a100-80gb")
H100 = load_cluster("h100-80gb")


def test_a_large_gemm_runs_near_the_main_loop_efficiency():
    eff = gemm_efficiency(A100, 8192, 8192, 8192)
    k_fill = 8192 / (8192 + A100.gemm_k_overhead)
    assert eff == pytest.approx(A100.gemm_efficiency * k_fill, rel=0.02)  # 256x128 tiles fill 32 x 64 / 108 waves


def test_wave_quantization():
    # 108 tiles of 128x128 fill one wave of A100's 108 SMs; 109 need a second, nearly empty one
    full = gemm_efficiency(A100, 128 * 12, 128 * 9, 4096)
    over = gemm_efficiency(A100, 128 * 12 + 1, 128 * 9, 4096)
    # the extra row at worst doubles the waves of the 128x128 tiles, so more than half the efficiency stays
    assert 0.5 * full < over < 0.7 * full
    # one more row of output costs a whole extra (nearly empty) wave of time
    assert gemm_s(A100, 128 * 12 + 1, 128 * 9, 4096) > 1.4 * gemm_s(A100, 128 * 12, 128 * 9, 4096)


def test_tile_quantization_and_small_gemms():
    # an output one element past a tile edge wastes most of the extra tile row
    assert gemm_efficiency(A100, 4097, 4096, 4096) < gemm_efficiency(A100, 4096, 4096, 4096)
    # tiny and skinny products are far from peak
    assert gemm_efficiency(A100, 512, 512, 512) < 0.4
    assert gemm_efficiency(A100, 16, 4096, 4096) < 0.2
    assert gemm_efficiency(A100, 8192, 8192, 64) < 0.3  # attention's k = head_dim products


def test_split_k_fills_the_machine_for_few_output_tiles():
    # 4 tiles of output, a long reduction: splitting k beats running 4 of 108 SMs
    m = n = 256
    k = 65536
    no_split = 4 / 108 * k / (k + A100.gemm_k_overhead) * A100.gemm_efficiency
    assert gemm_efficiency(A100, m, n, k) > 3 * no_split


def test_reduction_length_efficiency_grows_with_k():
    effs = [gemm_efficiency(H100, 16384, 16384, k) for k in (256, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[0] < 0.6 * effs[-1]


def test_batched_products_fill_waves_together():
    # 108 heads of a 128x128 output fill one wave of whole tiles: only the pipeline fill is lost
    assert gemm_efficiency(A100, 128, 128, 4096, batch=108) == pytest.approx(
        A100.gemm_efficiency * 4096 / (4096 + A100.gemm_k_overhead))
    # a single one runs on a few SMs even split along k
    assert gemm_efficiency(A100, 128, 128, 4096, batch=108) > 3 * gemm_efficiency(A100, 128, 128, 4096, batch=1)


def test_cpu_has_no_quantization():
    cpu = load_cluster("cpu")
    assert gemm_efficiency(cpu, 1000, 1000, 1000) == pytest.approx(cpu.gemm_efficiency)


def test_flash_attention_versions():
    flops = 1e13
    t1, t2, t3 = (flash_attention_s(H100, flops, v) for v in (1, 2, 3))
    assert t1 > t2 > t3  # v3 uses Hopper's wgmma
    assert t1 / t2 == pytest.approx(2, rel=0.05)  # FlashAttention-2 is about twice v1 (Dao 2023)
    assert t2 == pytest.approx(flops / (H100.peak_flops * H100.attention_efficiency))
    assert math.isclose(flash_attention_s(A100, flops, 3), flash_attention_s(A100, flops, 2))  # no v3 on Ampere


#: OpenXLA's published H100 (sm_90) matmul measurements, bf16 in and out: (batch, m, n, k, flop/s), from
#: xla/service/gpu/model/matmul_interpolator_data.h (kDefaultMatmulPTable as of tensorflow/tensorflow commit
#: 372d578b's third_party/xla copy, 2025): every entry of training size (k >= 1024, at least 2^21 outputs)
#: among the first 72 of its sm_90 table, 26 of them.  An independent check of the GEMM model, not its source.
OPENXLA_SM90_BF16 = ((2, 2048, 4096, 1024, 678.7e12), (4, 4096, 1024, 1024, 673.8e12), (4, 4096, 256, 2048, 588.7e12),
                     (2, 4096, 4096, 2048, 763.0e12), (4, 1024, 2048, 2048, 712.7e12), (2, 2048, 2048, 1024, 600.2e12),
                     (2, 1024, 4096, 1024, 596.5e12), (4, 512, 4096, 1024, 592.2e12), (1, 4096, 4096, 4096, 783.3e12),
                     (2, 4096, 2048, 4096, 783.2e12), (4, 2048, 2048, 2048, 725.7e12), (4, 4096, 512, 1024, 589.0e12),
                     (2, 4096, 512, 4096, 729.7e12), (2, 4096, 1024, 4096, 750.6e12), (1, 2048, 2048, 2048, 632.0e12),
                     (4, 1024, 1024, 2048, 626.1e12), (4, 2048, 512, 2048, 621.4e12), (4, 256, 2048, 1024, 358.9e12),
                     (2, 1024, 2048, 1024, 493.4e12), (4, 512, 2048, 1024, 487.2e12), (2, 512, 2048, 2048, 525.3e12),
                     (1, 1024, 2048, 2048, 524.3e12), (1, 2048, 1024, 2048, 523.3e12), (4, 1024, 512, 2048, 514.2e12),
                     (1, 512, 4096, 1024, 373.3e12), (1, 4096, 512, 1024, 370.8e12))


def test_the_h100_gemm_model_matches_openxla_measurements_at_training_sizes():
    """A product as the cost model times it (``sharding_costs.compute_s``: the GEMM or its bytes, whichever is
    longer, plus one kernel's launch) against OpenXLA's measured time."""
    h100 = load_cluster("h100-80gb")

    def modelled_s(b: int, m: int, n: int, k: int) -> float:
        return max(gemm_s(h100, m, n, k, b), memory_s(h100, 2 * b * (m * k + k * n + m * n))) + h100.kernel_overhead_s

    ratios = [2 * b * m * n * k / modelled_s(b, m, n, k) / measured for b, m, n, k, measured in OPENXLA_SM90_BF16]
    assert all(0.85 <= r <= 1.15 for r in ratios), [round(r, 2) for r in ratios]
    assert 0.92 <= sorted(ratios)[len(ratios) // 2] <= 1.08
