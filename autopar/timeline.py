"""The simulated iteration of a plan as a Chrome trace (``autopar plan --trace``, ``autopar show --trace``).

It reads only the plan: each stage's time per micro-batch by part (``estimated_parts_per_microbatch_s``)
and the estimate's breakdown.  Every rank of a stage runs the stage's chunks in its schedule's order
(GPipe: all forwards, then all backwards; 1F1B: ``p - 1 - k`` warm-up forwards, then one forward and one
backward; interleaved: Megatron's order over chunks, in rounds of ``p`` micro-batches), each op starting
once its rank is free and its inputs are there (the previous chunk's forward, the next chunk's backward).
After the pipeline drains, each stage waits out what the estimate adds once per iteration: the optimizer
step and gradient accumulation, the tp gradient sync, the exposed data-parallel sync.

The trace has one process per pipeline stage and four tracks (threads): compute (forward, recompute,
backward slices per micro-batch and chunk, and the once-per-iteration work), tp, dp and p2p
communication (the exposed communication inside those slices).  Gaps on the compute track are the bubble.
The file opens in Perfetto (ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.plan_file import Plan

TRACKS = ("compute", "tp comm", "dp comm", "p2p")
_US = 1e6  # trace-event times are microseconds


@dataclass(frozen=True, slots=True)
class Slice:
    stage: int
    track: str
    name: str
    start_s: float
    duration_s: float
    args: tuple[tuple[str, Any], ...] = ()


def _order(schedule: str, rank: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """The ops one rank runs, in order: (``F`` or ``B``, local chunk, micro-batch)."""
    if schedule == "gpipe" or p == 1:
        fwd = [("F", j, i) for i in range(m) for j in range(v)]
        bwd = [("B", j, i) for i in range(m) for j in reversed(range(v))]
        if p == 1:  # gradient accumulation: each micro-batch's backward before the next forward
            return [op for i in range(m) for op in (*[("F", j, i) for j in range(v)],
                                                      *[("B", j, i) for j in reversed(range(v))])]
        return fwd + bwd
    if v == 1:  # 1F1B
        warm = min(p - 1 - rank, m)
        ops = [("F", 0, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                ops.append(("F", 0, f))
                f += 1
            ops.append(("B", 0, b))
            b += 1
        return ops
    # interleaved (Megatron-LM's schedule): micro-batches in rounds of p, each round through every chunk
    def nth(k: int, forward: bool) -> tuple[str, int, int]:
        group, within = divmod(k, p * v)
        chunk, offset = divmod(within, p)
        return ("F" if forward else "B", chunk if forward else v - 1 - chunk, group * p + offset)

    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = [nth(k, True) for k in range(warm)]
    for k in range(total - warm):
        ops.append(nth(warm + k, True))
        ops.append(nth(k, False))
    ops += [nth(k, False) for k in range(total - warm, total)]
    return ops


def simulate(plan: Plan) -> list[Slice]:
    """Every slice of one simulated iteration of ``plan``."""
    lay = plan.layout
    p, v, m = lay["pp"], lay["v"], lay["num_microbatches"]
    parts = [s["estimated_parts_per_microbatch_s"] for s in plan.stages]
    chunks = p * v
    done: dict[tuple[str, int, int], float] = {}  # (F/B, global chunk, micro-batch) -> end time
    queues = {k: _order(lay["schedule"], k, p, m, v) for k in range(p)}
    free = [0.0] * p
    slices: list[Slice] = []
    while any(queues.values()):
        progressed = False
        for k in range(p):
            while queues[k]:
                kind, local, i = queues[k][0]
                c = local * p + k  # chunk j of rank k is the model's chunk j * p + k
                deps = [("F", c - 1, i)] if kind == "F" and c > 0 else []
                if kind == "B":
                    deps = [("F", c, i)] + ([("B", c + 1, i)] if c < chunks - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[k], *(done[d] for d in deps)])
                slices += _op_slices(k, kind, local, i, start, parts[k], v)
                end = start + _op_s(kind, parts[k], v)
                done[(kind, c, i)] = free[k] = end
                queues[k].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # a bug in _order, not a user error
    drained = max(free)
    slices += _tail_slices(plan, parts, drained)
    return slices


def _op_s(kind: str, part: dict[str, float], v: int) -> float:
    half_p2p = part["p2p_s"] / 2  # the stage's transfers: one after its forward, one after its backward
    own = part["forward_s"] if kind == "F" else part["recompute_s"] + part["backward_s"]
    return (own + half_p2p) / v


def _op_slices(stage: int, kind: str, chunk: int, mb: int, start: float, part: dict[str, float],
               v: int) -> list[Slice]:
    args = (("micro-batch", mb), ("chunk", chunk))
    out: list[Slice] = []
    t = start
    if kind == "F":
        f = part["forward_s"] / v
        out.append(Slice(stage, "compute", f"F{mb}" + (f".{chunk}" if v > 1 else ""), t, f, args))
        tp = part.get("tp_forward_s", 0.0) / v
        if tp > 0:
            out.append(Slice(stage, "tp comm", f"tp F{mb}", t + f - tp, tp, args))
        t += f
    else:
        r = part["recompute_s"] / v
        if r > 0:
            out.append(Slice(stage, "compute", f"R{mb}" + (f".{chunk}" if v > 1 else ""), t, r, args))
            t += r
        b = part["backward_s"] / v
        out.append(Slice(stage, "compute", f"B{mb}" + (f".{chunk}" if v > 1 else ""), t, b, args))
        tp, z3 = part.get("tp_backward_s", 0.0) / v, part.get("zero3_s", 0.0) / v
        if tp > 0:
            out.append(Slice(stage, "tp comm", f"tp B{mb}", t + b - tp, tp, args))
        if z3 > 0:
            out.append(Slice(stage, "dp comm", f"ZeRO-3 {mb}", t, z3, args))
        t += b
    half = part["p2p_s"] / 2 / v
    if half > 0:
        out.append(Slice(stage, "p2p", f"{'send act' if kind == 'F' else 'send grad'} {mb}", t, half, args))
        out.append(Slice(stage, "compute", f"p2p {kind}{mb}", t, half, args))
    return out


def _tail_slices(plan: Plan, parts: list[dict[str, float]], drained_s: float) -> list[Slice]:
    """What the estimate adds once per iteration, after the pipeline drains, on every stage."""
    m = plan.layout["num_microbatches"]
    bd = plan.estimate["breakdown"]
    times = [s["estimated_time_per_microbatch_s"] for s in plan.stages]
    bn = parts[max(range(len(times)), key=lambda k: times[k])]
    compute_mb = bn["forward_s"] + bn["backward_s"] - bn.get("tp_forward_s", 0.0) - bn.get("tp_backward_s", 0.0) \
        - bn.get("zero3_s", 0.0)
    tail = [("optimizer step", "compute", bd["compute_s"] - m * compute_mb),
            ("tp gradient sync", "tp comm", bd["tp_comm_s"] - m * (bn.get("tp_forward_s", 0.0)
                                                                    + bn.get("tp_backward_s", 0.0))),
            ("exposed dp sync", "dp comm", bd["dp_comm_exposed_s"] - m * bn.get("zero3_s", 0.0))]
    out = []
    for k in range(len(parts)):
        t = drained_s
        for name, track, dur in tail:
            if dur > 1e-15:
                out.append(Slice(k, "compute", name, t, dur))
                if track != "compute":
                    out.append(Slice(k, track, name, t, dur))
                t += dur
    return out


def chrome_trace(plan: Plan, slices: list[Slice]) -> dict[str, Any]:
    """Trace-event JSON: one process per stage, one thread per track, complete (``X``) events in us."""
    events: list[dict[str, Any]] = []
    for s in plan.stages:
        k = s["index"]
        lo, hi = s["ranks"]
        events.append({"ph": "M", "name": "process_name", "pid": k, "tid": 0,
                       "args": {"name": f"stage {k} (ranks {lo}-{hi - 1})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": k, "tid": 0, "args": {"sort_index": k}})
        for tid, track in enumerate(TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": k, "tid": tid, "args": {"name": track}})
    for sl in sorted(slices, key=lambda x: (x.stage, TRACKS.index(x.track), x.start_s)):
        events.append({"ph": "X", "name": sl.name, "cat": sl.track, "pid": sl.stage, "tid": TRACKS.index(sl.track),
                       "ts": round(sl.start_s * _US, 3), "dur": round(sl.duration_s * _US, 3), "args": dict(sl.args)})
    est = plan.estimate
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"layout": plan.layout, "iteration_time_s": est["iteration_time_s"],
                          "pp_bubble_s": est["breakdown"]["pp_bubble_s"]}}


def write_trace(plan: Plan, path: str | Path) -> Path:
    """Write ``plan``'s simulated iteration to ``path`` (JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(plan, simulate(plan)), sort_keys=True) + "\n")
    return path


def compute_gaps_s(slices: list[Slice], stage: int) -> float:
    """Idle time on a stage's compute track, from 0 to the end of its last slice (its bubble)."""
    mine = sorted((s for s in slices if s.stage == stage and s.track == "compute"), key=lambda s: s.start_s)
    gaps, t = 0.0, 0.0
    for s in mine:
        if s.start_s > t:
            gaps += s.start_s - t
        t = max(t, s.start_s + s.duration_s)
    return gaps


def makespan_s(slices: list[Slice], stage: int) -> float:
    return max(s.start_s + s.duration_s for s in slices if s.stage == stage)


__all__ = ["TRACKS", "Slice", "chrome_trace", "compute_gaps_s", "makespan_s", "simulate", "write_trace"]
