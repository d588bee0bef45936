"""What a plan costs to train on: time with failures, GPU-hours, money and energy.

Every input is a parameter with a sourced default, never a constant hidden in a formula:

- **Prices** come only from a user's TOML (``--prices``); ``examples/prices.toml`` holds dated public list prices.
- **Power**: each GPU draws ``idle_power_w + (power_cap_w - idle_power_w) x busy``, with both figures and the
  node's own draw beyond its GPUs (``node_overhead_w``) from the cluster spec, whose comments cite them; ``busy``
  is the plan's share of the iteration its GPUs compute (``compute_s + recompute_s`` of the estimate's
  breakdown).  The facility's PUE multiplies it all.
- **Failures** (``Reliability``): interruptions arrive at a rate per GPU; each loses the work since the last
  checkpoint (half an interval on average) and a restart.  Saving a checkpoint blocks the training for its size
  over the storage bandwidth.  With the checkpoint interval ``tau``, save time ``delta``, restart ``R`` and the
  cluster's interruption rate ``lam = N x rate``, the wall time of ``T`` seconds of training is
  ``T (1 + delta / tau) / (1 - lam (tau / 2 + R))``; ``tau`` defaults to Young's optimum ``sqrt(2 delta / lam)``
  (J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: Llama 3 (arXiv 2407.21783, sec. 3.3.4): "419 were unexpected interruptions" in "a 54-day snapshot period of
#: pre-training" on 16,384 H100s.
LLAMA3_INTERRUPTIONS_PER_GPU_DAY = 419 / (54 * 16384)
#: ByteDance MegaScale (NSDI 2024, arXiv 2402.15627): "executing diagnostic tests is less than 10 minutes", and the
#: job is back at its pre-crash progress "within 15 minutes from the latest checkpoints" (which includes redoing
#: the work since the checkpoint, counted apart here): 10 minutes to detect, diagnose and restart.
MEGASCALE_RESTART_S = 600.0
#: Llama 3 (sec. 3.3.1): Tectonic "supports a sustainable throughput of 2 TB/s" for the 16,384 GPUs' checkpoints,
#: 122 MB/s per GPU.
LLAMA3_CHECKPOINT_BYTES_PER_S_PER_GPU = 2e12 / 16384
#: What a checkpoint holds per parameter: fp32 weights and AdamW's two fp32 moments, as DCP saves the optimizer's
#: state dict (bf16 copies are not saved).
CHECKPOINT_BYTES_PER_PARAM = 12
#: Google 2024 Environmental Report: "In 2023, the average annual power usage effectiveness for our data centers
#: was 1.10 compared with the industry average of 1.58".
GOOGLE_2023_PUE = 1.10


@dataclass(frozen=True, slots=True)
class Prices:
    """Prices per GPU-hour by cluster name (``--prices FILE``), in ``currency``."""

    per_gpu_hour: dict[str, float]
    currency: str
    source: str

    def of(self, cluster: str) -> float:
        """The price of one GPU-hour on ``cluster``; an error naming the file when it has none."""
        if cluster not in self.per_gpu_hour:
            raise AutoparError(f"price file {self.source} has no price for {cluster} (add {cluster} = PRICE under "
                               "[per_gpu_hour])")
        return self.per_gpu_hour[cluster]


def load_prices(path: str | Path) -> Prices:
    """Read a price file: ``currency = "USD"`` and a ``[per_gpu_hour]`` table of cluster name -> price."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise AutoparError(f"cannot read price file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise AutoparError(f"price file {path} is not valid TOML: {exc}") from exc
    table = data.get("per_gpu_hour")
    if not isinstance(table, dict) or not table:
        raise AutoparError(f"price file {path} has no [per_gpu_hour] table of cluster = price")
    prices = {}
    for name, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise AutoparError(f"price file {path}: the price of {name} must be a number >= 0, not {value!r}")
        prices[name] = float(value)
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not currency:
        raise AutoparError(f"price file {path}: currency must be a string such as \"USD\"")
    return Prices(prices, currency, str(path))


@dataclass(frozen=True, slots=True)
class Power:
    """The facility: its PUE, and a node's draw beyond its GPUs (``None``: the cluster spec's)."""

    pue: float = GOOGLE_2023_PUE
    node_overhead_w: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.pue) and self.pue >= 1):
            raise AutoparError(f"--pue must be >= 1, not {self.pue}")
        if self.node_overhead_w is not None and not (math.isfinite(self.node_overhead_w) and
                                                     self.node_overhead_w >= 0):
            raise AutoparError(f"--node-overhead-w must be >= 0, not {self.node_overhead_w}")

    def cluster_w(self, cluster: Cluster, gpus: int, busy: float) -> float:
        """The facility's draw for ``gpus`` devices of ``cluster`` computing ``busy`` of the time."""
        gpu_w = cluster.idle_power_w + (cluster.power_cap_w - cluster.idle_power_w) * min(1.0, max(0.0, busy))
        overhead = cluster.node_overhead_w if self.node_overhead_w is None else self.node_overhead_w
        nodes = math.ceil(gpus / cluster.gpus_per_node)
        return (gpus * gpu_w + nodes * overhead) * self.pue


@dataclass(frozen=True, slots=True)
class Reliability:
    """Interruptions and checkpoints (defaults: Llama 3's interruption rate and storage, MegaScale's restart)."""

    interruptions_per_gpu_day: float = LLAMA3_INTERRUPTIONS_PER_GPU_DAY
    restart_s: float = MEGASCALE_RESTART_S
    checkpoint_bytes_per_s_per_gpu: float = LLAMA3_CHECKPOINT_BYTES_PER_S_PER_GPU
    checkpoint_every_s: float | None = None
    """``None``: Young's optimum for the point."""

    def __post_init__(self) -> None:
        for name in ("interruptions_per_gpu_day", "restart_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise AutoparError(f"{name.replace('_', '-')} must be >= 0, not {value}")
        if not (math.isfinite(self.checkpoint_bytes_per_s_per_gpu) and self.checkpoint_bytes_per_s_per_gpu > 0):
            raise AutoparError("the checkpoint write bandwidth must be positive")
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise AutoparError("the checkpoint interval must be positive")

    def goodput(self, gpus: int, parameters: float) -> Goodput:
        """The share of the wall time that trains, for a job on ``gpus`` devices of a ``parameters`` model."""
        save_s = parameters * CHECKPOINT_BYTES_PER_PARAM / (self.checkpoint_bytes_per_s_per_gpu * gpus)
        rate_per_s = gpus * self.interruptions_per_gpu_day / 86400.0
        if rate_per_s <= 0:
            every = self.checkpoint_every_s or math.inf
            return Goodput(1.0 / (1.0 + save_s / every) if math.isfinite(every) else 1.0, every, save_s, math.inf)
        every = self.checkpoint_every_s or math.sqrt(2.0 * save_s / rate_per_s)
        lost = rate_per_s * (every / 2.0 + self.restart_s)
        fraction = (1.0 - lost) / (1.0 + save_s / every) if lost < 1.0 else 0.0
        return Goodput(fraction, every, save_s, 1.0 / rate_per_s)


@dataclass(frozen=True, slots=True)
class Goodput:
    fraction: float
    """Of the wall time, the share that trains (0: interruptions come faster than the job recovers)."""
    checkpoint_every_s: float
    checkpoint_save_s: float
    mtbf_s: float
    """The mean time between interruptions of the whole job."""


def point_economics(estimate: dict[str, Any], cluster: Cluster, gpus: int, tokens: float, parameters: float,
                    prices: Prices | None, power: Power, reliability: Reliability) -> dict[str, Any]:
    """A plan's estimate (``Estimate.to_dict()``) turned into what training ``tokens`` on it takes."""
    breakdown = estimate["breakdown"]
    iteration = estimate["iteration_time_s"]
    busy = (breakdown.get("compute_s", 0.0) + breakdown.get("recompute_s", 0.0)) / iteration
    train_s = tokens / estimate["tokens_per_s"]
    good = reliability.goodput(gpus, parameters)
    wall_s = train_s / good.fraction if good.fraction > 0 else math.inf
    restarts = wall_s / good.mtbf_s if math.isfinite(good.mtbf_s) else 0.0
    restart_s = min(wall_s, restarts * reliability.restart_s)
    energy_j = power.cluster_w(cluster, gpus, busy) * (wall_s - restart_s) + power.cluster_w(cluster, gpus, 0.0) \
        * restart_s
    if not math.isfinite(wall_s):
        return {"busy_fraction": busy, "train_s": train_s, "wall_s": None, "goodput": 0.0}
    gpu_hours = gpus * wall_s / 3600.0
    return {
        "busy_fraction": busy, "train_s": train_s, "wall_s": wall_s, "goodput": good.fraction,
        "checkpoint_every_s": good.checkpoint_every_s if math.isfinite(good.checkpoint_every_s) else None,
        "checkpoint_save_s": good.checkpoint_save_s,
        "interruptions": restarts, "gpu_hours": gpu_hours,
        "cost": gpu_hours * prices.of(cluster.name) if prices is not None else None,
        "energy_kwh": energy_j / 3.6e6,
    }


__all__ = ["CHECKPOINT_BYTES_PER_PARAM", "GOOGLE_2023_PUE", "LLAMA3_CHECKPOINT_BYTES_PER_S_PER_GPU",
           "LLAMA3_INTERRUPTIONS_PER_GPU_DAY", "MEGASCALE_RESTART_S", "Goodput", "Power", "Prices", "Reliability",
           "load_prices", "point_economics"]
