"""What a collective running beside compute costs that compute: SMs, HBM bandwidth and clock.

Overlapped communication is not free.  While an NCCL collective runs beside compute on one GPU:

- **SMs**: each of its channels is a thread block that holds an SM for the whole collective (its registers
  and shared memory leave no room for a GEMM's block beside it: "NCCL CTAs won't share an SM with compute
  kernels", NVIDIA/nccl#689), so tensor-core kernels run on ``sm_count - channels`` SMs.  NCCL runs
  ``nccl_channels`` inside an NVLink domain and ``nccl_network_channels`` across nodes; a runtime that
  drives its own collectives (Transformer Engine's userbuffers) says how many SMs it gives them
  (``Framework.tp_overlap_comm_sms``).
- **HBM**: every byte it sends is read and written in HBM about ``comm_hbm_bytes_per_byte`` times over
  (staging buffers, the user's data: "300GB/s needs to be multiplied by at least 2x for memory bandwidth ...
  it can be 3x", NVIDIA/nccl#1428), bandwidth memory-bound kernels beside it lose.
- **Clock**: the compute already holds the clock the power cap leaves it (``autopar.power``); the collective
  adds the power of its links and HBM traffic (at the intra-node fabric's full rate, what drops FP8 products
  from 1980 to 1575 MHz on Hopper: deepseek-ai/DeepGEMM#120), and the clock falls further.  Memory-bound
  kernels keep their bandwidth: the cap lowers the SM clock, not the HBM clock.

So compute of a given kernel mix runs at a ``rate`` below 1 while the collective runs, and a window of
``W`` seconds of compute beside ``C`` seconds of communication takes ``max(C, W + C (1 - rate))``.  This
replaces a flat tax on every overlap: an all-gather between nodes with one rank on each (16 SMs, one NIC's
rate, a tenth of NVLink's) costs a GEMM far less than one inside a node (24 SMs, HBM traffic at three times
360 GB/s, the clock down 20 %).
"""

from __future__ import annotations

from autopar.cluster import AxisLink, Cluster
from autopar.power import PowerMix, clock_fraction

#: The least a memory-bound kernel keeps of its bandwidth beside a collective (a guard: no model of HBM
#: arbitration says it stops).
_MIN_MEMORY_RATE = 0.1


def comm_sms(cluster: Cluster, link: AxisLink) -> int:
    """SMs an NCCL collective on ``link`` holds: its channels inside an NVLink domain, or across nodes."""
    return cluster.nccl_network_channels if link.crosses_nodes else cluster.nccl_channels


def compute_rate(cluster: Cluster, link: AxisLink, mix: PowerMix, sms: int | None = None) -> float:
    """How fast compute of ``mix`` (its kernels at the boost clock) runs while a collective on ``link`` runs beside
    it (1: unaffected), with ``sms`` SMs taken by the collective (default: NCCL's channels on that link)."""
    if mix.tensor_s + mix.memory_s <= 0:
        return 1.0
    taken = comm_sms(cluster, link) if sms is None else sms
    rate_bytes = link.bus_bandwidth_bytes_per_s
    alone = clock_fraction(cluster, mix)  # the clock the mix holds without the collective
    beside = clock_fraction(cluster, mix, rate_bytes)
    tensor = max(1, cluster.sm_count - taken) / cluster.sm_count * beside / alone
    hbm = cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency
    memory = max(_MIN_MEMORY_RATE, 1.0 - cluster.comm_hbm_bytes_per_byte * rate_bytes / hbm)
    tensor_s = mix.tensor_s / alone  # its tensor-core time at that clock
    return (tensor_s + mix.memory_s) / (tensor_s / tensor + mix.memory_s / memory)


def overlapped_s(comm_s: float, window_s: float, rate: float) -> float:
    """Time ``comm_s`` of communication adds to ``window_s`` of compute it runs beside, the compute running at
    ``rate`` while both run: what does not fit beside the compute, or what the compute loses to it."""
    if comm_s <= 0:
        return 0.0
    return max(comm_s - window_s, comm_s * (1.0 - rate))


__all__ = ["comm_sms", "compute_rate", "overlapped_s"]
