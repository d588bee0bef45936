"""Published runs (shared/reference): the unconstrained search beats or matches each pinned layout.

The estimate-vs-measurement comparison itself is a benchmark (benchmarks/calibration.py), not a test.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFS = ROOT.parent / "shared" / "reference" / "calibration.json"


def _calibration():
    spec = importlib.util.spec_from_file_location("calibration", ROOT / "benchmarks" / "calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cases():
    if not REFS.exists():
        return []
    return [c for c in json.loads(REFS.read_text())["cases"] if "layout" in c and "global_batch" in c]


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["case_id"])
def test_search_is_at_least_as_fast_as_the_published_layout(case):
    row = _calibration().run_case(case, do_search=True)
    assert row["fits"], "the published layout should fit"
    assert row["search_fits"]
    assert row["search_estimate_s"] <= row["estimate_s"] * (1 + 1e-9)


def test_references_are_present():
    if not REFS.exists():
        pytest.skip(f"{REFS} not found (shared/ is laid beside the checkout)")
    assert len(_cases()) >= 4
