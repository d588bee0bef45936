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


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_uniform_split_matches_the_general_dp(p):
    pre, layer, post = UnitLoad(3.0, 1.0, 2.0), UnitLoad(2.0, 4.0, 3.0, 1.0), UnitLoad(5.0, 1.0, 6.0)
    n = 8
    in_flight = [float(p - i) for i in range(p)]
    for budget in (float("inf"), 80.0, 60.0):
        fast = split_uniform_stages(pre, layer, post, n, in_flight, budget)
        units = [pre, *[layer] * n, post]
        general = split_stages([u.time_s for u in units], [u.state_bytes for u in units],
                               [u.activation_bytes for u in units], in_flight, budget, [u.extra_bytes for u in units])
        assert (fast is None) == (general is None)
        if fast is not None:
            assert max(fast.stage_times_s) == pytest.approx(max(general.stage_times_s))
            assert all(m <= budget for m in fast.stage_memory_bytes)
            for k, (a, b) in enumerate(zip(fast.boundaries, fast.boundaries[1:])):  # the closed form's memory
                held = units[a:b]
                assert fast.stage_memory_bytes[k] == pytest.approx(stage_memory_bytes(
                    [u.state_bytes for u in held], [u.activation_bytes for u in held], [u.extra_bytes for u in held],
                    in_flight[k]))


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
