"""``autopar sweep``: quantities, rounding, the economics, the frontier, the command and its files, and the same
sweep from one process, a pool, and Ray."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest

from autopar.api import setup
from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.frontend import trace_model
from autopar.inter_op.search import UnitCostCache, search
from autopar.plan_file import Plan
from autopar.sweep.economics import Power, Reliability, load_prices, point_economics
from autopar.sweep.frontier import mark_frontier, pareto
from autopar.sweep.grid import nearest_gpus, sweep_points
from autopar.sweep.quantities import parse_amount, parse_duration_s, parse_gpu_counts
from autopar.sweep.report import to_json
from autopar.sweep.sweep import SweepRequest, accuracy_note, run_sweep

ROOT = Path(__file__).resolve().parents[1]
TINY = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 128}
TINY_ARG = "layers=4,hidden=256,heads=4,vocab=1024,seq_len=128"
PRICES = ROOT / "examples" / "prices.toml"
# 288 sequences: whole micro-batches on 8, 64 and 72 GPUs (a GB200 NVL72 rack)
TINY_SWEEP = ["gpt", "--config", TINY_ARG, "--tokens", "20B", "--global-batch", "288", "--gpus", "8,64,100",
              "--cluster", "h100-80gb,gb200-nvl72"]


def test_quantities() -> None:
    assert parse_amount("15T", "--tokens") == 15e12
    assert parse_amount("4Mi", "--tokens-per-batch") == 4 * 2**20
    assert parse_amount("$2M", "--budget") == 2e6
    assert parse_amount("2.5e9", "--tokens") == 2.5e9
    assert parse_duration_s("60d", "--deadline") == 60 * 86400
    assert parse_duration_s("90m", "--deadline") == 5400
    assert parse_gpu_counts("64,128,...,1024") == [64, 128, 256, 512, 1024]
    assert parse_gpu_counts("72,144,...,432") == [72, 144, 216, 288, 360, 432]  # not on x2: +72
    assert parse_gpu_counts("512, 64,64") == [64, 512]
    for bad in ("0", "-5T", "abc", "15X", ""):
        with pytest.raises(AutoparError, match="--tokens"):
            parse_amount(bad, "--tokens")
    for bad in ("1,...,8", "64,128,...,1000", "64,0", "64,x"):
        with pytest.raises(AutoparError, match="--gpus"):
            parse_gpu_counts(bad)
    with pytest.raises(AutoparError, match="--deadline"):
        parse_duration_s("5 fortnights", "--deadline")


def test_gpu_counts_round_to_what_a_cluster_takes() -> None:
    nvl72, h100 = load_cluster("gb200-nvl72"), load_cluster("h100-80gb")
    assert [nearest_gpus(nvl72, n) for n in (4, 6, 64, 100, 110, 256, 4096)] == [4, 8, 64, 72, 144, 288, 4104]
    assert [nearest_gpus(h100, n) for n in (3, 8, 100, 1024)] == [3, 8, 104, 1024]
    points = sweep_points({"gb200-nvl72": nvl72}, [70, 72, 80, 256])
    assert [(p.gpus, p.asked, p.rounded) for p in points] == [(72, (70, 72, 80), True), (288, (256,), True)]
    for p in points:  # every rounded count builds
        nvl72.with_overrides(gpus=p.gpus)


def test_goodput_follows_the_failure_model() -> None:
    rel = Reliability()
    small, big = rel.goodput(64, 70e9), rel.goodput(16384, 70e9)
    assert 0.99 < small.fraction < 1 and big.fraction < small.fraction
    # Young's interval: checkpointing half or twice as often loses more
    for scale in (0.5, 2.0):
        other = Reliability(checkpoint_every_s=big.checkpoint_every_s * scale).goodput(16384, 70e9)
        assert other.fraction < big.fraction
    # Llama 3's rate on its 16,384 GPUs: 419 in 54 days, one every 3.1 h
    assert big.mtbf_s == pytest.approx(54 * 86400 / 419)
    # the formula on round numbers: 1 interruption an hour, 10 min restart, 60 s saves every 30 min
    g = Reliability(interruptions_per_gpu_day=24.0, restart_s=600, checkpoint_every_s=1800,
                    checkpoint_bytes_per_s_per_gpu=1.0).goodput(1, 60 / 12)
    assert g.checkpoint_save_s == pytest.approx(60)
    assert g.fraction == pytest.approx((1 - (900 + 600) / 3600) / (1 + 60 / 1800))
    never = Reliability(interruptions_per_gpu_day=100.0, restart_s=3600).goodput(64, 1e9)
    assert never.fraction == 0.0
    assert Reliability(interruptions_per_gpu_day=0.0).goodput(64, 1e9).fraction == 1.0


def test_energy_and_cost_of_a_point() -> None:
    h100 = load_cluster("h100-80gb")
    power = Power(pue=1.2)
    # 16 GPUs on 2 nodes, computing all the time: TDP plus each node's overhead, times the PUE
    assert power.cluster_w(h100, 16, 1.0) == pytest.approx((16 * 700 + 2 * 4600) * 1.2)
    assert power.cluster_w(h100, 16, 0.0) == pytest.approx((16 * 70 + 2 * 4600) * 1.2)
    assert Power(node_overhead_w=0).cluster_w(h100, 8, 0.5) == pytest.approx(8 * (70 + 630 * 0.5) * 1.1)
    estimate = {"iteration_time_s": 2.0, "tokens_per_s": 1e6, "breakdown": {"compute_s": 1.5, "recompute_s": 0.1}}
    no_failures = Reliability(interruptions_per_gpu_day=0.0)
    out = point_economics(estimate, h100, 16, 1e12, 1e9, load_prices(PRICES), power, no_failures)
    assert out["busy_fraction"] == pytest.approx(0.8)
    assert out["train_s"] == pytest.approx(1e6) and out["wall_s"] == pytest.approx(1e6)
    assert out["gpu_hours"] == pytest.approx(16 * 1e6 / 3600)
    assert out["cost"] == pytest.approx(out["gpu_hours"] * 6.88)
    assert out["energy_kwh"] == pytest.approx(power.cluster_w(h100, 16, 0.8) * 1e6 / 3.6e6)


def test_pareto_and_the_best_choice() -> None:
    assert pareto([(1, 5), (2, 3), (3, 4), (2, 3), (4, 1)]) == [True, True, False, True, True]
    rows = [{"status": "ok", "point": p, "wall_s": t, "cost": c, "gpu_hours": 0, "energy_kwh": e}
            for p, t, c, e in (("a", 10, 100, 5), ("b", 20, 50, 9), ("c", 30, 60, 1), ("d", 5, 400, 50))]
    rows.append({"status": "no-fit", "point": "e"})
    mark_frontier(rows, deadline_s=25, budget=300)
    assert [r["pareto_time_cost"] for r in rows[:4]] == [True, True, False, True]
    assert [r["pareto_time_energy"] for r in rows[:4]] == [True, False, True, True]
    assert [r["best_choice"] for r in rows[:4]] == [False, True, False, False]  # b: the cheapest in time and budget
    assert "pareto_time_cost" not in rows[4]


def test_prices_file_errors(tmp_path: Path) -> None:
    prices = load_prices(PRICES)
    assert prices.currency == "USD" and prices.of("h100-80gb") == 6.88
    with pytest.raises(AutoparError, match="has no price for gb200-nvl72"):
        prices.of("gb200-nvl72")
    bad = tmp_path / "p.toml"
    for text, message in (("[per_gpu_hour]\nh100-80gb = 'x'", "must be a number"), ("x = 1", "no \\[per_gpu_hour\\]"),
                          ("[per_gpu_hour", "not valid TOML")):
        bad.write_text(text)
        with pytest.raises(AutoparError, match=message):
            load_prices(bad)


def test_accuracy_notes_come_from_the_published_runs() -> None:
    note = accuracy_note("h100-80gb", "bf16")
    assert note.startswith("h100-80gb estimates: median error ") and "published runs" in note
    assert accuracy_note("b200", "bf16") == "b200: no published run to check its estimates against"
    assert accuracy_note("b200", "fp8").startswith("b200 estimates: median error ")  # Megatron-Bridge's FP8 runs


def test_cache_serves_the_same_model_traced_again() -> None:
    """The intra-op solves are keyed on the graph's fingerprint: a second trace of the model (another object, as in
    another process) reuses them; another model or another GPU type does not."""
    spec, ctx, batch, budget = setup("h100-80gb", 16, None, None, 64, 60.0, None, "flash", "torch")
    first = trace_model("gpt", TINY, None, ctx).graph
    again = trace_model("gpt", TINY, None, ctx).graph
    other = trace_model("gpt", {**TINY, "hidden": 512}, None, ctx).graph
    assert again is not first and again.fingerprint() == first.fingerprint() != other.fingerprint()
    cache = UnitCostCache(first, spec, ctx, "cbc", 60.0)
    res = search(first, spec, ctx, batch, {}, budget, cache=cache)
    assert res.ilp_solves > 0
    bigger = spec.with_overrides(gpus=64)
    assert cache.serves(again, bigger, ctx) and not cache.serves(other, spec, ctx)
    b200, b200_ctx, _, _ = setup("b200", 16, None, None, 64, 60.0, None, "flash", "torch")
    assert not cache.serves(again, b200, b200_ctx)
    seeded = UnitCostCache(again, spec, ctx, "cbc", 60.0)
    seeded.seed(cache.solved())
    again_res = search(again, spec, ctx, batch, {}, budget, cache=seeded)
    assert again_res.ilp_solves == 0
    assert again_res.best.estimate == res.best.estimate


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    prices = out / "prices.toml"
    prices.write_text(PRICES.read_text() + "gb200-nvl72 = 10.0\n")
    assert main(["sweep", *TINY_SWEEP, "--prices", str(prices), "--jobs", "1", "-o", str(out / "report"),
                 "--csv", str(out / "points.csv"), "--deadline", "30d", "-q"]) == 0
    return out


def test_sweep_writes_its_report(tiny_sweep: Path) -> None:
    report = tiny_sweep / "report"
    data = json.loads((report / "sweep.json").read_text())
    points = {p["point"]: p for p in data["points"]}
    assert set(points) == {"h100-80gb-8", "h100-80gb-64", "h100-80gb-104", "gb200-nvl72-8", "gb200-nvl72-64",
                           "gb200-nvl72-72"}
    assert data["meta"]["global_batch"] == 288 and data["meta"]["tokens"] == 20e9
    rounded = points["gb200-nvl72-72"]
    assert rounded["rounded"] and rounded["gpus_asked"] == [100] and "gb200-nvl72 takes 72" in rounded["note"]
    assert rounded["status"] == "ok"
    assert points["h100-80gb-104"]["status"] == "no-layout"  # 288 sequences split over no mesh of 104
    ok = [p for p in data["points"] if p["status"] == "ok"]
    costs = [p["cost"] for p in ok]
    assert costs == sorted(costs)  # sorted by cost
    assert any(p["pareto_time_cost"] for p in ok) and sum(p["best_choice"] for p in ok) == 1
    for p in ok:
        plan = Plan.load(report / p["plan_file"])
        assert plan.cluster["name"] == p["gpu_type"] and math.prod(plan.mesh["shape"]) == p["gpus"]
        assert plan.estimate["iteration_time_s"] == pytest.approx(p["iteration_time_s"], rel=1e-6)
        assert p["wall_s"] == pytest.approx(20e9 / p["tokens_per_s"] / p["goodput"])
    assert points["h100-80gb-8"]["scaling_efficiency"] == 1.0
    assert points["gb200-nvl72-8"]["error_band"] is None  # no published GB200 run in BF16
    assert points["h100-80gb-8"]["error_band"] > 0
    rows = list(csv.DictReader(io.StringIO((tiny_sweep / "points.csv").read_text())))
    assert [r["point"] for r in rows] == [p["point"] for p in data["points"]]
    assert (report / "sweep.csv").read_text() == (tiny_sweep / "points.csv").read_text()
    assert (report / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "report.html").read_text()
    assert "plotly" in page.lower() and 'class="plan-link"' in page and "no published run" in page


def test_sweep_is_the_same_in_a_pool(tiny_sweep: Path, tmp_path: Path) -> None:
    """Two processes plan the points (the solves travel from each type's first point) and give the same sweep."""
    prices = tiny_sweep / "prices.toml"
    assert main(["sweep", *TINY_SWEEP, "--prices", str(prices), "--jobs", "2", "--deadline", "30d",
                 "-o", str(tmp_path), "-q"]) == 0
    assert (tmp_path / "sweep.json").read_text() == (tiny_sweep / "report" / "sweep.json").read_text()
    for plan in (tiny_sweep / "report" / "plans").iterdir():
        assert (tmp_path / "plans" / plan.name).read_text() == plan.read_text()


@pytest.mark.parametrize("args, message", [
    (["--cluster", "h100-80gb,tpu-v9"], "tpu-v9"),
    (["--cluster", "h100-80gb,gb200-nvl72", "--prices", str(PRICES)], "has no price for gb200-nvl72"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--budget", "2M"], "--budget needs --prices"),
])
def test_bad_input_is_one_line_and_no_report(args: list[str], message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    base = ["gpt", "--config", TINY_ARG, "--tokens", "1B", "--gpus", "8", "--cluster", "h100-80gb"]
    out = tmp_path / "out"
    assert main(["sweep", *base, *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_sweep_on_ray_matches_the_local_run(tiny_sweep: Path) -> None:
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    prices = load_prices(tiny_sweep / "prices.toml")
    req = SweepRequest(model="gpt", clusters=["h100-80gb", "gb200-nvl72"], gpus=[8, 64, 100], tokens=20e9,
                       config=dict(TINY), global_batch=288, prices=prices, deadline_s=30 * 86400)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_sweep(req, ray_address="auto")
    finally:
        ray.shutdown()
    local = json.loads((tiny_sweep / "report" / "sweep.json").read_text())
    mine = json.loads(to_json(on_ray))
    mine["meta"]["prices"] = local["meta"]["prices"]  # the same file, named by another path
    assert mine == local


def _browser():
    """Playwright's Chromium, else Debian's ``chromium``; the reason to skip where neither runs."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="Playwright is an optional extra: pip install -e '.[browser]'")
    import shutil

    return sync_api, shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_renders_in_a_browser(tiny_sweep: Path) -> None:
    sync_api, system_chromium = _browser()
    report = tiny_sweep / "report" / "report.html"
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch()
        except Exception:
            if system_chromium is None:
                pytest.skip("no browser: neither Playwright's Chromium (playwright install chromium) nor Debian's "
                            "chromium is installed")
            browser = p.chromium.launch(executable_path=system_chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report.as_uri())
            page.wait_for_function("() => { const d = document.getElementById('fig0'); "
                                   "return d && d.data && d.querySelector('.scatterlayer .trace'); }", timeout=30000)
            traces = page.evaluate("[...document.querySelectorAll('.plotly-graph-div')].map(d => d.data.length)")
            drawn = page.evaluate("document.getElementById('fig0').querySelectorAll('.scatterlayer .trace').length")
            links = page.evaluate("[...document.querySelectorAll('a.plan-link')].map(a => a.href)")
        finally:
            browser.close()
    assert errors == []
    assert len(traces) == 5 and all(n > 0 for n in traces)
    assert drawn == traces[0]  # the frontier's traces are drawn, not only declared
    planned = [p for p in json.loads((tiny_sweep / "report" / "sweep.json").read_text())["points"]
               if p["status"] == "ok"]
    assert len(links) == len(planned)
    for href in links:
        assert href.startswith("file://")
        Plan.load(Path(href.removeprefix("file://")))


def test_the_leanest_layout_is_the_exhaustive_searchs() -> None:
    """Where nothing fits, the memory the error (and a sweep's point) reports is the least any layout needs: the
    search best-first in the memory bound finds what estimating every layout finds."""
    spec, ctx, batch, _ = setup("h100-80gb", 8, None, None, 32, 60.0, None, "flash", "torch")
    graph = trace_model("gpt", TINY, None, ctx).graph
    budget = 2**20  # 1 MiB: nothing fits
    pruned = search(graph, spec, ctx, batch, {}, budget)
    full = search(graph, spec, ctx, batch, {}, budget, exhaustive=True)
    assert pruned.best is not None and not pruned.best.estimate.fits
    assert pruned.leanest.estimate.peak_memory_bytes == full.leanest.estimate.peak_memory_bytes
    assert pruned.leanest.estimate.peak_memory_bytes <= pruned.best.estimate.peak_memory_bytes
    assert [c.estimate for c in pruned.candidates] == [c.estimate for c in full.candidates]  # the fastest, as before
