"""Pipeline schedule arithmetic and the stage DP."""

from __future__ import annotations

import itertools

import pytest
from autopar.solvers.pipeline import bubble_s, in_flight_microbatches, pipeline_time_s
from autopar.solvers.stage_dp import UnitLoad, split_stages, split_uniform_stages, stage_memory_bytes


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (8, 16)])
def test_in_flight_follows_the_schedule(p, m):
    for i in range(p):
        assert in_flight_microbatches("gpipe", i, p, m) == m
        assert in_flight_microbatches("1f1b", i, p, m) == min(p - i, m)
    assert in_flight_microbatches("1f1b", 0, 1, m) == 1  # no pipeline: plain gradient accumulation


def test_interleaving_divides_the_bubble():
    times = [1.0, 1.0, 1.0, 1.0]
    assert bubble_s(times, 1) == pytest.approx(3.0)
    for v in (2, 4):
        assert bubble_s(times, v) == pytest.approx(3.0 / v)
    assert pipeline_time_s(times, 8, 1) == pytest.approx(8 + 3)
    # interleaved warm-up keeps more chunks in flight on early stages
    assert in_flight_microbatches("interleaved", 0, 4, 8, 2) > in_flight_microbatches("1f1b", 0, 4, 8)


@pytest.mark.parametrize("p,v,m", [(2, 2, 1), (4, 2, 2), (4, 4, 3), (8, 4, 1), (4, 2, 4), (8, 2, 16)])
def test_interleaving_cannot_beat_one_micro_batch_path(p, v, m):
    # fewer micro-batches than stages never fill the pipeline: one micro-batch still passes every chunk, as
    # the simulated schedule shows (uniform stages of 1 s); with m >= p the usual bubble / v holds
    times = [1.0] * p
    expected = p + (m - 1) / v if m < p else m + (p - 1) / v
    assert pipeline_time_s(times, m, v) == pytest.approx(expected)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 6, 2), (16, 32, 4), (16, 20, 2), (4, 3, 2), (2, 6, 3)])
def test_interleaved_in_flight_follows_torch_warmup(p, m, v):
    """Chunks alive before the first backward: torch's own warm-up count for ScheduleInterleaved1F1B."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    per_round = m // max(1, m // p)
    for rank in range(p):
        warmup = _get_warmup_ops(rank, v, per_round, p, m, 2)
        assert in_flight_microbatches("interleaved", rank, p, m, v) == pytest.approx(min(m * v, warmup + 1) / v)


def test_stage_dp_balances_uneven_units():
    # embedding 3, four layers of 2, head 5: best 2 stages -> [emb, l, l] (7) | [l, l, head] (9)
    times = [3.0, 2.0, 2.0, 2.0, 2.0, 5.0]
    split = split_stages(times, [0.0] * 6, [0.0] * 6, [1.0, 1.0], float("inf"))
    assert split.boundaries == (0, 3, 6) and max(split.stage_times_s) == 9.0


def test_stage_dp_respects_memory():
    times = [1.0] * 4
    act = [10.0] * 4
    # stage 0 holds 2 micro-batches in flight, stage 1 one: memory pushes layers to stage 1
    split = split_stages(times, [0.0] * 4, act, [2.0, 1.0], 30.0)
    assert split.boundaries == (0, 1, 4)
    assert split_stages(times, [0.0] * 4, act, [2.0, 1.0], 15.0) is None


def test_a_layers_recomputation_does_not_stack_on_the_heads_saved_logits():
    """Layers keep 1 (their checkpoint) and re-create 5 in backward; the head keeps 4 and needs 2 more for
    the loss.  One micro-batch: the head's moment (3 + 4 + 2) beats any layer's (3 + 5), and the head's
    logits are freed before the first layer recomputes."""
    state, act, extra = [0.0] * 4, [1.0, 1.0, 1.0, 4.0], [5.0, 5.0, 5.0, 2.0]
    assert stage_memory_bytes(state, act, extra, 1.0) == 9.0  # not 7 + 5
    assert stage_memory_bytes(state, act, [9.0, 9.0, 9.0, 2.0], 1.0) == 12.0  # the last layer's: 3 + 9
    # two micro-batches in flight: the other one holds everything it saved
    assert stage_memory_bytes(state, act, extra, 2.0) == 7.0 + 9.0
    assert stage_memory_bytes([2.0, 3.0], [0.0, 0.0], [0.0, 0.0], 3.0) == 5.0  # state alone
    split = split_stages([1.0] * 4, state, act, [1.0], 9.0, extra)  # the DP prices a stage the same way
    assert split is not None and split.stage_memory_bytes == (9.0,)


def test_what_a_unit_holds_after_the_backward_does_not_stack_on_the_activations():
    """A training loop's metrics over the logits run once the micro-batch's backward has freed its activations:
    their 12 stand alone (not 7 + 12), beside what the other micro-batches in flight still hold."""
    state, act, extra = [0.0] * 4, [1.0, 1.0, 1.0, 4.0], [5.0, 5.0, 5.0, 2.0]
    after = [0.0, 0.0, 0.0, 12.0]
    assert stage_memory_bytes(state, act, extra, 1.0, after) == 12.0
    assert stage_memory_bytes(state, act, extra, 1.0, [0.0, 0.0, 0.0, 5.0]) == 9.0  # under the forward's peak
    assert stage_memory_bytes(state, act, extra, 2.0, after) == 7.0 + 12.0
    for budget, fits in ((12.0, True), (11.0, False)):
        split = split_stages([1.0] * 4, state, act, [1.0], budget, extra, after)
        assert (split is not None) == fits
        if fits:
            assert split.stage_memory_bytes == (12.0,)
    # two stages: only the one holding the head pays it
    split = split_stages([1.0] * 4, state, act, [1.0, 1.0], float("inf"), extra, after)
    assert split.stage_memory_bytes[-1] == 12.0 and split.stage_memory_bytes[0] < 12.0


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_uniform_split_matches_the_general_dp(p):
    pre, layer, post = UnitLoad(3.0, 1.0, 2.0), UnitLoad(2.0, 4.0, 3.0, 1.0), UnitLoad(5.0, 1.0, 6.0, 0.0, 40.0)
    n = 8
    in_flight = [float(p - i) for i in range(p)]
    for budget in (float("inf"), 80.0, 60.0, 45.0):
        fast = split_uniform_stages(pre, layer, post, n, tuple(in_flight), budget)
        units = [pre, *[layer] * n, post]
        general = split_stages([u.time_s for u in units], [u.state_bytes for u in units],
                               [u.activation_bytes for u in units], in_flight, budget, [u.extra_bytes for u in units],
                               [u.after_bytes for u in units])
        assert (fast is None) == (general is None)
        if fast is not None:
            assert max(fast.stage_times_s) == pytest.approx(max(general.stage_times_s))
            assert all(m <= budget for m in fast.stage_memory_bytes)
            for k, (a, b) in enumerate(zip(fast.boundaries, fast.boundaries[1:])):  # the closed form's memory
                held = units[a:b]
                assert fast.stage_memory_bytes[k] == pytest.approx(stage_memory_bytes(
                    [u.state_bytes for u in held], [u.activation_bytes for u in held], [u.extra_bytes for u in held],
                    in_flight[k], [u.after_bytes for u in held]))


@pytest.mark.parametrize("schedule,p,v,m", [("1f1b", 4, 1, 8), ("gpipe", 4, 1, 8), ("1f1b", 8, 1, 3),
                                            ("interleaved", 4, 2, 8), ("interleaved", 4, 4, 16),
                                            ("interleaved", 8, 2, 3), ("1f1b", 1, 1, 4)])
def test_simulated_schedule_meets_the_closed_form_on_equal_stages(schedule, p, v, m):
    from autopar.solvers.pipeline import schedule_order, simulate_pipeline

    runs = simulate_pipeline(schedule, [1.0] * p, [2.0] * p, m, v)
    assert max(end for ops in runs for _, _, end in ops) == pytest.approx(pipeline_time_s([3.0] * p, m, v))
    for k, ops in enumerate(runs):  # every rank runs each of its chunks' forward and backward once per micro-batch
        assert len(ops) == 2 * m * v == len(schedule_order(schedule, k, p, m, v))
        assert all(a[2] <= b[1] + 1e-12 for a, b in itertools.pairwise(ops))  # one op at a time


def _torch_order(schedule: str, rank: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """torch's own op order for a rank (its schedule generator, run without stages or process groups)."""
    from torch.distributed.pipelining import schedules

    cls = {"interleaved_zb": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV}[schedule]
    gen = object.__new__(cls)
    rounds = max(1, m // p)
    gen.pp_group_size, gen._n_microbatches, gen.num_stages, gen.n_local_stages = p, m, p * v, v
    gen.number_of_rounds, gen.microbatches_per_round = rounds, m // rounds
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out = []
    for action in gen._calculate_single_rank_operations(rank):
        for a in (action.sub_actions or (action,)) if action is not None else ():
            out.append((kinds[str(a.computation_type).rsplit(".", 1)[-1]], a.stage_index, a.microbatch_index))
    return out


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("interleaved_zb", 2, 4, 2), ("interleaved_zb", 4, 8, 1), ("interleaved_zb", 4, 6, 2), ("interleaved_zb", 4, 3, 2),
    ("interleaved_zb", 8, 16, 4), ("zbv", 2, 2, 2), ("zbv", 4, 3, 2), ("zbv", 4, 12, 2), ("zbv", 8, 32, 2),
    ("dualpipev", 2, 4, 2), ("dualpipev", 3, 6, 2), ("dualpipev", 4, 12, 2), ("dualpipev", 8, 16, 2)])
def test_zero_bubble_orders_are_torchs(schedule, p, m, v):
    """The cost model runs the very op order torch's schedule runs, on torch's stage-to-rank mapping."""
    from autopar.solvers.pipeline import V_SHAPED, chunk_of, rank_of_chunk, schedule_order
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for rank in range(p):
        ours = [(k, chunk_of(schedule, rank, local, p), i) for k, local, i in schedule_order(schedule, rank, p, m, v)]
        assert ours == _torch_order(schedule, rank, p, m, v)
    mapping = generate_stage_to_rank_mapping(p, p * v, style="v" if schedule in V_SHAPED else "loop")
    assert [rank_of_chunk(schedule, c, p) for c in range(p * v)] == [mapping[c] for c in range(p * v)]


@pytest.mark.parametrize(("schedule", "v"), [("interleaved_zb", 1), ("interleaved_zb", 2), ("zbv", 2),
                                             ("dualpipev", 2)])
def test_weight_steps_fill_the_bubble(schedule, v):
    from autopar.solvers.pipeline import simulate_pipeline

    p, m = 4, 8

    def makespan(weight: float) -> float:
        runs = simulate_pipeline(schedule, [1.0] * p, [2.0] * p, m, v, [weight] * p)
        return max(end for ops in runs for _, _, end in ops)

    one_f_one_b = pipeline_time_s([3.0] * p, m)  # 8 slots + 3 stages of warm-up and cool-down
    assert makespan(1.0) < makespan(0.5) < one_f_one_b  # the more backward is weight work, the more it fills
    if schedule == "interleaved_zb" and v == 1:  # ZB-H1 (Qi et al. 2023): bubble (p - 1)(F + I - W)
        assert makespan(1.0) == pytest.approx(m * 3 + (p - 1) * (1 + 1 - 1))
        assert makespan(0.0) == pytest.approx(one_f_one_b)  # with nothing to defer it is 1F1B


def test_split_backward_holds_weight_residue_until_the_weight_step():
    # ZB-V holds at most 1F1B's first stage (p micro-batches of activations; Qi et al. 2023, sec. 6) ...
    p, m = 4, 16
    assert [in_flight_microbatches("zbv", k, p, m, 2) for k in range(p)] == [p] * p
    # ... plus what waits between each chunk's input step and its weight step
    assert all(in_flight_microbatches("zbv", k, p, m, 2, residue=0.5) > p for k in range(p))


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_in_flight_needs_only_a_few_rounds_of_the_order(schedule):
    """``steady_microbatches``: longer orders hold no more at once (the warm-up sets the peak)."""
    from autopar.solvers.pipeline import _held_frontiers, steady_microbatches

    for p in (2, 3, 4, 8):
        for v in ((1, 2, 4) if schedule == "interleaved_zb" else (2,)):
            for m in range(p, 8 * p + 1, p if schedule == "interleaved_zb" else 1):
                if schedule == "dualpipev" and m < 2 * p:
                    continue
                assert _held_frontiers(schedule, p, m, v) == _held_frontiers(
                    schedule, p, steady_microbatches(schedule, p, m), v), (p, v, m)


def test_interleaved_zb_s_held_chunks_by_phases_are_its_order_s():
    """The search reads ``interleaved_zb``'s chunks in flight from its phases, not op by op: the frontier of the
    (held, pending) pairs is the walk of its whole order's, for every rank, and micro-batch counts that divide into
    the stages or not."""
    from autopar.solvers.pipeline import _held_frontier, _interleaved_zb_held, _pareto, schedule_order

    for p in (2, 3, 5, 8, 13):
        for v in (1, 2, 3, 4, 8):
            for m in range(1, 4 * p + 3):
                for rank in range(p):
                    walked = _held_frontier(op[0] for op in schedule_order("interleaved_zb", rank, p, m, v))
                    assert _pareto(_interleaved_zb_held(rank, p, m, v)) == walked, (p, v, m, rank)


@pytest.mark.parametrize(("schedule", "v"), [("interleaved_zb", 1), ("interleaved_zb", 4), ("zbv", 2)])
def test_only_dualpipev_runs_whole_backwards(schedule, v):
    from autopar.solvers.pipeline import schedule_order, split_fraction

    for p, m in ((2, 4), (4, 8), (4, 12)):
        assert all(op[0] != "B" for k in range(p) for op in schedule_order(schedule, k, p, m, v))
        assert split_fraction(schedule, p, m, v) == 1.0
    assert 0 < split_fraction("dualpipev", 4, 16, 2) < 1
