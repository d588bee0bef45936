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
well below the large-GEMM efficiency, as measured products do.  Where the device's kernels write a tile's
result after its main loop (Ampere's multistage kernels), storing the result adds its bytes at HBM bandwidth
(``gemm_store_s``): a product with a short reduction writes as many bytes per FLOP as it reads, and that store
is not hidden (Megatron's unfused attention on A100, ``tests/test_kernels.py``); Hopper's and Blackwell's
persistent kernels store beside the next tile's main loop.

**Attention** with flash kernels runs at the throughput its published benchmarks measured on the device
(``Cluster.attention_kernels``): forward and backward apart, by head dimension and sequence length, causal
or not, interpolated on ``log2`` of the sequence length and linearly in the head dimension, and held at
the ends of the measured range.  The tables count FLOPs as the FlashAttention papers do (forward
``4 s^2 d`` per head, halved under a causal mask; backward 2.5x forward), so a causal kernel's time is
those nominal FLOPs over its causal throughput.  Where a source publishes no causal backward, the causal
backward keeps the non-causal one's ratio to its forward.  Where a device has no table of a kernel
(FlashAttention-3 is Hopper-only; FlashAttention v1 was never benchmarked on Blackwell), it runs
FlashAttention-2's.  Unfused attention is two batched products per pass plus its softmax passes.

**Memory-bound** work moves its bytes at ``hbm_bandwidth * memory_efficiency``.  The power cap lowers the
SM clock, not the HBM clock: memory-bound kernels keep their bandwidth (they draw well under the cap; see
``autopar.interference`` for what communication beside them takes).

None of these times includes launching the kernel: launches run on the host's timeline, ahead of the GPU
(``host_s``), and a stage costs whichever of the two timelines is longer (``autopar.inter_op.unit_costs``).
The GPU pays ``kernel_gap_s`` between back-to-back kernels.
"""

from __future__ import annotations

import functools
import itertools
import math

from autopar.cluster import AttentionTable, Cluster

#: Split-K factors considered for a product that does not fill the SMs: powers of two up to 16, as CUTLASS's
#: split-K kernels and cuBLASLt's ``CUBLASLT_ALGO_CONFIG_SPLITK_NUM`` offer them.  A split is taken only while
#: its blocks fit in two waves (beyond that it adds a reduction without filling more SMs) and each slice of
#: ``k`` is at least twice the pipeline fill (else the fill dominates); both bounds are this model's
#: reasoning about cuBLAS's heuristic, which is not published, not measurements.
SPLIT_K = (1, 2, 4, 8, 16)
#: FlashAttention version -> its kernel name in ``Cluster.attention_kernels``.
FLASH_VERSIONS = {1: "flash1", 2: "flash", 3: "flash3"}
#: Backward FLOPs of a flash kernel per forward FLOP (5 products against 2: the scores are recomputed).
FLASH_BACKWARD_FLOPS = 2.5


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


def gemm_store_s(cluster: Cluster, m: float, n: float, batch: float = 1, width: float = 2) -> float:
    """The time storing a ``batch x m x n`` product result of ``width``-byte elements adds beyond the product's main
    loop: its bytes at HBM bandwidth on a device whose kernels store after their main loop
    (``Cluster.gemm_stores_after_main_loop``), nothing where the store runs beside the next tile's main loop."""
    if not cluster.gemm_stores_after_main_loop or min(m, n, batch) <= 0:
        return 0.0
    return memory_s(cluster, batch * m * n * width)


def attention_tflops(cluster: Cluster, version: int, direction: str, head_dim: float, seq_len: float,
                     causal: bool) -> float:
    """Throughput (TFLOP/s, the FlashAttention papers' FLOP count) of FlashAttention ``version``'s ``direction``
    pass (``fwd``/``bwd``) at ``head_dim`` and ``seq_len`` on ``cluster`` (``Cluster.attention_kernels``)."""
    return _attention_tflops(cluster.attention_kernels, FLASH_VERSIONS[version], direction, float(head_dim),
                             float(seq_len), causal)


@functools.lru_cache(maxsize=4096)
def _attention_tflops(tables: tuple[AttentionTable, ...], kernel: str, direction: str, head_dim: float,
                      seq_len: float, causal: bool) -> float:
    if not any(t.kernel == kernel for t in tables):
        if kernel == "flash" or not any(t.kernel == "flash" for t in tables):
            raise ValueError(f"no attention tables for {kernel} on this cluster")
        kernel = "flash"  # FlashAttention-3 is Hopper-only, v1 unmeasured on newer devices: FlashAttention-2 runs
    mine = [t for t in tables if t.kernel == kernel and t.direction == direction and t.causal == causal]
    if not mine and causal:  # no published causal pass: the non-causal one, as much slower as the forward gets
        ratio = (_attention_tflops(tables, kernel, "fwd", head_dim, seq_len, True)
                 / _attention_tflops(tables, kernel, "fwd", head_dim, seq_len, False)) if direction == "bwd" else 1.0
        return ratio * _attention_tflops(tables, kernel, direction, head_dim, seq_len, False)
    if not mine:
        raise ValueError(f"no {direction} attention table for {kernel} on this cluster")
    by_dim = sorted(mine, key=lambda t: t.head_dim)
    values = [(t.head_dim, _along_seq(t, seq_len)) for t in by_dim]
    if head_dim <= values[0][0]:
        return values[0][1]
    for (d0, v0), (d1, v1) in itertools.pairwise(values):
        if head_dim <= d1:
            return v0 + (v1 - v0) * (head_dim - d0) / (d1 - d0)
    return values[-1][1]


def _along_seq(t: AttentionTable, seq_len: float) -> float:
    """``t``'s throughput at ``seq_len``: linear in ``log2`` of it between measured lengths, held outside."""
    if seq_len <= t.seq_len[0]:
        return t.tflops[0]
    for s0, s1, v0, v1 in zip(t.seq_len, t.seq_len[1:], t.tflops, t.tflops[1:]):
        if seq_len <= s1:
            return v0 + (v1 - v0) * math.log2(seq_len / s0) / math.log2(s1 / s0)
    return t.tflops[-1]


def flash_attention_s(cluster: Cluster, flops: float, version: int = 2, direction: str = "fwd",
                      head_dim: float = 128, seq_len: float = 4096, causal: bool = False) -> float:
    """Time of a flash-attention pass (FlashAttention ``version`` 1, 2 or 3; ``fwd`` or ``bwd``) of ``flops``
    counted as its benchmarks count them (``4 s^2 d`` per head forward, halved under a causal mask)."""
    return flops / (attention_tflops(cluster, version, direction, head_dim, seq_len, causal) * 1e12)


def memory_s(cluster: Cluster, nbytes: float) -> float:
    """Time to stream ``nbytes`` through HBM."""
    return nbytes / (cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency)


__all__ = ["FLASH_BACKWARD_FLOPS", "FLASH_VERSIONS", "attention_tflops", "flash_attention_s", "gemm_efficiency",
           "gemm_s", "gemm_store_s", "memory_s"]
