"""The simulated iteration of a plan as a Chrome trace (``autopar plan --trace``, ``autopar show --trace``).

It reads only the plan: each stage's time per micro-batch by part (``estimated_parts_per_microbatch_s``)
and the estimate's breakdown.  Every rank of a stage runs the stage's chunks in its schedule's order
(GPipe: all forwards, then all backwards; 1F1B: ``p - 1 - k`` warm-up forwards, then one forward and one
backward; interleaved: torch's and Megatron's order over chunks, in rounds of micro-batches; the zero-bubble
schedules: torch's orders of forwards, input steps ``I`` and weight steps ``W``), each op starting once its
rank is free and its inputs are there (the previous chunk's forward, the next chunk's input gradient).
After the pipeline drains, each stage waits out what the estimate adds once per iteration: the optimizer
step and gradient accumulation, the tp gradient sync, the exposed data-parallel sync.

The stages end at the estimate's ``iteration_time_s``: the plan's bubble is this same simulation (the search
re-estimates the layouts it keeps with it; ``autopar.inter_op.search``).

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

from autopar.errors import AutoparError
from autopar.inter_op.pipelining import backward_run_s
from autopar.plan_file import Plan
from autopar.solvers.pipeline import simulate_pipeline

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


def simulate(plan: Plan) -> list[Slice]:
    """Every slice of one simulated iteration of ``plan`` (``autopar.solvers.pipeline.simulate_pipeline``)."""
    lay = plan.layout
    v, m = lay["v"], lay["num_microbatches"]
    if any("estimated_parts_per_microbatch_s" not in s for s in plan.stages):
        raise AutoparError("this plan has no per-part stage times (written by an older autopar): plan it again "
                           "to draw its timeline")
    parts = [s["estimated_parts_per_microbatch_s"] for s in plan.stages]
    runs = simulate_pipeline(lay["schedule"], [_op_s("F", part) for part in parts],
                             [_op_s("B", part) for part in parts], m, v, [part.get("weight_s", 0.0) for part in parts],
                             [part.get("rerun_s", 0.0) for part in parts], lay.get("group", 0))
    slices: list[Slice] = []
    for k, ops in enumerate(runs):
        for (kind, local, i), start, _ in ops:
            slices += _op_slices(k, kind, local, i, start, parts[k], v)
    drained = max(end for ops in runs for _, _, end in ops)
    return slices + _tail_slices(plan, parts, drained)


def _op_s(kind: str, part: dict[str, float]) -> float:
    """One micro-batch's forward (or recompute and backward) through the whole stage, its transfer included."""
    half_p2p = part["p2p_s"] / 2  # the stage's transfers: one after its forward, one after its backward
    return half_p2p + (part["forward_s"] if kind == "F" else backward_run_s(part))


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
    elif kind == "W":  # the weight step of a split backward (the recomputation again, if any, inside it)
        w = part["weight_s"] / v
        out.append(Slice(stage, "compute", f"W{mb}" + (f".{chunk}" if v > 1 else ""), t, w, args))
        return out
    else:
        split = "rerun_s" in part  # a split schedule: I and W recompute once each, a whole B once
        r = (part["rerun_s"] if split else part["recompute_s"]) / v
        if r > 0:
            out.append(Slice(stage, "compute", f"R{mb}" + (f".{chunk}" if v > 1 else ""), t, r, args))
            t += r
        b = part["backward_s"] / v - ((part["weight_s"] - part["rerun_s"]) / v if kind == "I" else 0.0)
        out.append(Slice(stage, "compute", f"{kind}{mb}" + (f".{chunk}" if v > 1 else ""), t, b, args))
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
