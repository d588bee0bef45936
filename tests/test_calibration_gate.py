"""The calibration gate: autopar's estimates of the published runs in ``benchmarks/reference``.

Each row is planned with its published layout pinned (``benchmarks/reference_runs.py``) and compared with
its measured iteration time; the measured sweep checks the ranking of layouts.  Two kinds of tests:

- **guards** hold the accuracy the cost model reaches today, so that a change that makes it worse fails;
- **targets** are issue 9's acceptance bounds.  The ones the model does not reach yet are marked ``xfail``
  with ``strict=True``: they report as expected failures, and the day one passes it fails, to be promoted
  to a guard.

Traces and intra-op solves are shared by all rows (one module-scoped run of both benchmarks).
"""

from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: Today's accuracy, as guards (benchmarks/results and docs/accuracy.md show the figures).
GUARD_MAX_ABS_ERROR = 0.40
GUARD_MEDIAN_ABS_ERROR = 0.09
GUARD_SPEARMAN = 0.845
KNOWN_REFUSED = {"llama3_405b_8192_cp1"}  # Llama 3's own flexible-N schedule keeps fewer micro-batches in flight
#: Issue 9's acceptance.
TARGET_MAX_ABS_ERROR = 0.20
TARGET_MEDIAN_ABS_ERROR = 0.08
TARGET_REGRET = 0.05

#: llm-foundry runs (benchmarks/reference/llm_foundry_tables.json) whose estimated peak memory comes closest
#: to their GPU's (82-89 % of it, 90-100 % of what the planner counts usable), one per model, sequence and GPU
#: among the tightest: runs that really ran must stay plannable.
TIGHTEST_LLM_FOUNDRY = ("mpt_3b_8192_8_h100_80gb_3x6", "mpt_3b_8192_8_a100_80gb_3x6", "mpt_1b_2048_32_a100_40gb_10x1",
                        "mpt_1b_2048_16_h100_80gb_20x1", "mpt_350m_2048_16_a100_40gb_18x1",
                        "mpt_3b_2048_32_a100_40gb_6x1", "mpt_30b_8192_8_h100_80gb_1x21",
                        "mpt_30b_8192_8_a100_80gb_1x21", "mpt_760m_8192_8_a100_40gb_3x4",
                        "mpt_760m_16384_8_a100_80gb_3x2")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        calibration = importlib.import_module("calibration")
        ranking = importlib.import_module("ranking")
        reference_runs = importlib.import_module("reference_runs")
        traces = calibration.TraceCache()
        rows = [calibration.estimate_case(case, traces) for case in reference_runs.load_calibration()]
        sweeps = [ranking.rank_sweep(name, sweep, traces) for name, sweep in reference_runs.load_sweeps().items()]
    finally:
        sys.path.remove(str(BENCHMARKS))
    return rows, sweeps


def _errors(rows) -> dict[str, float]:
    return {r["case_id"]: abs(r["error"]) for r in rows if r["error"] is not None}


def test_reference_data_is_in_the_repository():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        reference_runs = importlib.import_module("reference_runs")
        assert len(reference_runs.load_calibration()) >= 19
        assert sum(len(s["runs"]) for s in reference_runs.load_sweeps().values()) >= 74
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_guard_every_row_has_an_estimate_within_the_guard(results):
    rows, _ = results
    errors = _errors(rows)
    assert len(errors) == len(rows)  # a refused layout is still estimated, marked as not fitting
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GUARD_MAX_ABS_ERROR, f"{worst}: {errors[worst]:+.1%}"


def test_guard_median_error(results):
    rows, _ = results
    assert statistics.median(_errors(rows).values()) <= GUARD_MEDIAN_ABS_ERROR


def test_guard_no_new_refusals(results):
    rows, _ = results
    refused = {r["case_id"] for r in rows if r["error"] is None or r.get("fits") is False}
    assert refused <= KNOWN_REFUSED, sorted(refused - KNOWN_REFUSED)


def test_guard_the_memory_tightest_llm_foundry_runs_fit():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        calibration = importlib.import_module("calibration")
        reference_runs = importlib.import_module("reference_runs")
        cases = reference_runs.load_calibration(BENCHMARKS / "reference" / "llm_foundry_tables.json")
        traces = calibration.TraceCache()
        rows = [calibration.estimate_case(c, traces) for c in cases if c["case_id"] in TIGHTEST_LLM_FOUNDRY]
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert len(rows) == len(TIGHTEST_LLM_FOUNDRY)
    for r in rows:
        assert r["error"] is not None and r["fits"], (r["case_id"], r.get("note"), r.get("peak_memory_gib"))
        assert abs(r["error"]) <= GUARD_MAX_ABS_ERROR, (r["case_id"], r["error"])


def test_sweep_ranking_spearman(results):
    _, sweeps = results
    for s in sweeps:
        assert s["spearman"] >= GUARD_SPEARMAN, f"{s['sweep']}: {s['spearman']:.3f}"
        assert not s["refused"], s["refused"]


@pytest.mark.xfail(strict=True, reason="issue 9 target not reached: H100 runs (Megatron-Core, llm-foundry) "
                                      "estimate 23-33 % fast")
def test_target_every_row_within_20_percent(results):
    rows, _ = results
    errors = _errors(rows)
    assert max(errors.values()) <= TARGET_MAX_ABS_ERROR


@pytest.mark.xfail(strict=True, reason="issue 9 target not reached: the median row estimates ~8.2 % fast")
def test_target_median_within_8_percent(results):
    rows, _ = results
    assert statistics.median(_errors(rows).values()) <= TARGET_MEDIAN_ABS_ERROR


@pytest.mark.xfail(strict=True, reason="issue 9 target not reached: torch's interleaved schedule keeps more "
                                      "micro-batches in flight than Llama 3's own, so its layout does not fit")
def test_target_no_refused_layout(results):
    rows, _ = results
    assert not [r for r in rows if r["error"] is None or r.get("fits") is False]


def test_target_top_pick_within_5_percent_of_the_best(results):
    # a thin lead today: the best (dp64) estimates 26.8 s, pp2 with micro-batch 2 (measured 25 % slower) 26.9 s
    _, sweeps = results
    for s in sweeps:
        assert s["top_pick_regret"] <= TARGET_REGRET
