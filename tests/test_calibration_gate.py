"""The calibration gate: autopar's estimates of the published runs in ``benchmarks/reference``.

Each row is planned with its published layout pinned (``benchmarks/reference_runs.py``) and compared with
its measured iteration time; the measured sweep checks the ranking of layouts; the wider tables (llm-foundry's MPT
runs, the Megatron-LM README's H100 table, NVIDIA's H100 BF16/FP8 runs) are checked per GPU.  Two kinds of tests:

- **guards** hold the accuracy the cost model reaches today, so that a change that makes it worse fails;
- **targets** are issue 29's acceptance bounds.  The ones the model does not reach yet are marked ``xfail``
  with ``strict=True``: they report as expected failures, and the day one passes it fails, to be promoted
  to a guard.

Traces and intra-op solves are shared by all rows of a table (one module-scoped run of each).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: Today's accuracy on the 19 published runs, as guards (benchmarks/results and docs/accuracy.md show the figures).
GUARD_MAX_ABS_ERROR = 0.20
GUARD_MEDIAN_ABS_ERROR = 0.07
GUARD_SIGNED_MEDIAN = -0.07  # the median row is estimated at most 7 % fast
KNOWN_REFUSED = {"llama3_405b_8192_cp1"}  # saves more per layer than fits (test_target_no_refused_layout)
#: Issue 29's acceptance.
TARGET_MAX_ABS_ERROR = 0.15
TARGET_MEDIAN_ABS_ERROR = 0.06
TARGET_SIGNED = 0.03
TARGET_TOO_SLOW = 6
TARGET_WIDER_MEDIAN = 0.10  # each GPU of llm-foundry's tables, and the Megatron-Core H100 table
TARGET_SPEARMAN = 0.85
TARGET_REGRET = 0.03
#: The DiT-XL/2 run of benchmarks/reference/beyond_decoders.json today (-42.4 %), as a guard.
GUARD_DIT_ABS_ERROR = 0.45
#: NVIDIA's H100 BF16/FP8 runs today, as a guard against a correction that only makes H100 estimates slower.
GUARD_NVIDIA_MEDIAN = 0.06
GUARD_NVIDIA_SIGNED = 0.03
#: NVIDIA's Blackwell FP8 runs today: each GPU's median within 10 % (the wider tables' target), no run beyond 30 %
#: (the two beyond 20 %, -26 % and -24 %, are layouts of B200's and GB200's first releases, NeMo 25.02 and 25.04),
#: and Megatron-Bridge 26.06's GB200-over-H100 speed-up per GPU (2.54x estimated, 2.59x measured): what capacity
#: planning across GPU types rests on.
GUARD_BLACKWELL_MAX_ABS_ERROR = 0.30
GUARD_GENERATION_RATIO = 0.05

#: llm-foundry runs (benchmarks/reference/llm_foundry_tables.json) whose estimated peak memory comes closest
#: to their GPU's (82-89 % of it, 90-100 % of what the planner counts usable), one per model, sequence and GPU
#: among the tightest: runs that really ran must stay plannable.
TIGHTEST_LLM_FOUNDRY = ("mpt_3b_8192_8_h100_80gb_3x6", "mpt_3b_8192_8_a100_80gb_3x6", "mpt_1b_2048_32_a100_40gb_10x1",
                        "mpt_1b_2048_16_h100_80gb_20x1", "mpt_350m_2048_16_a100_40gb_18x1",
                        "mpt_3b_2048_32_a100_40gb_6x1", "mpt_30b_8192_8_h100_80gb_1x21",
                        "mpt_30b_8192_8_a100_80gb_1x21", "mpt_760m_8192_8_a100_40gb_3x4",
                        "mpt_760m_16384_8_a100_80gb_3x2")

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _benchmarks(*names: str):
    """The ``benchmarks/`` modules ``names``, importable while the block runs."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def results():
    with _benchmarks("calibration", "ranking", "reference_runs") as (calibration, ranking, reference_runs):
        traces = calibration.TraceCache()
        rows = [calibration.estimate_case(case, traces) for case in reference_runs.load_calibration()]
        sweeps = [ranking.rank_sweep(name, sweep, traces) for name, sweep in reference_runs.load_sweeps().items()]
    return rows, sweeps


def _errors(rows) -> dict[str, float]:
    return {r["case_id"]: abs(r["error"]) for r in rows if r["error"] is not None}


def test_reference_data_is_in_the_repository():
    with _benchmarks("reference_runs") as (reference_runs,):
        assert len(reference_runs.load_calibration()) >= 19
        assert sum(len(s["runs"]) for s in reference_runs.load_sweeps().values()) >= 74


def test_guard_every_row_has_an_estimate_within_the_guard(results):
    rows, _ = results
    errors = _errors(rows)
    assert len(errors) == len(rows)  # a refused layout is still estimated, marked as not fitting
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GUARD_MAX_ABS_ERROR, f"{worst}: {errors[worst]:+.1%}"


def test_guard_median_error(results):
    rows, _ = results
    assert statistics.median(_errors(rows).values()) <= GUARD_MEDIAN_ABS_ERROR
    assert statistics.median(r["error"] for r in rows) >= GUARD_SIGNED_MEDIAN


def test_guard_no_new_refusals(results):
    rows, _ = results
    refused = {r["case_id"] for r in rows if r["error"] is None or r.get("fits") is False}
    assert refused <= KNOWN_REFUSED, sorted(refused - KNOWN_REFUSED)


def test_guard_the_memory_tightest_llm_foundry_runs_fit(wider):
    rows = {r["case_id"]: r for r in wider["llm_foundry_tables"]}
    for case in TIGHTEST_LLM_FOUNDRY:
        r = rows[case]
        assert r["error"] is not None and r["fits"], (r["case_id"], r.get("note"), r.get("peak_memory_gib"))


def test_target_sweep_ranking(results):
    _, sweeps = results
    for s in sweeps:
        assert s["spearman"] >= TARGET_SPEARMAN, f"{s['sweep']}: {s['spearman']:.3f}"
        assert s["top_pick_regret"] <= TARGET_REGRET
        assert not s["refused"], s["refused"]


@pytest.mark.xfail(strict=True, reason="issue 29 target not reached: MT-NLG (-18 %), Megatron-Core's 1.7B on H100 "
                                      "(-18 %) and DeepSpeed's ZeRO-3 175B (-14 %) estimate fast")
def test_target_every_row_within_15_percent(results):
    rows, _ = results
    assert max(_errors(rows).values()) <= TARGET_MAX_ABS_ERROR


def test_target_median_within_6_percent(results):
    rows, _ = results
    assert statistics.median(_errors(rows).values()) <= TARGET_MEDIAN_ABS_ERROR


@pytest.mark.xfail(strict=True, reason="issue 29 target not reached: 15 of 19 rows estimate fast (signed median -6 %)")
def test_target_no_one_sided_bias(results):
    rows, _ = results
    scored = [r["error"] for r in rows if r["error"] is not None]
    assert abs(statistics.median(scored)) <= TARGET_SIGNED
    assert sum(e > 0 for e in scored) >= TARGET_TOO_SLOW


@pytest.mark.xfail(strict=True, reason="issue 29 target not reached: Llama 3 405B at 8K without recomputation fits "
                                      "only under 29 B of saved activations per layer and s h / tp elements (1F1B's "
                                      "120 layer-micro-batches in flight on its fullest stage); DTensor saves 66, "
                                      "Megatron 38, and no public source says how Meta's stack saved less")
def test_target_no_refused_layout(results):
    rows, _ = results
    assert not [r for r in rows if r["error"] is None or r.get("fits") is False]


WIDER = ("llm_foundry_tables", "megatron_core_h100_table", "nvidia_h100_tables", "nvidia_blackwell_tables",
         "beyond_decoders")


@pytest.fixture(scope="module")
def wider():
    with _benchmarks("calibration", "reference_runs") as (calibration, reference_runs):
        tables = {stem: reference_runs.load_calibration(BENCHMARKS / "reference" / f"{stem}.json") for stem in WIDER}
        rows = _in_two_processes(calibration.run_all, [case for cases in tables.values() for case in cases])
        return {stem: [rows[case["case_id"]] for case in cases] for stem, cases in tables.items()}


def _in_two_processes(run_all, cases: list[dict]) -> dict[str, dict]:
    """``run_all`` over ``cases`` (the 241 rows of the wider tables take most of the suite's single core) in two
    processes, each model's rows in one of them so that they share its trace; rows by case id.  Each row's
    estimate does not depend on which others share its process."""
    models = sorted({json.dumps(case["model"], sort_keys=True) for case in cases})
    half = {model: i % 2 for i, model in enumerate(models)}
    parts = [[case for case in cases if half[json.dumps(case["model"], sort_keys=True)] == i] for i in (0, 1)]
    context = multiprocessing.get_context("spawn")  # a forked worker may inherit a lock torch's threads held
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        return {row["case_id"]: row for part in pool.map(run_all, parts) for row in part}


def _by_gpu(rows) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        assert r["error"] is not None and r.get("fits") is not False, (r["case_id"], r.get("note"))
        out.setdefault((r["cluster"], r.get("precision", "bf16")), []).append(r["error"])
    return out


@pytest.mark.parametrize("gpu", ["a100-40gb", "a100-80gb", "h100-80gb"])
def test_target_llm_foundry_within_10_percent_on_each_gpu(wider, gpu):
    errors = _by_gpu(wider["llm_foundry_tables"])[gpu, "bf16"]
    assert statistics.median(abs(e) for e in errors) <= TARGET_WIDER_MEDIAN


def test_target_megatron_core_h100_table_within_10_percent(wider):
    errors = [e for group in _by_gpu(wider["megatron_core_h100_table"]).values() for e in group]
    assert statistics.median(abs(e) for e in errors) <= TARGET_WIDER_MEDIAN


def test_guard_nvidia_h100_runs_stay_balanced_in_bf16_and_fp8(wider):
    """NVIDIA's H100 runs, BF16 and FP8 apart: a correction that only made H100 estimates slower fails here."""
    for (gpu, precision), errors in _by_gpu(wider["nvidia_h100_tables"]).items():
        assert statistics.median(abs(e) for e in errors) <= GUARD_NVIDIA_MEDIAN, (gpu, precision)
        assert abs(statistics.median(errors)) <= GUARD_NVIDIA_SIGNED, (gpu, precision)


def test_guard_blackwell_runs_and_the_speed_up_over_hopper(wider):
    """Each GPU of the table (B200, GB200, and the H100 runs beside them) within 10 % on median, no run beyond 30 %,
    and Llama 3.1 405B's per-GPU speed-up from 1024 H100s to 256 GB200s (one Megatron-Bridge release, one global
    batch) within 5 % of the published one.  NeMo 25.02's B200-over-H100 pair is not held to it: Megatron-Bridge
    25.11 ran the same B200 layouts 6-18 % faster than B200's first release did (docs/cost-model.md)."""
    rows = {r["case_id"]: r for r in wider["nvidia_blackwell_tables"]}
    for (gpu, _), errors in _by_gpu(rows.values()).items():
        assert statistics.median(abs(e) for e in errors) <= TARGET_WIDER_MEDIAN, gpu
        assert all(abs(e) <= GUARD_BLACKWELL_MAX_ABS_ERROR for e in errors), gpu
    hopper, blackwell = rows["mbridge2606_llama31_405b_1024_h100_fp8"], rows["mbridge2606_llama31_405b_256_gb200_fp8"]

    def speed_up(key: str) -> float:
        return hopper[key] * hopper["gpus"] / (blackwell[key] * blackwell["gpus"])

    assert speed_up("estimate_s") == pytest.approx(speed_up("measured_s"), rel=GUARD_GENERATION_RATIO)


def test_guard_beyond_decoders(wider):
    """BERT-large's published runs (8 to 256 A100s) stay within 10 %; the DiT run stays no further off than today's
    -42 % (its eager autocast run does what the estimate does not price: docs/accuracy.md)."""
    rows = {r["case_id"]: r for r in wider["beyond_decoders"]}
    bert = [r for case, r in rows.items() if case.startswith("nvidia_bert_large")]
    assert len(bert) == 3 and all(abs(r["error"]) <= 0.10 for r in bert), [(r["case_id"], r["error"]) for r in bert]
    assert abs(rows["fast_dit_xl2_a100_bs128_ckpt_amp"]["error"]) <= GUARD_DIT_ABS_ERROR
