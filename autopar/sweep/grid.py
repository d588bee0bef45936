"""The points of a sweep: every GPU type at every GPU count it can take."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster


@dataclass(frozen=True, slots=True)
class Point:
    """One cluster of a sweep: ``gpus`` devices of the cluster ``cluster`` (a preset name or TOML path), the
    count nearest those asked (``asked``) that the cluster can be built with."""

    cluster: str
    gpus: int
    asked: tuple[int, ...]

    @property
    def rounded(self) -> bool:
        return self.asked != (self.gpus,)

    @property
    def key(self) -> str:
        """A name for files: ``h100-80gb-1024``."""
        name = self.cluster.rsplit("/", 1)[-1].removesuffix(".toml")
        return f"{name}-{self.gpus}"


def nearest_gpus(cluster: Cluster, asked: int) -> int:
    """The GPU count nearest ``asked`` that ``cluster`` can be built with: up to a node, any count; up to an NVLink
    domain, whole nodes; beyond it, whole domains (a GB200 NVL72 comes in racks of 72).  A tie goes up."""
    node, domain = cluster.gpus_per_node, cluster.nvlink_domain
    if asked <= node:
        return asked
    unit = node if asked <= domain else domain
    low = max(unit, asked // unit * unit)
    high = low + unit
    return low if asked - low < high - asked else high


def sweep_points(clusters: dict[str, Cluster], counts: list[int]) -> list[Point]:
    """Each cluster (name as given -> its spec) at each of ``counts``, rounded to what it can take; counts that
    round to the same one make one point."""
    points = []
    for name, cluster in clusters.items():
        by_gpus: dict[int, list[int]] = {}
        for asked in counts:
            by_gpus.setdefault(nearest_gpus(cluster, asked), []).append(asked)
        points += [Point(name, gpus, tuple(asked)) for gpus, asked in sorted(by_gpus.items())]
    return points


__all__ = ["Point", "nearest_gpus", "sweep_points"]
