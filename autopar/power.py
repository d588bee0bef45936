"""The SM clock a training step holds under the device's power cap.

Kernel benchmarks run in bursts: mamf-finder flushes L2 between products and the attention papers time a few
calls, so the board stays under its cap and the SMs run at their boost clock.  A training step runs its kernels
back to back for seconds, and its power, averaged over the power manager's window (milliseconds: a layer's
forward or backward), must stay under the cap.  So the clock depends on what runs:

- **dense 16-bit products** draw the most.  At the cap they hold ``loaded_clock_hz`` (DeepGEMM#120: 1575 MHz on
  Hopper; flashinfer PR #2899: 1580 MHz on B200; A100's HPL: 1305 MHz), so at the boost clock they would draw
  ``(boost / loaded)^3`` of the dynamic power budget (``power_cap_w - idle_power_w``): dynamic power goes as
  ``C V^2 f`` and the voltage follows the clock across the DVFS range, so as ``f^3``;
- **FP8 products** hold the boost clock on their own ("from 1980MHz to 1575 MHz" only once communication joined
  them, DeepGEMM#120): at most the whole budget;
- **attention** kernels keep their tensor cores busy a smaller share of the time than products: they draw the
  products' power in proportion to their share of peak;
- **memory-bound** kernels lower the SM clock's share of the power: they draw ``memory_bound_power_w`` (a
  memory-bound H200 workload draws 137-300 W of its 700 W, arXiv 2605.11999) whatever the SM clock, and keep
  their HBM bandwidth;
- **communication** beside them adds the power of its links and its HBM traffic: a collective at the full rate
  of the intra-node fabric takes the share that drops FP8 products from the boost clock to ``loaded_clock_hz``
  (DeepGEMM#120), one at a fraction of that rate that fraction of it.

Each of these draws is in watts what the chip draws at that clock, observed at the cap the preset's figures come
from (``loaded_clock_power_w``).  The same chip capped lower (Grand Teton's H100s at 500 W; any ``power_cap_w``
override) has a smaller budget for the same draws, so it holds a lower clock: 16-bit products at
``loaded * (budget / observed budget)^(1/3)``, the ``f^3`` rule the GB200 preset's clock is derived by.

With ``S`` seconds of tensor-core kernels at the boost clock drawing ``T`` (seconds times their demand, in units
of the budget), ``t_m`` seconds of memory-bound kernels drawing ``w_m`` and communication drawing ``w_c``, the
window's average power is at the cap when the clock is the fraction ``phi`` of the boost clock with::

    T phi^3 - (1 - w_m - w_c) t_m phi - (1 - w_c) S = 0

and below it (``phi = 1``) when the left side is negative at ``phi = 1``.  Tensor-core kernels then take
``1 / phi`` of their boost-clock time; memory-bound kernels keep theirs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.cluster import Cluster


@dataclass(frozen=True, slots=True)
class PowerMix:
    """A window of kernels at the boost clock: tensor-core time, its power demand (seconds times each kernel's
    draw as a share of the dynamic budget) and memory-bound time."""

    tensor_s: float = 0.0
    demand_s: float = 0.0
    memory_s: float = 0.0

    def __add__(self, other: PowerMix) -> PowerMix:
        return PowerMix(self.tensor_s + other.tensor_s, self.demand_s + other.demand_s, self.memory_s + other.memory_s)

    def scaled(self, factor: float) -> PowerMix:
        return PowerMix(self.tensor_s * factor, self.demand_s * factor, self.memory_s * factor)


def budget_w(cluster: Cluster) -> float:
    """The dynamic power budget: the cap less the idle draw."""
    return max(1e-9, cluster.power_cap_w - cluster.idle_power_w)


def _observed_budget_share(cluster: Cluster) -> float:
    """The dynamic budget at the cap ``loaded_clock_hz`` was observed at, over this cluster's: 1 at the preset's
    own cap; above 1 under a lower one (``power_cap_w`` overridden), where a kernel draws the watts it draws at
    that clock whatever the cap, a larger share of the smaller budget."""
    observed = (cluster.loaded_clock_power_w or cluster.power_cap_w) - cluster.idle_power_w
    return max(1e-9, observed) / budget_w(cluster)


def product_demand(cluster: Cluster, fp8: bool = False) -> float:
    """A dense product's draw at the boost clock, as a share of the budget: ``(boost / loaded)^3`` of the budget
    ``loaded_clock_hz`` was observed at for 16-bit products, which that cap holds at ``loaded_clock_hz``; all of it
    for FP8 ones, which hold the boost clock there."""
    observed = _observed_budget_share(cluster)
    if fp8:
        return observed
    return (cluster.boost_clock_hz / cluster.loaded_clock_hz) ** 3 * observed


def tensor_demand(cluster: Cluster, peak_share: float) -> float:
    """The draw of a tensor-core kernel running at ``peak_share`` of ``peak_flops`` (attention): the 16-bit
    products' draw in proportion to their share of peak (``gemm_efficiency``)."""
    return product_demand(cluster) * min(1.0, peak_share / cluster.gemm_efficiency)


def memory_demand(cluster: Cluster) -> float:
    """What a memory-bound kernel draws, as a share of the budget."""
    return max(0.0, cluster.memory_bound_power_w - cluster.idle_power_w) / budget_w(cluster)


def comm_demand(cluster: Cluster, comm_bytes_per_s: float) -> float:
    """What a collective moving ``comm_bytes_per_s`` per GPU draws, as a share of the budget: at the full rate of
    the intra-node fabric, ``1 - (loaded / boost)^3`` (it drops FP8 products from the boost clock to
    ``loaded_clock_hz``)."""
    if comm_bytes_per_s <= 0:
        return 0.0
    full = cluster.intra_node_bandwidth_bytes_per_s * cluster.intra_node_collective_efficiency
    share = min(1.0, comm_bytes_per_s / full)
    return share * (1.0 - (cluster.loaded_clock_hz / cluster.boost_clock_hz) ** 3) * _observed_budget_share(cluster)


def clock_fraction(cluster: Cluster, mix: PowerMix, comm_bytes_per_s: float = 0.0) -> float:
    """The SM clock a window of ``mix`` holds (with a collective at ``comm_bytes_per_s`` beside it), over the boost
    clock."""
    return _solve(mix.tensor_s, mix.demand_s, mix.memory_s, memory_demand(cluster),
                  comm_demand(cluster, comm_bytes_per_s))


@functools.lru_cache(maxsize=65536)
def _solve(tensor_s: float, demand_s: float, memory_s: float, w_m: float, w_c: float) -> float:
    if tensor_s <= 0 or demand_s <= 0:
        return 1.0
    a, b, c = demand_s, (1.0 - w_m - w_c) * memory_s, (1.0 - w_c) * tensor_s

    def g(phi: float) -> float:
        return a * phi ** 3 - b * phi - c

    if g(1.0) <= 0:
        return 1.0
    lo, hi = 0.0, 1.0  # g(0) = -c < 0 < g(1): one root between
    for _ in range(50):
        mid = (lo + hi) / 2
        if g(mid) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


#: A window with nothing in it.
NO_POWER = PowerMix()

__all__ = ["NO_POWER", "PowerMix", "budget_w", "clock_fraction", "comm_demand", "memory_demand", "product_demand",
           "tensor_demand"]
