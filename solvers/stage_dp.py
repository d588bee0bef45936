r"""Stage construction: split a chain of layer units into contiguous pipeline stages.  No torch here.

Alpa's inter-op dynamic program chooses stage boundaries and submeshes to minimize
``sum_i t_i + (m - 1) * t_max``, enumerating ``t_max``.  autopar gives every stage the same submesh
(a ``dp x tp`` slice of the mesh), so ``sum_i t_i`` is the same for every split and the objective
reduces to minimizing ``t_max``; the DP below finds that split exactly, uneven stages allowed, with the
per-stage memory limit as a hard constraint::

    f[k][j] = min over i < j of max(f[k-1][i], time(i..j))   subject to   memory_k(i..j) <= budget

``time(i..j)`` and ``memory_k(i..j)`` come from prefix sums: stage ``k`` holding units ``i..j-1`` costs
``sum time`` and needs ``sum state + in_flight[k] * sum activation (+ peak extra)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StageSplit:
    boundaries: tuple[int, ...]  # unit index where each stage starts, plus the end
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1


def split_stages(time_s: list[float], state_bytes: list[float], activation_bytes: list[float],
                 in_flight: list[float], budget_bytes: float, extra_bytes: list[float] | None = None,
                 ) -> StageSplit | None:
    """Best split of ``len(time_s)`` units into ``len(in_flight)`` non-empty stages; ``None`` if none fits.

    ``extra_bytes[u]``: memory unit ``u`` needs on top while it runs (e.g. a recomputed layer's
    activations); a stage needs the largest of its units'.
    """
    n, p = len(time_s), len(in_flight)
    if p > n:
        return None
    t = np.concatenate([[0.0], np.cumsum(time_s)])
    s = np.concatenate([[0.0], np.cumsum(state_bytes)])
    a = np.concatenate([[0.0], np.cumsum(activation_bytes)])
    extra = np.asarray(extra_bytes if extra_bytes is not None else [0.0] * n, dtype=float)
    # peak extra of units i..j-1: a running max table (n is small: layers of one model)
    peak = np.zeros((n + 1, n + 1))
    for i in range(n):
        peak[i, i + 1:] = np.maximum.accumulate(extra[i:])
    i_idx, j_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = j_idx > i_idx
    cost = np.where(valid, t[j_idx] - t[i_idx], np.inf)
    inf = np.inf
    f = np.full((p + 1, n + 1), inf)
    arg = np.zeros((p + 1, n + 1), dtype=int)
    f[0, 0] = 0.0
    for k in range(1, p + 1):
        mem = s[j_idx] - s[i_idx] + in_flight[k - 1] * (a[j_idx] - a[i_idx]) + peak
        ok = valid & (mem <= budget_bytes)
        cand = np.where(ok, np.maximum(f[k - 1][:, None], cost), inf)
        arg[k] = np.argmin(cand, axis=0)
        f[k] = cand[arg[k], np.arange(n + 1)]
    if not np.isfinite(f[p, n]):
        return None
    bounds = [n]
    j = n
    for k in range(p, 0, -1):
        j = int(arg[k, j])
        bounds.append(j)
    bounds.reverse()
    times = tuple(float(t[bounds[k + 1]] - t[bounds[k]]) for k in range(p))
    mems = tuple(float(s[bounds[k + 1]] - s[bounds[k]] + in_flight[k] * (a[bounds[k + 1]] - a[bounds[k]])
                       + peak[bounds[k], bounds[k + 1]]) for k in range(p))
    return StageSplit(tuple(bounds), times, mems)
