"""Pipeline schedule arithmetic: bubble and in-flight micro-batches per stage.  No torch here.

With ``p`` stages, ``m`` micro-batches, per-micro-batch stage times ``t_i`` and ``v`` virtual stages
(model chunks) per device:

- iteration time ``m * t_max + (sum_i t_i - t_max) / v``: ``m`` slots of the slowest stage plus the
  warm-up/cool-down bubble, which interleaving divides by ``v`` (Narayanan et al. 2021, sec. 2.2).  For
  ``v = 1`` this is Alpa's ``sum_i t_i + (m - 1) * t_max``.
- activations alive at stage ``i`` (in micro-batches of the whole stage): one without a pipeline;
  GPipe ``m`` (all forwards run before any backward); 1F1B ``min(p - i, m)``; interleaved 1F1B
  ``min(m*v, (v - 1) * r + 2 (p - i - 1) + 1)`` chunks of ``1/v`` of the stage, with ``r = m / max(1, m // p)``
  micro-batches per round (torch's ``ScheduleInterleaved1F1B`` warm-up count plus the one in flight;
  Megatron-LM's for ``m`` a multiple of ``p``).
"""

from __future__ import annotations

from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")


def pipeline_time_s(stage_times_s: list[float], num_microbatches: int, virtual_stages: int = 1) -> float:
    t_max = max(stage_times_s)
    return num_microbatches * t_max + bubble_s(stage_times_s, virtual_stages)


def bubble_s(stage_times_s: list[float], virtual_stages: int = 1) -> float:
    """Warm-up and cool-down time of the pipeline (zero with one stage)."""
    return (sum(stage_times_s) - max(stage_times_s)) / virtual_stages


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
