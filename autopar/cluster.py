"""Cluster specs: the hardware numbers every cost in autopar comes from.

A ``Cluster`` is loaded from a TOML file: a preset shipped in ``autopar/clusters/`` (``a100-80gb``,
``h100-80gb``, ``h200``, ``cpu``) or a user file.  Each number in the presets carries its public source
in a comment there.  Bandwidths are per GPU and per direction, in bytes/s; latencies in seconds.

TOML format (all keys of ``Cluster`` except ``name`` may appear; unknown keys are an error)::

    name = "my-cluster"          # optional, defaults to the file name
    base = "a100-80gb"           # optional: start from a preset and override some keys
    gpus = 64
    gpus_per_node = 8
    peak_flops = 312e12
    inter_node_bandwidth_bytes_per_s = 25e9
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, fields
from typing import Any

from autopar.errors import ClusterSpecError
from autopar.spec_files import load_spec
from autopar.units import GiB

PRESETS = ("a100-40gb", "a100-80gb", "h100-80gb", "h100-80gb-roce", "h200", "b200", "gb200-nvl72", "cpu")


#: Index of each NCCL protocol in the per-protocol cluster keys.
PROTOCOLS = ("LL", "LL128", "Simple")
FABRICS = ("nvlink", "infiniband", "roce", "ethernet", "loopback")
_TRIPLES = ("collective_base_latency_s", "intra_node_latency_s", "inter_node_latency_s",
            "protocol_bandwidth_fraction")
_FRACTIONS = ("gemm_efficiency", "memory_efficiency",
              "intra_node_collective_efficiency", "inter_node_collective_efficiency", "tree_bandwidth_fraction")
_INTEGERS = ("gpus", "gpus_per_node", "sm_count", "attention_block", "nics_per_node", "pod_gpus", "nvlink_domain_size",
             "nccl_channels", "nccl_network_channels")
#: Keys a cluster file may leave out, and their values then.
_DEFAULTS = {"nvlink_domain_size": 0, "peak_fp8_flops": 0.0, "fp8_gemm_efficiency": 0.0, "fp8_gemm_k_overhead": 0.0,
             "mamf_fp8_flops": 0.0, "mamf_fp8_shape": (), "inductor_backend": "triton",
             "node_overhead_w": 0.0, "loaded_clock_power_w": 0.0, "gemm_stores_after_main_loop": False}
#: Attention kernels (``PassContext.attention``) a cluster's ``attention_kernels`` tables describe.
FLASH_KERNELS = ("flash1", "flash", "flash3")


@dataclass(frozen=True, slots=True)
class AttentionTable:
    """Published throughput of one flash-attention kernel on the device: one pass (``fwd`` or ``bwd``), one
    head dimension, causal or not, at several sequence lengths, in TFLOP/s as its source counts them (the
    FlashAttention papers' convention: forward ``4 s^2 d`` per head, halved under a causal mask; backward 2.5x
    forward)."""

    kernel: str
    direction: str
    head_dim: int
    causal: bool
    seq_len: tuple[int, ...]
    tflops: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kernel not in FLASH_KERNELS or self.direction not in ("fwd", "bwd"):
            raise ClusterSpecError(f"attention table: kernel must be one of {', '.join(FLASH_KERNELS)} and "
                                   f"direction fwd or bwd, got {self.kernel!r}, {self.direction!r}")
        if (not self.seq_len or len(self.seq_len) != len(self.tflops) or list(self.seq_len) != sorted(self.seq_len)
                or min(self.seq_len) <= 0 or min(self.tflops) <= 0 or self.head_dim < 0):
            raise ClusterSpecError(f"attention table {self.kernel} {self.direction} d{self.head_dim}: seq_len must "
                                   "rise, and seq_len and tflops be positive lists of one length")

    @classmethod
    def parse(cls, entry: Any) -> AttentionTable:
        if isinstance(entry, AttentionTable):
            return entry
        if not isinstance(entry, dict):
            raise ClusterSpecError(f"attention_kernels entries must be tables, got {entry!r}")
        try:
            return cls(str(entry["kernel"]), str(entry["direction"]), int(entry["head_dim"]), bool(entry["causal"]),
                       tuple(int(x) for x in entry["seq_len"]), tuple(float(x) for x in entry["tflops"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterSpecError(f"attention_kernels entry {entry!r}: needs kernel, direction, head_dim, causal, "
                                   f"seq_len and tflops ({exc})") from exc

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "direction": self.direction, "head_dim": self.head_dim, "causal": self.causal,
                "seq_len": list(self.seq_len), "tflops": list(self.tflops)}


def used_nvlink_domain(gpus: int, gpus_per_node: int, domain: int) -> int:
    """GPUs of each NVLink domain a job of ``gpus`` uses: all of them within one domain; else the most whole nodes
    of a domain that tile the job, as Megatron-Bridge's Slurm launcher packs GB200 trays (the largest divisor of the
    job's nodes up to a rack's 18: ``--segment``, scripts/performance/utils/executors.py), so 256 GPUs run as four
    racks of 64."""
    if gpus <= domain:
        return gpus
    nodes, per_domain = max(1, gpus // gpus_per_node), max(1, domain // gpus_per_node)
    return gpus_per_node * next(k for k in range(min(per_domain, nodes), 0, -1) if nodes % k == 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """A homogeneous GPU cluster: nodes of ``gpus_per_node`` devices on a switched fabric.

    The compute keys describe one device and the kernels that run on it; the network keys describe the
    fabric (NVLink inside a node, NICs and pods between nodes) and NCCL's cost of running a collective
    on it (``autopar.collectives``).  Per-protocol keys list (LL, LL128, Simple) values.
    """

    name: str
    device: str
    """Device model, for display."""
    gpus: int
    """Number of devices in the cluster."""
    gpus_per_node: int
    """Devices that share the fast intra-node fabric (NVLink/NVSwitch)."""
    # ---- compute (``autopar.kernels``)
    peak_flops: float
    """Peak dense 16-bit tensor-core FLOP/s per device."""
    sm_count: int
    """Streaming multiprocessors: a GEMM's output tiles run in waves of this many."""
    gemm_efficiency: float
    """Fraction of ``peak_flops`` a large GEMM reaches once its tiles fill whole waves and its reduction
    dimension is long (cuBLAS main-loop efficiency), at the boost clock a benchmark's bursts hold (the power cap
    is ``autopar.power``'s)."""
    gemm_tiles: tuple[tuple[float, float, float], ...]
    """Output tiles (rows, columns, relative efficiency) cuBLAS may pick; it picks the one that wastes the
    least to tile and wave quantization.  Empty: no quantization (CPU)."""
    gemm_k_overhead: float
    """Reduction length equivalent to a tile's pipeline fill and epilogue: efficiency ``k / (k + this)``."""
    mamf_flops: float
    """Maximum achievable matmul FLOP/s (bf16): the best of a sweep of ``torch.mm`` shapes run back to back
    after a warm-up (stas00/ml-engineering's mamf-finder): a ceiling the GEMM model must not pass."""
    mamf_shape: tuple[int, int, int]
    """The (m, n, k) at which ``mamf_flops`` was measured."""
    attention_kernels: tuple[AttentionTable, ...]
    """Published forward and backward throughput of the flash-attention kernels (``autopar.kernels``)."""
    attention_block: int
    """Query and key block size of flash attention: a causal mask skips the blocks above the diagonal."""
    memory_efficiency: float
    """Fraction of HBM bandwidth reached by memory-bound (element-wise, norm, softmax) kernels."""
    kernel_launch_s: float
    """CPU time of launching one kernel (the CUDA driver call), on the host timeline (``autopar.kernels``)."""
    kernel_gap_s: float
    """GPU time between two kernels queued back to back in one stream (the next one's launch on the device)."""
    gemm_latency_s: float
    """A product kernel's fixed GPU time beyond its tiles' work, its gap included: the grid's launch and drain,
    the first stage's loads, the epilogue's stores."""
    # ---- clocks and power (``autopar.power``, ``autopar.interference``)
    boost_clock_hz: float
    """The highest SM clock the device runs."""
    peak_clock_hz: float
    """The SM clock at which ``peak_flops`` is quoted."""
    loaded_clock_hz: float
    """The SM clock dense 16-bit products hold at the power cap under a sustained load; a collective at the full
    rate of the intra-node fabric beside FP8 products (which alone hold ``boost_clock_hz``) brings them to it
    too (``autopar.power``)."""
    power_cap_w: float
    """Board power limit (TDP)."""
    loaded_clock_power_w: float = 0.0
    """The power limit ``loaded_clock_hz`` was observed at (0: ``power_cap_w``).  A device capped lower
    (``power_cap_w`` overridden: a power-limited fleet) draws what the chip draws at each clock, so it holds a
    lower one (``autopar.power``); a preset derived from another at a different cap keeps its base's."""
    idle_power_w: float
    """Board power of an idle device."""
    memory_bound_power_w: float
    """Board power while memory-bound kernels stream HBM at full bandwidth (``autopar.power``)."""
    # ---- memory
    hbm_bytes: float
    """Device memory per device, bytes."""
    hbm_bandwidth_bytes_per_s: float
    """Device-memory bandwidth per device."""
    memory_reserve_bytes: float
    """Device memory never available to the plan (CUDA context, NCCL buffers)."""
    allocator_fragmentation: float
    """Memory the caching allocator holds beyond what is allocated, as a fraction of the allocated peak."""
    # ---- network
    intra_node_bandwidth_bytes_per_s: float
    """Per-device, per-direction bandwidth of the intra-node fabric."""
    intra_node_collective_efficiency: float
    """NCCL bus bandwidth inside a node as a fraction of the intra-node link bandwidth."""
    inter_node_fabric: str
    """Network between nodes: ``infiniband``, ``roce``, ``ethernet`` (``nvlink``/``loopback`` for one node)."""
    inter_node_bandwidth_bytes_per_s: float
    """Per-NIC, per-direction line rate of the network."""
    nics_per_node: int
    """NICs per node.  Rail-optimized systems (DGX, HGX) have one per GPU, each on its own rail; with fewer,
    GPUs share them."""
    inter_node_collective_efficiency: float
    """NCCL bus bandwidth across nodes as a fraction of the NIC line rate."""
    pod_gpus: int
    """GPUs under one full-bisection tier of the fabric; 0: the whole cluster is one."""
    pod_oversubscription: float
    """Oversubscription of the links above a pod (7 for 1:7): traffic between pods shares them."""
    collective_base_latency_s: tuple[float, float, float]
    """Fixed latency of one NCCL collective, per protocol."""
    intra_node_latency_s: tuple[float, float, float]
    """Latency of one ring or tree step over NVLink, per protocol."""
    inter_node_latency_s: tuple[float, float, float]
    """Latency of one ring or tree step over the network, per protocol."""
    protocol_bandwidth_fraction: tuple[float, float, float]
    """Share of the bus bandwidth each protocol delivers (LL sends half its bytes as flags)."""
    tree_bandwidth_fraction: float
    """Share of the ring's bus bandwidth the tree all-reduce reaches."""
    nccl_channels: int
    """SMs (channels, one thread block each) an NCCL collective inside the NVLink domain occupies while it runs:
    compute beside it has the rest (``autopar.interference``)."""
    nccl_network_channels: int
    """SMs an NCCL collective between nodes occupies."""
    comm_hbm_bytes_per_byte: float
    """HBM bytes a collective reads and writes per byte it sends (its staging buffers and the user's data):
    what it takes from the HBM bandwidth of memory-bound kernels beside it."""
    peak_fp8_flops: float = 0.0
    """Peak dense FP8 tensor-core FLOP/s per device; 0: the device has no FP8 tensor cores (``--precision fp8``
    is refused)."""
    fp8_gemm_efficiency: float = 0.0
    """``gemm_efficiency`` for FP8 products (cuBLASLt ``e4m3``/``e5m2`` with fp32 accumulation), of
    ``peak_fp8_flops``."""
    fp8_gemm_k_overhead: float = 0.0
    """``gemm_k_overhead`` of FP8 products, in elements of the reduction dimension."""
    gemm_stores_after_main_loop: bool = False
    """Whether a product's kernels write their results to HBM after their main loop instead of beside the next
    tile's (Ampere's multistage kernels run one tile per thread block: main loop, then epilogue; Hopper's and
    Blackwell's persistent warp-specialized kernels store a tile with TMA while the next tile's main loop runs).
    Then storing the result adds its bytes at HBM bandwidth to the product's time (``autopar.kernels``)."""
    mamf_fp8_flops: float = 0.0
    """``mamf_flops`` for FP8 (``torch._scaled_mm``); 0: not measured."""
    mamf_fp8_shape: tuple[int, ...] = ()
    """The (m, n, k) of ``mamf_fp8_flops``."""
    nvlink_domain_size: int = 0
    """GPUs on one NVLink (NVSwitch) domain, a whole number of nodes: the intra-node bandwidth and latencies
    hold inside it, the network's between domains.  0: one node (``gpus_per_node``), as in DGX/HGX
    systems; 72 for a GB200 NVL72 rack of 18 four-GPU trays."""
    inductor_backend: str = "triton"
    """What ``torch.compile``'s Inductor generates for the device's element-wise work: ``triton`` kernels (GPUs:
    the fusion ``autopar.passes.fusion`` prices, and plans compile by default) or ``cpp`` loops (CPUs: plans
    compile only when asked)."""
    node_overhead_w: float = 0.0
    """What a node draws beyond its GPUs at full load (CPUs, NICs, switches, fans): the energy of a sweep
    (``autopar.sweep.economics``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "device", "inter_node_fabric", "inductor_backend"):
                continue
            if f.name == "gemm_stores_after_main_loop":
                if not isinstance(value, bool):
                    raise ClusterSpecError(f"cluster {self.name}: {f.name} must be true or false")
                continue
            if f.name in _TRIPLES:
                _check_numbers(self.name, f.name, value, 3)
                continue
            if f.name == "attention_kernels":
                if not isinstance(value, tuple) or not all(isinstance(t, AttentionTable) for t in value):
                    raise ClusterSpecError(f"cluster {self.name}: attention_kernels must be a list of tables")
                continue
            if f.name in ("mamf_shape", "mamf_fp8_shape"):
                if value and (not isinstance(value, tuple) or len(value) != 3 or min(value) < 1):
                    raise ClusterSpecError(f"cluster {self.name}: {f.name} must be [m, n, k]")
                continue
            if f.name == "gemm_tiles":
                if not isinstance(value, tuple) or any(len(t) != 3 for t in value):
                    raise ClusterSpecError(f"cluster {self.name}: gemm_tiles must be a list of [rows, columns, "
                                           "efficiency] triples")
                for tile in value:
                    _check_numbers(self.name, f.name, tile, 3)
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ClusterSpecError(f"cluster {self.name}: {f.name} must be a non-negative number, got {value!r}")
        for key in _INTEGERS:
            if not isinstance(getattr(self, key), int):
                raise ClusterSpecError(f"cluster {self.name}: {key} must be an integer")
        if self.gpus < 1 or self.gpus_per_node < 1 or self.sm_count < 1 or self.nics_per_node < 1:
            raise ClusterSpecError(f"cluster {self.name}: gpus, gpus_per_node, sm_count and nics_per_node must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ClusterSpecError(
                f"cluster {self.name}: gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")
        if self.nvlink_domain_size and self.nvlink_domain_size % self.gpus_per_node:
            raise ClusterSpecError(f"cluster {self.name}: nvlink_domain_size ({self.nvlink_domain_size}) must be a "
                                   f"multiple of gpus_per_node ({self.gpus_per_node}), or 0 for one node")
        if self.gpus > self.nvlink_domain and self.gpus % self.nvlink_domain:
            raise ClusterSpecError(f"cluster {self.name}: gpus ({self.gpus}) must be a multiple of the NVLink "
                                   f"domain ({self.nvlink_domain} GPUs)")
        for f in _FRACTIONS:
            if not 0 < getattr(self, f) <= 1:
                raise ClusterSpecError(f"cluster {self.name}: {f} must be in (0, 1]")
        if self.peak_fp8_flops and not 0 < self.fp8_gemm_efficiency <= 1:
            raise ClusterSpecError(f"cluster {self.name}: fp8_gemm_efficiency must be in (0, 1] when peak_fp8_flops "
                                   "is set")
        if not all(0 < x <= 1 for x in self.protocol_bandwidth_fraction):
            raise ClusterSpecError(f"cluster {self.name}: protocol_bandwidth_fraction values must be in (0, 1]")
        if not 0 < self.loaded_clock_hz <= self.boost_clock_hz or self.peak_clock_hz <= 0:
            raise ClusterSpecError(f"cluster {self.name}: clocks must be positive and loaded_clock_hz at most "
                                   "boost_clock_hz")
        if not self.mamf_shape:
            raise ClusterSpecError(f"cluster {self.name}: mamf_shape must be [m, n, k]")
        if self.nccl_channels >= self.sm_count and self.sm_count > 1:
            raise ClusterSpecError(f"cluster {self.name}: nccl_channels must be fewer than sm_count")
        kernels = {t.kernel for t in self.attention_kernels}
        for kernel in FLASH_KERNELS:
            directions = {t.direction for t in self.attention_kernels if t.kernel == kernel}
            if kernel in kernels and directions != {"fwd", "bwd"}:
                raise ClusterSpecError(f"cluster {self.name}: attention kernel {kernel} needs fwd and bwd tables")
        if self.pod_oversubscription < 1:
            raise ClusterSpecError(f"cluster {self.name}: pod_oversubscription must be >= 1 (1 = full bisection)")
        if self.inductor_backend not in ("triton", "cpp"):
            raise ClusterSpecError(f"cluster {self.name}: inductor_backend must be triton or cpp")
        if self.inter_node_fabric not in FABRICS:
            raise ClusterSpecError(f"cluster {self.name}: inter_node_fabric must be one of {', '.join(FABRICS)}, "
                                   f"got {self.inter_node_fabric!r}")

    @property
    def num_nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def nvlink_domain(self) -> int:
        """GPUs that share one NVLink domain (``nvlink_domain_size``, else a node)."""
        return self.nvlink_domain_size or self.gpus_per_node

    @property
    def usable_memory_bytes(self) -> float:
        """Per-device memory a plan may allocate: HBM minus the reserve, less the allocator's fragmentation."""
        return (self.hbm_bytes - self.memory_reserve_bytes) / (1 + self.allocator_fragmentation)

    @property
    def nic_bandwidth_per_gpu_bytes_per_s(self) -> float:
        """Network bandwidth one GPU has when every GPU of its node sends at once."""
        return self.inter_node_bandwidth_bytes_per_s * min(self.nics_per_node, self.gpus_per_node) / self.gpus_per_node

    @property
    def has_fp8(self) -> bool:
        """Whether the device has FP8 tensor cores (``peak_fp8_flops``)."""
        return self.peak_fp8_flops > 0

    def with_overrides(self, **overrides: Any) -> Cluster:
        """A copy with some fields replaced (``None`` values are ignored)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "gpus" in changes and "gpus_per_node" not in changes and changes["gpus"] < self.gpus_per_node:
            changes["gpus_per_node"] = changes["gpus"]
        if "gpus" in changes and "nvlink_domain_size" not in changes and self.nvlink_domain_size:
            per_node = changes.get("gpus_per_node", self.gpus_per_node)
            changes["nvlink_domain_size"] = used_nvlink_domain(changes["gpus"], per_node, self.nvlink_domain_size)
        try:
            return dataclasses.replace(self, **changes)
        except TypeError as exc:
            raise ClusterSpecError(str(exc)) from exc

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """The inverse of ``to_dict`` (a plan's ``cluster``): JSON lists back to tuples."""
        return cls(**_parsed_structures(data))

    def fabric_key(self) -> str:
        """The spec less its number of devices, as a hash: what an intra-op solve depends on (clusters of one GPU
        type and size of node, whatever their count; a GB200 NVL72 of part of one rack has a smaller NVLink
        domain, so another key)."""
        spec = {k: v for k, v in self.to_dict().items() if k != "gpus"}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "attention_kernels":
                out[f.name] = [t.to_dict() for t in value]
            else:
                out[f.name] = [list(x) for x in value] if f.name == "gemm_tiles" else (
                    list(value) if isinstance(value, tuple) else value)
        return out


def _parsed_structures(values: dict[str, Any]) -> dict[str, Any]:
    """TOML / JSON lists of a cluster's structured keys as the tuples ``Cluster`` holds (values of other types are
    left for ``Cluster`` to refuse, by name)."""
    out = dict(values)
    for key in _TRIPLES:
        if isinstance(out.get(key), list):
            out[key] = tuple(out[key])
    if isinstance(out.get("gemm_tiles"), list):
        out["gemm_tiles"] = tuple(tuple(t) if isinstance(t, list) else t for t in out["gemm_tiles"])
    if isinstance(out.get("attention_kernels"), (list, tuple)):
        out["attention_kernels"] = tuple(AttentionTable.parse(e) for e in out["attention_kernels"])
    for key in ("mamf_shape", "mamf_fp8_shape"):
        if isinstance(out.get(key), list):
            out[key] = tuple(int(x) for x in out[key])
    return out


def _check_numbers(cluster: str, key: str, value: Any, n: int) -> None:
    if (not isinstance(value, tuple) or len(value) != n
            or any(not isinstance(x, (int, float)) or isinstance(x, bool) or x < 0 for x in value)):
        raise ClusterSpecError(f"cluster {cluster}: {key} must be a list of {n} non-negative numbers, got {value!r}")


@dataclass(frozen=True, slots=True)
class AxisLink:
    """What one mesh axis runs on: its ranks, how they sit on nodes and pods, and the fabric's costs.

    ``bus_bandwidth_bytes_per_s`` is the ring's bus bandwidth with the Simple protocol, taking into account
    the NICs the group's ranks in a node drive in parallel and the share of the pod uplinks it gets when
    every group of the axis communicates at once.
    """

    size: int
    ranks_per_node: int
    nodes: int
    pods: int
    bus_bandwidth_bytes_per_s: float
    intra_bandwidth_bytes_per_s: float
    nic_bandwidth_bytes_per_s: float
    """Network bandwidth one rank has for traffic that leaves its node (its NIC share, pod uplinks included)."""
    base_latency_s: tuple[float, float, float]
    intra_latency_s: tuple[float, float, float]
    inter_latency_s: tuple[float, float, float]
    protocol_fraction: tuple[float, float, float]
    tree_fraction: float
    launch_s: float  # fixed GPU-side cost of one collective's kernel (``Cluster.kernel_gap_s``)

    @property
    def crosses_nodes(self) -> bool:
        return self.ranks_per_node < self.size


def _pods_spanned(cluster: Cluster, size: int, stride: int) -> int:
    if cluster.pod_gpus <= 0 or cluster.pod_gpus >= cluster.gpus:
        return 1
    span = stride * (size - 1) + 1  # consecutive ranks from the group's first member to its last
    return min(size, max(1, math.ceil(span / cluster.pod_gpus)))


def axis_link(cluster: Cluster, size: int, stride: int) -> AxisLink:
    """The link of a mesh axis of ``size`` ranks spaced ``stride`` apart on ``cluster``.

    Ranks of one NVLink domain (a node, or a rack-scale domain such as GB200 NVL72's) talk over NVLink; across
    domains, a group with ``k`` ranks per domain runs ``k`` rings at once, one per NIC, so its bus
    bandwidth is ``min(NVLink, k x NIC share)``.  Across pods, every group of the axis communicates at
    once: each pod sends ``k`` ring channels out per group touching it, over uplinks of
    ``pod GPUs x NIC share / oversubscription``, so the rings slow by ``members per pod / (k x
    oversubscription)`` when that is below one.
    """
    if size < 1 or stride < 1:
        raise ValueError("mesh axis size and stride must be >= 1")
    domain = cluster.nvlink_domain
    per_node = 1 if stride >= domain else max(1, min(size, domain // stride))
    intra = cluster.intra_node_bandwidth_bytes_per_s * cluster.intra_node_collective_efficiency
    nic = cluster.nic_bandwidth_per_gpu_bytes_per_s * cluster.inter_node_collective_efficiency
    common = dict(base_latency_s=cluster.collective_base_latency_s, intra_latency_s=cluster.intra_node_latency_s,
                  inter_latency_s=cluster.inter_node_latency_s, protocol_fraction=cluster.protocol_bandwidth_fraction,
                  tree_fraction=cluster.tree_bandwidth_fraction, launch_s=cluster.kernel_gap_s)
    if per_node >= size:
        return AxisLink(size, size, 1, 1, intra, intra, nic, **common)
    nodes = math.ceil(size / per_node)
    pods = _pods_spanned(cluster, size, stride)
    uplink = 1.0
    if pods > 1:
        uplink = min(1.0, (size / pods) / (per_node * cluster.pod_oversubscription))
    bus = min(intra, per_node * nic * uplink)
    rank_nic = nic / cluster.pod_oversubscription if pods > 1 else nic
    return AxisLink(size, per_node, nodes, pods, bus, intra, rank_nic, **common)


def mesh_links(cluster: Cluster, shape: tuple[int, ...]) -> tuple[AxisLink, ...]:
    """Links of every axis of a row-major logical mesh of ``shape`` laid over the cluster's ranks."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return tuple(axis_link(cluster, n, st) for n, st in zip(shape, strides))


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A logical device mesh for the intra-op problem: axis names, sizes and the link of each axis."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    links: tuple[AxisLink, ...]

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    @classmethod
    def on_cluster(cls, cluster: Cluster, names: tuple[str, ...], shape: tuple[int, ...]) -> MeshSpec:
        """A row-major mesh laid over the cluster's ranks (last axis innermost, inside a node first)."""
        if len(names) != len(shape):
            raise ValueError("one name per mesh axis")
        if math.prod(shape) > cluster.gpus:
            raise ValueError(f"mesh {shape} needs {math.prod(shape)} devices, the cluster has {cluster.gpus}")
        return cls(tuple(names), tuple(shape), mesh_links(cluster, tuple(shape)))


_FIELD_NAMES = {f.name for f in fields(Cluster)}


def load_cluster(spec: str) -> Cluster:
    """A preset name (``a100-80gb``) or a path to a TOML file."""
    values, origin = load_spec(spec, what="cluster", folder="clusters", presets=PRESETS, fields=_FIELD_NAMES,
                               base_values=lambda b: load_cluster(b).to_dict(), error=ClusterSpecError,
                               defaults=_DEFAULTS)
    for key in _INTEGERS:
        if isinstance(values[key], float) and values[key].is_integer():
            values[key] = int(values[key])
        if not isinstance(values[key], int) or isinstance(values[key], bool):
            raise ClusterSpecError(f"{origin}: {key} must be an integer")
    if not isinstance(values["inter_node_fabric"], str):
        raise ClusterSpecError(f"{origin}: inter_node_fabric must be a string")
    if not values["loaded_clock_power_w"]:  # observed at this spec's own cap; a spec based on it keeps that cap
        values["loaded_clock_power_w"] = values["power_cap_w"]
    return Cluster(**_parsed_structures(values))


def cluster_from_args(spec: str, gpus: int | None = None, gpus_per_node: int | None = None,
                      inter_node_gbps: float | None = None) -> Cluster:
    """Load ``spec`` and apply the CLI overrides (``--inter-node-gbps`` is a NIC's line rate in Gb/s)."""
    cluster = load_cluster(spec)
    inter = inter_node_gbps * 1e9 / 8 if inter_node_gbps is not None else None
    if gpus is not None and gpus < 1:
        raise ClusterSpecError("--gpus must be >= 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ClusterSpecError("--gpus-per-node must be >= 1")
    return cluster.with_overrides(gpus=gpus, gpus_per_node=gpus_per_node, inter_node_bandwidth_bytes_per_s=inter)


__all__ = ["FABRICS", "FLASH_KERNELS", "PRESETS", "PROTOCOLS", "AttentionTable", "AxisLink", "Cluster", "GiB",
           "MeshSpec", "axis_link", "cluster_from_args", "load_cluster", "mesh_links"]
