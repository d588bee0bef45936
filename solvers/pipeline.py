"""Pipeline schedule arithmetic: bubble and in-flight micro-batches per stage.  No torch here.

With ``p`` stages, ``m`` micro-batches, per-micro-batch stage times ``t_i`` and ``v`` virtual stages
(model chunks) per device:

- iteration time ``m * t_max + (sum_i t_i - t_max) / v``: ``m`` slots of the slowest stage plus the
  warm-up/cool-down bubble, which interleaving divides by ``v`` (Narayanan et al. 2021, sec. 2.2).  For
  ``v = 1`` this is Alpa's ``sum_i t_i + (m - 1) * t_max``.  Interleaving cannot beat one micro-batch's
  own path through every chunk: with fewer micro-batches than stages (``m < p``) the pipeline never
  fills, and the time is ``sum_i t_i + (m - 1) * t_max / v`` for equal stages; for unequal ones the
  estimate runs ``simulate_pipeline`` there, as ``autopar.timeline`` does.  The closed forms are exact for
  equal stages only (very uneven splits differ from the simulation by tens of percent, either way): the
  search ranks with them and then re-estimates the layouts it keeps with ``simulate_pipeline``.
- activations alive at stage ``i`` (in micro-batches of the whole stage): one without a pipeline;
  GPipe ``m`` (all forwards run before any backward); 1F1B ``min(p - i, m)``; interleaved 1F1B
  ``min(m*v, (v - 1) * r + 2 (p - i - 1) + 1)`` chunks of ``1/v`` of the stage, with ``r = m / max(1, m // p)``
  micro-batches per round (torch's ``ScheduleInterleaved1F1B`` warm-up count plus the one in flight;
  Megatron-LM's for ``m`` a multiple of ``p``).

**Zero-bubble schedules** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"; DeepSeek-V3's DualPipe)
split a chunk's backward into the input gradient ``I`` (what the previous stage waits for) and the weight
gradient ``W`` (which nothing waits for, so it fills the bubble).  torch 2.13 runs three of them, and
``schedule_order`` reproduces each one's op order from torch's own generator:

- ``interleaved_zb``: ``ScheduleInterleavedZeroBubble`` (ZB1P over ``v`` looped chunks, ``W`` delayed by
  the rank's distance from the first stage);
- ``zbv``: ``ScheduleZBVZeroBubble``, two chunks per rank in a V (rank ``k`` holds chunks ``k`` and
  ``2p - 1 - k``: the first rank holds the first and the last);
- ``dualpipev``: ``ScheduleDualPipeV`` (DeepSeek's DualPipe folded into a V; ``m >= 2p``); its overlapped
  forward-backward pairs run one after the other in torch's runtime, and are timed so.

Their time is the simulated schedule (there is no closed form for unequal ``F``, ``I`` and ``W``), and
their activations in flight are walked off the op order: torch's ``I`` keeps the chunk's autograd graph
(``retain_graph``) and adds the gradients of the weight-bearing ops' outputs for ``W``
(``torch.distributed.pipelining._backward.stage_backward_input``), which ``W`` frees with the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev")
#: Schedules that run each chunk's backward as an input-gradient and a weight-gradient step.
SPLIT_BACKWARD: frozenset[str] = frozenset({"interleaved_zb", "zbv", "dualpipev"})
#: Schedules whose two chunks per rank form a V (torch's ``style="v"`` stage-to-rank mapping).
V_SHAPED: frozenset[str] = frozenset({"zbv", "dualpipev"})
#: Schedules that cut every stage into ``v`` chunks (the rest run one chunk per rank).
MULTI_CHUNK: frozenset[str] = frozenset({"interleaved", "interleaved_zb"}) | V_SHAPED


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


def chunk_of(schedule: str, rank: int, local: int, p: int) -> int:
    """The model chunk (pipeline stage index) a rank's ``local``-th chunk is: ``local * p + rank`` when the
    chunks loop over the ranks; in a V, rank ``k`` holds chunks ``k`` and ``2p - 1 - k``."""
    if schedule in V_SHAPED:
        return rank if local == 0 else 2 * p - 1 - rank
    return local * p + rank


def rank_of_chunk(schedule: str, chunk: int, p: int) -> int:
    """The pipeline rank that runs model chunk ``chunk`` (torch's ``generate_stage_to_rank_mapping``)."""
    if schedule in V_SHAPED:
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk % p


def round_size(p: int, m: int, group: int = 0) -> int:
    """Micro-batches a chunk of ``interleaved`` runs in a row: ``group`` (Llama 3's tunable ``N``), or torch's
    rounds of ``m / max(1, m // p)`` (Megatron-LM's ``p`` when ``p`` divides ``m``)."""
    return min(group, m) if group else m // max(1, m // p)


def in_flight_microbatches(schedule: Schedule, stage: int, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1, residue: float = 0.0, group: int = 0) -> float:
    """Micro-batches' worth of whole-stage activations alive at once on ``stage``.  ``residue``: for the
    split-backward schedules, what a chunk holds between its ``I`` and ``W`` beyond its activations, as a
    fraction of them; ``group``: ``interleaved``'s micro-batches per round (``round_size``)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    if p == 1:  # no pipeline: gradient accumulation finishes each micro-batch's backward before the next
        return 1.0
    if schedule in SPLIT_BACKWARD:
        return _walked_in_flight(schedule, stage, p, m, v, residue) / v
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    # torch's ScheduleInterleaved1F1B: micro-batches go in rounds of m / max(1, m // p) (or Llama 3's N); before
    # its first backward, rank r runs (v - 1) rounds plus 2 (p - 1 - r) chunk forwards (_get_warmup_ops; Megatron-
    # Core's get_pp_rank_microbatches with microbatch_group_size_per_vp_stage = N), then one more.
    per_round = round_size(p, m, group)
    chunks = min(m * v, (v - 1) * per_round + 2 * (p - 1 - stage) + 1)
    return chunks / v


def _walked_in_flight(schedule: Schedule, rank: int, p: int, m: int, v: int, residue: float) -> float:
    """The most chunk activations a rank holds at once in its op order: a forward adds one, a full backward
    or a weight step frees one; between ``I`` and ``W`` a chunk also holds ``residue`` of one."""
    frontier = _held_frontiers(schedule, p, steady_microbatches(schedule, p, m), v)[rank]
    return max(held + residue * pending for held, pending in frontier)


def splits_backward(schedule: str, p: int) -> bool:
    """Whether the schedule runs (some) backwards as an input step and a weight step."""
    return schedule in SPLIT_BACKWARD and p > 1


@functools.lru_cache(maxsize=1024)
def split_fraction(schedule: Schedule, p: int, m: int, v: int) -> float:
    """The most, over ranks, of a rank's backwards that are split into an input and a weight step (1 for
    ``interleaved_zb`` and ``zbv``; DualPipeV runs most of its backwards whole), 0 without a split."""
    if not splits_backward(schedule, p):
        return 0.0
    if schedule != "dualpipev":  # their orders hold no whole backward (tests/test_pipeline.py)
        return 1.0
    shares = []
    for rank in range(p):
        kinds = [op[0] for op in schedule_order(schedule, rank, p, m, v)]
        split, whole = kinds.count("I"), kinds.count("B")
        shares.append(split / max(1, split + whole))
    return max(shares)


def steady_microbatches(schedule: Schedule, p: int, m: int) -> int:
    """A micro-batch count whose op orders hold as many chunks at once as ``m``'s: the warm-up sets the peak
    and the steady phase repeats it, so beyond three rounds (``interleaved_zb``, ``m`` a multiple of ``p``)
    or ``2p + 1`` micro-batches (the V schedules) more of them change nothing (``tests/test_pipeline.py``
    checks it against the full walk)."""
    if schedule == "interleaved_zb" and m % p == 0 and m > 3 * p:
        return 3 * p
    if schedule in V_SHAPED and m > 2 * p + 1:
        return 2 * p + 1
    return m


@functools.lru_cache(maxsize=1024)
def _held_frontiers(schedule: Schedule, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, the (chunks held, of them between ``I`` and ``W``) pairs its op order passes through that
    no other pair exceeds in both: the peak for any ``residue`` is among them."""
    if schedule == "interleaved_zb":  # the search's hot path: by phases, not op by op
        return tuple(_pareto(_interleaved_zb_held(rank, p, m, v)) for rank in range(p))
    return tuple(_held_frontier(op[0] for op in schedule_order(schedule, rank, p, m, v)) for rank in range(p))


def _held_frontier(kinds: Iterable[str]) -> tuple[tuple[int, int], ...]:
    held = pending = 0
    seen: set[tuple[int, int]] = set()
    for kind in kinds:
        if kind == "F":
            held += 1
        elif kind == "I":
            pending += 1
        elif kind == "W":
            held, pending = held - 1, pending - 1
        else:
            held -= 1
        seen.add((held, pending))
    return _pareto(seen)


def _interleaved_zb_held(rank: int, p: int, m: int, v: int) -> set[tuple[int, int]]:
    """The (held, pending) pairs ``_interleaved_zb_order`` passes through that can be on its frontier, phase by
    phase (``_interleaved_zb_steps``): the warm-up forwards (their last pair covers the others); forward + input
    steps before the weight steps start (``rank`` of them); one forward + input + weight step (the next ones pass
    through the same pairs); the input steps with no forward left, up to the first with a weight step after it
    (from there the chunks held only fall, and the weight steps left lower both counts)."""
    total = m * v
    _, warm = _interleaved_zb_shape(rank, p, m, v)
    held, pending = warm, 0
    seen = {(held, pending)} if warm else set()
    with_forward = total - warm  # steps that run a forward after the warm-up
    for _ in range(min(rank, with_forward)):
        seen.add((held + 1, pending))
        held, pending = held + 1, pending + 1
        seen.add((held, pending))
    if with_forward > rank:
        seen.update({(held + 1, pending), (held + 1, pending + 1)})
    for j in range(with_forward, total):
        pending += 1
        seen.add((held, pending))
        if j >= rank:
            break
    return seen


def _pareto(seen: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The pairs of ``seen`` that no other exceeds in both, sorted."""
    frontier, most_pending = [], -1
    for pair in sorted(seen, reverse=True):  # by held, descending: keep a pair only if it has more pending
        if pair[1] > most_pending:
            frontier.append(pair)
            most_pending = pair[1]
    return tuple(sorted(frontier))


#: One op of a rank's schedule: ``(kind, local chunk, micro-batch)``; kind ``F`` (forward), ``B`` (full
#: backward), or the split backward's ``I`` (input gradient) and ``W`` (weight gradient).
Op = tuple[str, int, int]


def schedule_order(schedule: Schedule, rank: int, p: int, m: int, v: int = 1, group: int = 0) -> list[Op]:
    """The ops one rank runs, in order.  No pipeline: each micro-batch's backward before the next forward
    (gradient accumulation); GPipe: all forwards, then all backwards; 1F1B: ``p - 1 - rank`` warm-up
    forwards, then a forward and a backward each step; interleaved: torch's ``ScheduleInterleaved1F1B``
    (Megatron-LM's order): micro-batches in rounds of ``m / max(1, m // p)``, each round through every
    chunk, after torch's warm-up count (``_get_warmup_ops``), or in groups of ``group`` (Llama 3's tunable
    ``N``); the zero-bubble schedules: torch's orders (see the module docstring)."""
    if p == 1 and schedule not in V_SHAPED:
        return [op for i in range(m) for op in (*[("F", j, i) for j in range(v)],
                                                  *[("B", j, i) for j in reversed(range(v))])]
    if schedule == "interleaved_zb":
        return _interleaved_zb_order(rank, p, m, v)
    if schedule == "zbv":
        return _zbv_order(rank, p, m)
    if schedule == "dualpipev":
        return _dualpipev_order(rank, p, m)
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
    per_round = round_size(p, m, group)

    def nth(k: int, forward: bool) -> Op:
        # the k-th forward (backward): rounds of per_round micro-batches through every chunk; a last, shorter
        # round when per_round does not divide m
        first = (k // (per_round * v)) * per_round
        size = min(per_round, m - first)
        chunk, offset = divmod(k - first * v, size)
        return ("F" if forward else "B", chunk if forward else v - 1 - chunk, first + offset)

    total = m * v
    warm = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    ops = [nth(k, True) for k in range(warm)]
    for k in range(total - warm):
        ops += [nth(warm + k, True), nth(k, False)]
    return ops + [nth(k, False) for k in range(total - warm, total)]


class _Counters:
    """Per (kind, local chunk) micro-batch counters, as torch's schedule generators keep them."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], int] = {}

    def take(self, kind: str, chunk: int) -> int:
        i = self._next.get((kind, chunk), 0)
        self._next[(kind, chunk)] = i + 1
        return i


def _interleaved_zb_order(rank: int, p: int, m: int, v: int) -> list[Op]:
    """``ScheduleInterleavedZeroBubble`` (torch's ``_get_1f1b_rank_ops`` with ``enable_zero_bubble``): one
    warm-up forward per hop from the last rank (``multiply_factor=1``), then forward + input gradient per
    step, each rank's weight steps trailing its input steps by ``rank`` (``num_1f1b_microbatches``)."""
    per_round, warm = _interleaved_zb_shape(rank, p, m, v)
    counts = _Counters()
    ops: list[Op] = []
    for kind, step in _interleaved_zb_steps(rank, p, m, v):
        chunk = (step // per_round) % v if kind == "F" else v - 1 - ((step - warm) // per_round) % v
        ops.append((kind, chunk, counts.take(kind, chunk)))
    return ops


def _interleaved_zb_shape(rank: int, p: int, m: int, v: int) -> tuple[int, int]:
    """``interleaved_zb``'s micro-batches per round and the warm-up forwards of ``rank``."""
    per_round = m // max(1, m // p)
    return per_round, min((v - 1) * per_round + (p - 1 - rank), m * v)


def _interleaved_zb_steps(rank: int, p: int, m: int, v: int) -> Iterator[tuple[str, int]]:
    """``_interleaved_zb_order``'s op kinds in order, each with the step that sets its chunk: a forward's own,
    an input or weight step's backward step."""
    total = m * v
    _, warm = _interleaved_zb_shape(rank, p, m, v)
    backward_steps: list[int] = []
    weights_done = 0
    for step in range(total + warm):  # warm-up forwards, forward + input steps, then the input steps left
        if step < total:
            yield "F", step
        if step < warm:
            continue
        yield "I", step
        backward_steps.append(step)
        if step - warm >= rank:
            yield "W", backward_steps[weights_done]
            weights_done += 1
    for step in backward_steps[weights_done:]:
        yield "W", step


def _zbv_order(rank: int, p: int, m: int) -> list[Op]:
    """``ScheduleZBVZeroBubble`` (Qi et al. 2023, sec. 6): local chunk 0 is the V's way down, 1 its way up."""
    n = max(2 * p - 1, m)  # torch plans a full pipeline and drops the micro-batches beyond m
    ops: list[Op] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append(("F", 0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [("F", 1, f1), ("F", 0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        ops += [("F", 1, f1), ("I", 1, b1), ("W", 1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", 0, f0))
            f0 += 1
        ops += [("I", 0, b0), ("W", 0, b0), ("F", 1, f1), ("I", 1, b1), ("W", 1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [("I", 0, b0), ("I", 1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        ops += [("I", 0, b0), ("W", 0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [("W", 1, i) for i in range(w1, b1)] + [("W", 0, i) for i in range(w0, b0)]
    return [op for op in ops if op[2] < m]


def _dualpipev_order(rank: int, p: int, m: int) -> list[Op]:
    """``ScheduleDualPipeV`` (DeepSeek-V3's DualPipe folded into a V, ``m >= 2p``).  Its overlapped
    forward + backward pairs run one after the other in torch's runtime; a full backward (``B``) counts as
    one input step and one weight step."""
    counts = _Counters()
    weights: list[tuple[int, int]] = []
    ops: list[Op] = []

    def add(kind: str, c: int) -> None:
        i = counts.take("I" if kind in ("I", "B") else kind, c)
        ops.append((kind, c, i))
        if kind == "I":
            weights.append((c, i))

    def weight() -> None:
        if weights:
            c, i = weights.pop(0)
            ops.append(("W", c, i))

    for _ in range(2 * (p - rank - 1)):
        add("F", 0)
    for _ in range(rank + 1):
        add("F", 0)
        add("F", 1)
    for _ in range(p - rank - 1):
        add("I", 1)
        weight()
        add("F", 1)
    for _ in range(m - 2 * p + rank + 1):
        add("F", 0)  # overlapped with the next in torch's plan, run one after the other by its runtime
        add("B", 1)
        add("F", 1)
        add("B", 0)
    for _ in range(p - rank - 1):
        add("B", 1)
        add("F", 1)
        add("B", 0)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add("I" if split else "B", 1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add("I" if split else "B", 0)
    for _ in range(p - rank - 1):
        weight()
        add("I" if split else "B", 0)
    for _ in range(rank + 1):
        weight()
    return ops


def simulate_pipeline(schedule: Schedule, forward_s: Sequence[float], backward_s: Sequence[float], m: int,
                      v: int = 1, weight_s: Sequence[float] | None = None,
                      rerun_s: Sequence[float] | None = None, group: int = 0) -> list[list[tuple[Op, float, float]]]:
    """Run the schedule op by op: per rank, its ops with their start and end times.  ``forward_s[k]`` and
    ``backward_s[k]``: one micro-batch through all of stage ``k``'s chunks (each chunk takes ``1 / v``),
    as a split backward runs it; ``weight_s[k]``: its weight step ``W`` (its input step ``I`` is the rest);
    ``rerun_s[k]``: what ``W`` recomputes again, which a whole backward ``B`` runs once.  A forward waits
    for the previous chunk's forward of its micro-batch, an input (or whole) backward for its own forward
    and the next chunk's input gradient, a weight step for its input step."""
    p = len(forward_s)
    order, ops = _dependency_order(schedule, p, m, v, group)
    weight_s = weight_s if weight_s is not None else [0.0] * p
    rerun_s = rerun_s if rerun_s is not None else [0.0] * p
    span = {"F": forward_s, "B": [b - r for b, r in zip(backward_s, rerun_s)], "W": weight_s,
            "I": [b - w for b, w in zip(backward_s, weight_s)]}
    durations = [[span[kind][k] / v for kind, _, _ in ops[k]] for k in range(p)]
    free = [0.0] * p
    ends: list[float] = [0.0] * len(order)
    out: list[list[tuple[Op, float, float]]] = [[] for _ in range(p)]
    for n, (k, j, deps) in enumerate(order):
        start = free[k]
        for d in deps:
            if ends[d] > start:
                start = ends[d]
        free[k] = ends[n] = start + durations[k][j]
        out[k].append((ops[k][j], start, ends[n]))
    return out


@functools.lru_cache(maxsize=128)  # an entry holds every op of the schedule: keep few
def _dependency_order(schedule: Schedule, p: int, m: int, v: int, group: int = 0
                      ) -> tuple[tuple[tuple[int, int, tuple[int, ...]], ...], tuple[tuple[Op, ...], ...]]:
    """Every op of the schedule as ``(rank, index in its rank's order, positions of the ops it waits for)``,
    in an order where each op comes after those (the ranks run their orders round-robin as far as their
    inputs allow; the order does not depend on the ops' durations), and each rank's ops."""
    last = p * v - 1
    queues = tuple(tuple(schedule_order(schedule, k, p, m, v, group)) for k in range(p))
    heads = [0] * p
    position: dict[tuple[str, int, int], int] = {}
    order: list[tuple[int, int, tuple[int, ...]]] = []
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for k in range(p):
            while heads[k] < len(queues[k]):
                kind, local, i = queues[k][heads[k]]
                c = chunk_of(schedule, k, local, p)
                if kind == "F":
                    deps = [("F", c - 1, i)] if c > 0 else []
                elif kind == "W":
                    deps = [("G", c, i)]
                else:
                    deps = [("F", c, i)] + ([("G", c + 1, i)] if c < last else [])
                if any(d not in position for d in deps):
                    break
                position[("F" if kind == "F" else "G" if kind in ("I", "B") else "W", c, i)] = len(order)
                order.append((k, heads[k], tuple(position[d] for d in deps)))
                heads[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} schedule deadlocked (p={p}, m={m}, v={v})")  # a bug, not user input
    return tuple(order), queues
