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
import math
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from autopar.errors import ClusterSpecError
from autopar.units import GiB

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS = ("a100-80gb", "h100-80gb", "h200", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """A homogeneous GPU cluster: nodes of ``gpus_per_node`` devices on a switched fabric."""

    name: str
    device: str
    """Device model, for display."""
    gpus: int
    """Number of devices in the cluster."""
    gpus_per_node: int
    """Devices that share the fast intra-node fabric (NVLink/NVSwitch)."""
    peak_flops: float
    """Peak dense 16-bit tensor-core FLOP/s per device."""
    hbm_bytes: float
    """Device memory per device, bytes."""
    hbm_bandwidth_bytes_per_s: float
    """Device-memory bandwidth per device."""
    intra_node_bandwidth_bytes_per_s: float
    """Per-device, per-direction bandwidth of the intra-node fabric."""
    inter_node_bandwidth_bytes_per_s: float
    """Per-device, per-direction network bandwidth between nodes (one NIC per GPU on DGX systems)."""
    intra_node_latency_s: float
    """Latency of one hop of a collective inside a node."""
    inter_node_latency_s: float
    """Latency of one hop of a collective across nodes."""
    gemm_efficiency: float
    """Fraction of ``peak_flops`` reached by large matrix multiplies (cuBLAS)."""
    attention_efficiency: float
    """Fraction of ``peak_flops`` reached by fused (flash) attention kernels."""
    memory_efficiency: float
    """Fraction of HBM bandwidth reached by memory-bound (element-wise, norm, softmax) kernels."""
    intra_node_collective_efficiency: float
    """NCCL bus bandwidth inside a node as a fraction of the intra-node link bandwidth."""
    inter_node_collective_efficiency: float
    """NCCL bus bandwidth across nodes as a fraction of the NIC line rate."""
    kernel_overhead_s: float
    """Fixed cost per launched kernel (launch latency and tail), added to every op."""
    overlap_slowdown: float
    """Fraction by which compute slows while a collective runs beside it (NCCL kernels occupy SMs and
    memory bandwidth), so overlapped communication is never entirely free."""
    memory_reserve_bytes: float
    """Device memory not available to the plan (CUDA context, NCCL buffers, allocator fragmentation)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "device"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ClusterSpecError(f"cluster {self.name}: {f.name} must be a non-negative number, got {value!r}")
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ClusterSpecError(f"cluster {self.name}: gpus and gpus_per_node must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ClusterSpecError(
                f"cluster {self.name}: gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")
        for f in ("gemm_efficiency", "attention_efficiency", "memory_efficiency",
                  "intra_node_collective_efficiency", "inter_node_collective_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ClusterSpecError(f"cluster {self.name}: {f} must be in (0, 1]")
        if not 0 <= self.overlap_slowdown < 1:
            raise ClusterSpecError(f"cluster {self.name}: overlap_slowdown must be in [0, 1)")

    @property
    def num_nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def usable_memory_bytes(self) -> float:
        """Per-device memory a plan may use: HBM minus the reserve."""
        return self.hbm_bytes - self.memory_reserve_bytes

    def with_overrides(self, **overrides: Any) -> Cluster:
        """A copy with some fields replaced (``None`` values are ignored)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "gpus" in changes and "gpus_per_node" not in changes and changes["gpus"] < self.gpus_per_node:
            changes["gpus_per_node"] = changes["gpus"]
        try:
            return dataclasses.replace(self, **changes)
        except TypeError as exc:
            raise ClusterSpecError(str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class AxisLink:
    """What one mesh axis runs on: its size, ranks per node and effective bandwidths/latency."""

    size: int
    ranks_per_node: int
    bus_bandwidth_bytes_per_s: float
    latency_s: float
    intra_bandwidth_bytes_per_s: float
    nic_bandwidth_bytes_per_s: float
    launch_s: float = 0.0  # fixed cost of issuing one collective (a kernel launch)

    @property
    def crosses_nodes(self) -> bool:
        return self.ranks_per_node < self.size


def axis_link(cluster: Cluster, size: int, stride: int) -> AxisLink:
    """The link of a mesh axis of ``size`` ranks spaced ``stride`` apart on ``cluster``."""
    if size < 1 or stride < 1:
        raise ValueError("mesh axis size and stride must be >= 1")
    gpn = cluster.gpus_per_node
    per_node = 1 if stride >= gpn else max(1, min(size, gpn // stride))
    intra = cluster.intra_node_bandwidth_bytes_per_s * cluster.intra_node_collective_efficiency
    nic = cluster.inter_node_bandwidth_bytes_per_s * cluster.inter_node_collective_efficiency
    launch = cluster.kernel_overhead_s
    if per_node >= size:
        return AxisLink(size, size, intra, cluster.intra_node_latency_s, intra, nic, launch)
    return AxisLink(size, per_node, min(intra, per_node * nic), cluster.inter_node_latency_s, intra, nic, launch)


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
    if spec in PRESETS:
        text = resources.files("autopar").joinpath("clusters", f"{spec}.toml").read_text()
        return _from_toml(text, default_name=spec, origin=f"preset {spec}")
    path = Path(spec)
    if not path.is_file():
        raise ClusterSpecError(f"unknown cluster {spec!r}: not a preset ({', '.join(PRESETS)}) nor a TOML file")
    return _from_toml(path.read_text(), default_name=path.stem, origin=str(path))


def _from_toml(text: str, default_name: str, origin: str) -> Cluster:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterSpecError(f"{origin}: invalid TOML: {exc}") from exc
    base = data.pop("base", None)
    values: dict[str, Any] = {}
    if base is not None:
        if base not in PRESETS:
            raise ClusterSpecError(f"{origin}: unknown base preset {base!r} (presets: {', '.join(PRESETS)})")
        values = load_cluster(base).to_dict()
        values["name"] = default_name
    unknown = sorted(set(data) - _FIELD_NAMES)
    if unknown:
        raise ClusterSpecError(f"{origin}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(_FIELD_NAMES))})")
    values.update(data)
    values.setdefault("name", default_name)
    missing = sorted(_FIELD_NAMES - set(values))
    if missing:
        raise ClusterSpecError(f"{origin}: missing key {missing[0]!r}")
    for key in ("gpus", "gpus_per_node"):
        if isinstance(values[key], float) and values[key].is_integer():
            values[key] = int(values[key])
        if not isinstance(values[key], int):
            raise ClusterSpecError(f"{origin}: {key} must be an integer")
    return Cluster(**values)


def cluster_from_args(spec: str, gpus: int | None = None, gpus_per_node: int | None = None,
                      inter_node_gbps: float | None = None) -> Cluster:
    """Load ``spec`` and apply the CLI overrides (``--inter-node-gbps`` is a NIC line rate in Gb/s)."""
    cluster = load_cluster(spec)
    inter = inter_node_gbps * 1e9 / 8 if inter_node_gbps is not None else None
    if gpus is not None and gpus < 1:
        raise ClusterSpecError("--gpus must be >= 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ClusterSpecError("--gpus-per-node must be >= 1")
    return cluster.with_overrides(gpus=gpus, gpus_per_node=gpus_per_node, inter_node_bandwidth_bytes_per_s=inter)


__all__ = ["PRESETS", "AxisLink", "Cluster", "GiB", "MeshSpec", "axis_link", "cluster_from_args", "load_cluster",
           "mesh_links"]
