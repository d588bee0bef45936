"""Time of one kernel on one device: GEMMs, attention and memory-bound work, from the cluster spec.

**GEMMs** (``gemm_s``).  cuBLAS splits the ``m x n`` output of a product into tiles, one thread block
each, and runs them in waves of ``sm_count`` blocks; the last wave may be partly empty (wave
quantization), and the edge tiles partly outside the matrix (tile quantization).  Each tile then walks
the reduction dimension ``k``; filling its software pipeline and writing its result cost about
``gemm_k_overhead`` elements of ``k`` (NVIDIA, "Matrix Multiplication Background User's Guide").  So a
product runs at::

    gemm_efficiency * k / (k + gemm_k_overhead) * max over tiles of (tile efficiency * useful / launched)

where ``useful / launched`` is ``m * n`` over the area of all waves of that tile.  When one wave is not
filled, cuBLAS splits the reduction (split-K) across more blocks; that is one of the choices.  Small and
skinny products (tensor-parallel slices of small models, attention's ``k = head_dim`` products) come out
well below the large-GEMM efficiency, as measured products do.

**Attention** with flash kernels runs at ``attention_efficiency`` (FlashAttention-2),
``flash1_attention_efficiency`` or ``flash3_attention_efficiency`` on the FLOPs it executes (a causal
mask skips blocks; see ``autopar.passes.flops``).  Unfused attention is two batched products per pass
plus its softmax passes.

**Memory-bound** work moves its bytes at ``hbm_bandwidth * memory_efficiency``.
"""

from __future__ import annotations

import functools
import math

from autopar.cluster import Cluster

#: Split-K factors considered for a product that does not fill the SMs: powers of two up to 16, as CUTLASS's
#: split-K kernels and cuBLASLt's ``CUBLASLT_ALGO_CONFIG_SPLITK_NUM`` offer them.  A split is taken only while
#: its blocks fit in two waves (beyond that it adds a reduction without filling more SMs) and each slice of
#: ``k`` is at least twice the pipeline fill (else the fill dominates); both bounds are this model's
#: reasoning about cuBLAS's heuristic, which is not published, not measurements.
SPLIT_K = (1, 2, 4, 8, 16)
#: FlashAttention version -> the cluster key of its efficiency.
_FLASH_EFFICIENCY = {1: "flash1_attention_efficiency", 2: "attention_efficiency", 3: "flash3_attention_efficiency"}


def gemm_efficiency(cluster: Cluster, m: float, n: float, k: float, batch: float = 1, fp8: bool = False) -> float:
    """Fraction of peak (the FP8 peak when ``fp8``) a ``batch x (m x k) @ (k x n)`` product reaches on
    ``cluster``.  FP8 products tile their output as bf16 ones do (CUTLASS SM90 FP8 kernels use the same
    output tiles) and keep twice the elements of ``k`` in flight (``fp8_gemm_k_overhead``)."""
    main, overhead = ((cluster.fp8_gemm_efficiency, cluster.fp8_gemm_k_overhead) if fp8
                      else (cluster.gemm_efficiency, cluster.gemm_k_overhead))
    return _efficiency(main, cluster.sm_count, cluster.gemm_tiles, overhead,
                       max(1, round(m)), max(1, round(n)), max(1, round(k)), max(1, round(batch)))


@functools.lru_cache(maxsize=65536)
def _efficiency(peak_fraction: float, sms: int, tile_set: tuple[tuple[float, float, float], ...], k_overhead: float,
                m: int, n: int, k: int, batch: int) -> float:
    if not tile_set:
        return peak_fraction * k / (k + k_overhead)
    best = 0.0
    for tm, tn, rel in tile_set:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for split in SPLIT_K:
            if split > 1 and (tiles * split > sms * 2 or k / split < 2 * k_overhead):
                break  # split-K only to fill the first waves, and never into slivers of k
            blocks = tiles * split
            waves = math.ceil(blocks / sms)
            useful = batch * m * n * split / (waves * sms * tm * tn)
            k_part = k / split
            best = max(best, rel * useful * k_part / (k_part + k_overhead))
    return peak_fraction * best


def gemm_s(cluster: Cluster, m: float, n: float, k: float, batch: float = 1, fp8: bool = False) -> float:
    """Compute time of a ``batch x (m x k) @ (k x n)`` product (FLOPs only; callers add the memory roofline),
    in FP8 at ``peak_fp8_flops`` when ``fp8``."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    peak = cluster.peak_fp8_flops if fp8 else cluster.peak_flops
    return 2.0 * batch * m * n * k / (peak * gemm_efficiency(cluster, m, n, k, batch, fp8))


def flash_attention_s(cluster: Cluster, flops: float, version: int = 2) -> float:
    """Compute time of a flash-attention kernel (FlashAttention ``version`` 1, 2 or 3) executing ``flops``."""
    return flops / (cluster.peak_flops * getattr(cluster, _FLASH_EFFICIENCY[version]))


def memory_s(cluster: Cluster, nbytes: float) -> float:
    """Time to stream ``nbytes`` through HBM."""
    return nbytes / (cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency)


__all__ = ["flash_attention_s", "gemm_efficiency", "gemm_s", "memory_s"]
