"""Pipeline schedule arithmetic: bubble and in-flight micro-batches per stage.  No torch here.

With ``p`` stages, ``m`` micro-batches, per-micro-batch stage times ``t_i`` and ``v`` virtual stages
(model chunks) per device:

- iteration time ``m * t_max + (sum_i t_i - t_max) / v``: ``m`` slots of the slowest stage plus the
  warm-up/cool-down bubble, which interleaving divides by ``v`` (Narayanan et al. 2021, sec. 2.2).  For
  ``v = 1`` this is Alpa's ``sum_i t_i + (m - 1) * t_max``.  Interleaving cannot beat one micro-batch's
  own path through every chunk: with fewer micro-batches than stages (``m < p``) the pipeline never
  fills, and the time is ``sum_i t_i + (m - 1) * t_max / v`` for equal stages; for unequal ones the
  estimate runs ``simulate_pipeline`` there, as ``autopar.timeline`` does.  The closed forms are exact for
  equal stages and close when the slowest stage is the last; very uneven splits can differ from the
  simulation by tens of percent.
- activations alive at stage ``i`` (in micro-batches of the whole stage): one without a pipeline;
  GPipe ``m`` (all forwards run before any backward); 1F1B ``min(p - i, m)``; interleaved 1F1B
  ``min(m*v, (v - 1) * r + 2 (p - i - 1) + 1)`` chunks of ``1/v`` of the stage, with ``r = m / max(1, m // p)``
  micro-batches per round (torch's ``ScheduleInterleaved1F1B`` warm-up count plus the one in flight;
  Megatron-LM's for ``m`` a multiple of ``p``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")


def pipeline_time_s(stage_times_s: list[float], num_microbatches: int, virtual_stages: int = 1) -> float:
    t_max = max(stage_times_s)
    return num_microbatches * t_max + bubble_s(stage_times_s, virtual_stages, num_microbatches)


def bubble_s(stage_times_s: list[float], virtual_stages: int = 1, num_microbatches: int | None = None) -> float:
    """Warm-up and cool-down time of the pipeline (zero with one stage), beyond ``m * t_max``."""
    total, t_max = sum(stage_times_s), max(stage_times_s)
    bubble = (total - t_max) / virtual_stages
    if num_microbatches is not None and virtual_stages > 1:  # one micro-batch's path through all chunks
        m = num_microbatches
        bubble = max(bubble, total + (m - 1) * t_max / virtual_stages - m * t_max)
    return bubble


def in_flight_microbatches(schedule: Schedule, stage: int, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Micro-batches' worth of whole-stage activations alive at once on ``stage``."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    if p == 1:  # no pipeline: gradient accumulation finishes each micro-batch's backward before the next
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    # torch's ScheduleInterleaved1F1B: micro-batches go in rounds of m / max(1, m // p); before its first
    # backward, rank r runs (v - 1) rounds plus 2 (p - 1 - r) chunk forwards (_get_warmup_ops), then one more.
    per_round = m // max(1, m // p)
    chunks = min(m * v, (v - 1) * per_round + 2 * (p - 1 - stage) + 1)
    return chunks / v


#: One op of a rank's schedule: ``("F" or "B", local chunk, micro-batch)``.
Op = tuple[str, int, int]


def schedule_order(schedule: Schedule, rank: int, p: int, m: int, v: int = 1) -> list[Op]:
    """The ops one rank runs, in order.  No pipeline: each micro-batch's backward before the next forward
    (gradient accumulation); GPipe: all forwards, then all backwards; 1F1B: ``p - 1 - rank`` warm-up
    forwards, then a forward and a backward each step; interleaved: torch's ``ScheduleInterleaved1F1B``
    (Megatron-LM's order): micro-batches in rounds of ``m / max(1, m // p)``, each round through every
    chunk, after torch's warm-up count (``_get_warmup_ops``)."""
    if p == 1:
        return [op for i in range(m) for op in (*[("F", j, i) for j in range(v)],
                                                  *[("B", j, i) for j in reversed(range(v))])]
    if schedule == "gpipe":
        return [("F", j, i) for i in range(m) for j in range(v)] + [("B", j, i) for i in range(m)
                                                                     for j in reversed(range(v))]
    if v == 1:
        warm = min(p - 1 - rank, m)
        ops: list[Op] = [("F", 0, i) for i in range(warm)]
        for b in range(m):
            if warm + b < m:
                ops.append(("F", 0, warm + b))
            ops.append(("B", 0, b))
        return ops
    per_round = m // max(1, m // p)

    def nth(k: int, forward: bool) -> Op:
        group, within = divmod(k, per_round * v)
        chunk, offset = divmod(within, per_round)
        return ("F" if forward else "B", chunk if forward else v - 1 - chunk, group * per_round + offset)

    total = m * v
    warm = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    ops = [nth(k, True) for k in range(warm)]
    for k in range(total - warm):
        ops += [nth(warm + k, True), nth(k, False)]
    return ops + [nth(k, False) for k in range(total - warm, total)]


def simulate_pipeline(schedule: Schedule, forward_s: Sequence[float], backward_s: Sequence[float], m: int,
                      v: int = 1) -> list[list[tuple[Op, float, float]]]:
    """Run the schedule op by op: per rank, its ops with their start and end times.  ``forward_s[k]`` and
    ``backward_s[k]``: one micro-batch through all of stage ``k``'s chunks (each chunk takes ``1 / v``).
    Chunk ``j`` of rank ``k`` is the model's chunk ``j * p + k``; a forward waits for the previous chunk's
    forward of its micro-batch, a backward for its own forward and the next chunk's backward."""
    p = len(forward_s)
    last = p * v - 1
    queues = [schedule_order(schedule, k, p, m, v) for k in range(p)]
    heads = [0] * p
    free = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    out: list[list[tuple[Op, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for k in range(p):
            while heads[k] < len(queues[k]):
                op = queues[k][heads[k]]
                kind, local, i = op
                c = local * p + k
                deps = ([("F", c - 1, i)] if c > 0 else []) if kind == "F" else \
                    [("F", c, i)] + ([("B", c + 1, i)] if c < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[k], *(done[d] for d in deps)])
                end = start + (forward_s[k] if kind == "F" else backward_s[k]) / v
                done[(kind, c, i)] = free[k] = end
                out[k].append((op, start, end))
                heads[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} schedule deadlocked (p={p}, m={m}, v={v})")  # a bug, not user input
    return out
