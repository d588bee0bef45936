r"""Stage construction: split a chain of layer units into contiguous pipeline stages.  No torch here.

Alpa's inter-op dynamic program chooses stage boundaries and submeshes to minimize
``sum_i t_i + (m - 1) * t_max``, enumerating ``t_max``.  autopar gives every stage the same submesh
(a ``dp x tp`` slice of the mesh), so ``sum_i t_i`` is the same for every split and the objective
reduces to minimizing ``t_max``; the DP below finds that split exactly, uneven stages allowed, with the
per-stage memory limit as a hard constraint::

    f[k][j] = min over i < j of max(f[k-1][i], time(i..j))   subject to   memory_k(i..j) <= budget

``time(i..j)`` and ``memory_k(i..j)`` come from prefix sums: stage ``k`` holding units ``i..j-1`` costs
``sum time`` and needs ``stage_memory_bytes`` of them.
"""

from __future__ import annotations

import functools
import math
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


def stage_memory_bytes(state_bytes: list[float], activation_bytes: list[float], extra_bytes: list[float],
                       in_flight: float, after_bytes: list[float] | None = None) -> float:
    """Peak memory of a stage running these units (in order), ``in_flight`` micro-batches deep.

    Every unit's state, the saved activations of the other ``in_flight - 1`` micro-batches, and, for the
    micro-batch at hand, the worst moment of its pass: while unit ``k`` runs (its forward, or its backward
    with any recomputation) the activations of units ``<= k`` are held, plus ``extra_bytes[k]``; those of
    the units after ``k`` are not yet made in forward and already freed in backward.  So a layer's
    recomputation never coexists with the head's saved logits of the same micro-batch.  ``after_bytes[k]``: what
    unit ``k`` holds once the micro-batch's backward is over and its activations are freed (a training loop's
    metrics over the logits).
    """
    peak, held = max(after_bytes or [0.0]), 0.0
    for act, extra in zip(activation_bytes, extra_bytes, strict=True):
        held += act
        peak = max(peak, held + extra)
    return sum(state_bytes) + (in_flight - 1) * sum(activation_bytes) + peak


def split_stages(time_s: list[float], state_bytes: list[float], activation_bytes: list[float],
                 in_flight: list[float], budget_bytes: float, extra_bytes: list[float] | None = None,
                 after_bytes: list[float] | None = None) -> StageSplit | None:
    """Best split of ``len(time_s)`` units into ``len(in_flight)`` non-empty stages; ``None`` if none fits.

    ``extra_bytes[u]``: memory unit ``u`` needs on top while it runs (e.g. a recomputed layer's
    activations); ``after_bytes[u]``: what it holds after the backward; a stage needs ``stage_memory_bytes``.
    """
    n, p = len(time_s), len(in_flight)
    if p > n:
        return None
    t = np.concatenate([[0.0], np.cumsum(time_s)])
    s = np.concatenate([[0.0], np.cumsum(state_bytes)])
    a = np.concatenate([[0.0], np.cumsum(activation_bytes)])
    extra = np.asarray(extra_bytes if extra_bytes is not None else [0.0] * n, dtype=float)
    # peak[i, j] = max over k in [i, j) of (a[k+1] + extra[k]) - a[i]: the worst moment of one micro-batch's
    # pass (``stage_memory_bytes``), from a running max along each row of the upper triangle
    i_idx, j_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    table = np.where(j_idx[:n, :n] >= i_idx[:n, :n], (a[1:] + extra)[None, :], -np.inf)
    peak = np.zeros((n + 1, n + 1))
    peak[:n, 1:] = np.maximum(np.maximum.accumulate(table, axis=1) - a[:n, None], 0.0)
    if after_bytes is not None and any(after_bytes):
        after = np.where(j_idx[:n, :n] >= i_idx[:n, :n], np.asarray(after_bytes, dtype=float)[None, :], 0.0)
        peak[:n, 1:] = np.maximum(peak[:n, 1:], np.maximum.accumulate(after, axis=1))
    valid = j_idx > i_idx
    cost = np.where(valid, t[j_idx] - t[i_idx], np.inf)
    inf = np.inf
    f = np.full((p + 1, n + 1), inf)
    arg = np.zeros((p + 1, n + 1), dtype=int)
    f[0, 0] = 0.0
    for k in range(1, p + 1):
        mem = s[j_idx] - s[i_idx] + (in_flight[k - 1] - 1) * (a[j_idx] - a[i_idx]) + peak
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
    mems = tuple(float(s[bounds[k + 1]] - s[bounds[k]] + (in_flight[k] - 1) * (a[bounds[k + 1]] - a[bounds[k]])
                       + peak[bounds[k], bounds[k + 1]]) for k in range(p))
    return StageSplit(tuple(bounds), times, mems)


@dataclass(frozen=True, slots=True)
class UnitLoad:
    """What one unit costs a stage: time per micro-batch, state, activations per micro-batch, extra peak."""

    time_s: float
    state_bytes: float
    activation_bytes: float
    extra_bytes: float = 0.0
    after_bytes: float = 0.0  # held after the micro-batch's backward, when its activations are freed


@functools.lru_cache(maxsize=65536)
def split_uniform_stages(pre: UnitLoad, layer: UnitLoad, post: UnitLoad, num_layers: int,
                         in_flight: tuple[float, ...], budget_bytes: float) -> StageSplit | None:
    """``split_stages`` for the common chain ``pre, layer x L, post`` with identical layers, in O(p log L).

    Stage ``k`` holding ``n_k >= 1`` layers costs ``n_k * t + [k = 0] t_pre + [k = p-1] t_post``; for a
    target ``T`` each stage takes at most ``cap_k(T)`` layers (by time and by memory), and ``T`` is feasible
    when ``sum_k cap_k(T) >= L``.  The least feasible ``T`` is found by bisection over the ``O(L)`` values
    it can take; the layers are then dealt out within the caps.  Plain Python (the arrays are a few dozen
    long) and memoized: the search asks for the same split under many schedules.
    """
    p, n_layers = len(in_flight), num_layers
    if p > n_layers or n_layers < 1:
        return None

    def memory(k: int, n: int) -> float:
        """``stage_memory_bytes`` of stage ``k`` with ``n`` layers, in closed form (the search calls it for
        every layout): the layers' worst moment is the last one's, as activations only grow."""
        first, last = (pre if k == 0 else None), (post if k == p - 1 else None)
        a_first = first.activation_bytes if first else 0.0
        held = a_first + n * layer.activation_bytes
        peak = max(0.0, a_first + first.extra_bytes if first else 0.0, held + layer.extra_bytes if n else 0.0,
                   first.after_bytes if first else 0.0, layer.after_bytes if n else 0.0)
        state = n * layer.state_bytes
        if first:
            state += first.state_bytes
        if last:
            held += last.activation_bytes
            peak = max(peak, held + last.extra_bytes, last.after_bytes)
            state += last.state_bytes
        return state + (in_flight[k] - 1) * held + peak

    fixed_t = [(pre.time_s if k == 0 else 0.0) + (post.time_s if k == p - 1 else 0.0) for k in range(p)]

    def mem_cap(k: int) -> int:
        """The most layers stage ``k`` can hold (its memory grows with every layer): in closed form for a
        stage of layers only (``n (state + in_flight * act) + extra``), else by bisection."""
        if memory(k, 0) > budget_bytes:
            return 0
        per_layer = layer.state_bytes + in_flight[k] * layer.activation_bytes
        if 0 < k < p - 1 and per_layer > 0:
            n = int(min(n_layers, max(0.0, (budget_bytes - layer.extra_bytes) / per_layer)))
            while n > 0 and memory(k, n) > budget_bytes:  # rounding: settle on the exact cap
                n -= 1
            while n < n_layers and memory(k, n + 1) <= budget_bytes:
                n += 1
            return n
        lo, hi = 0, n_layers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if memory(k, mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    mem_caps = [mem_cap(k) for k in range(p)]
    if min(mem_caps) < 1 or sum(mem_caps) < n_layers:
        return None  # no time target helps: the memory caps alone leave a stage empty or a layer out

    def caps(t_max: float) -> list[int]:
        out = []
        for fixed, cap in zip(fixed_t, mem_caps, strict=True):
            slack = t_max - fixed
            if slack < 0:
                n_time = 0
            elif layer.time_s <= 0:
                n_time = n_layers
            else:
                n_time = math.floor(slack / layer.time_s + 1e-9)
            out.append(min(n_time, cap))
        return out

    def feasible(t_max: float) -> bool:
        c = caps(t_max)
        return min(c) >= 1 and sum(c) >= n_layers

    candidates = sorted({f + layer.time_s * n for f in set(fixed_t) for n in range(1, n_layers + 1)})
    if not feasible(candidates[-1]):
        return None
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    c = caps(candidates[lo])
    counts = [1] * p  # every stage gets one layer, then fill the stages in order up to their caps
    left = n_layers - p
    for k in range(p):
        take = min(left, c[k] - 1)
        counts[k] += take
        left -= take
    bounds = [0]
    for k in range(p):
        bounds.append(bounds[-1] + counts[k] + (1 if k == 0 else 0))
    bounds[-1] += 1  # post
    times = [fixed_t[k] + counts[k] * layer.time_s for k in range(p)]
    mems = [memory(k, counts[k]) for k in range(p)]
    return StageSplit(tuple(bounds), tuple(times), tuple(mems))
