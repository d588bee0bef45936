"""The technique registry (``autopar.inter_op.techniques``): every layout knob has one owner, each technique's
``expand`` sets just its knobs, and a technique registered there reaches the space, the estimate and the bound
with no other change."""

from __future__ import annotations

import dataclasses

import pytest
from autopar.passes import PassContext

from autopar.cluster import load_cluster
from autopar.frontend import trace_model
from autopar.inter_op import techniques
from autopar.inter_op.bound import time_bound_s, unit_totals
from autopar.inter_op.estimate import ModelFlops, SharedWork, estimate_layout
from autopar.inter_op.layout import Knob, Layout
from autopar.inter_op.search import UnitCostCache, layouts, search_space
from autopar.inter_op.technique import Technique, UnitLoadDraft, UnitTotals
from autopar.inter_op.unit_costs import unit_sequence

GPT = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 256}


def test_every_layout_field_has_one_owner():
    knobs = [k.name for t in techniques.TECHNIQUES for k in t.knobs]
    assert sorted(knobs) == sorted(f.name for f in dataclasses.fields(Layout) if f.name != "options")
    assert techniques.fix_keys() == [k for k in knobs if k != "num_microbatches"]
    assert len({t.name for t in techniques.TECHNIQUES}) == len(techniques.TECHNIQUES)


@pytest.mark.parametrize("model,config", [("gpt", GPT), ("moe", {"layers": 2, "hidden": 128, "heads": 4,
                                                                  "vocab": 256, "seq_len": 16, "experts": 8})])
def test_each_expand_sets_exactly_its_knobs(model, config):
    cluster = load_cluster("h100-80gb").with_overrides(gpus=16)
    ctx = PassContext(cluster=cluster)
    graph = trace_model(model, config, ctx=ctx).graph
    space = search_space(graph, cluster, 64, {})
    partials: list[dict] = [{}]
    for t in techniques.TECHNIQUES:
        if t.expand is None:
            assert not t.knobs, t.name
            continue
        grown = []
        for p in partials:
            for q in t.expand(space, p):
                assert set(q) - set(p) == {k.name for k in t.knobs}, t.name
                assert all(q[k] == p[k] for k in p), t.name  # it leaves the others' knobs alone
                grown.append(q)
        partials = grown
    assert partials and len(partials) == len(list(layouts(graph, cluster, 64, {})))


def test_a_registered_technique_reaches_the_estimate_and_the_bound(monkeypatch):
    """A toy technique (a fixed host overhead per unit and micro-batch) registered in the one list: the estimate of
    a single-device layout grows by exactly that overhead times units times micro-batches, and so does the bound."""
    overhead_s = 1e-3

    def step(d: UnitLoadDraft) -> None:
        d.compute_s += overhead_s

    def term(t: UnitTotals, layout: Layout, links, cluster, ctx) -> float:
        return overhead_s * t_units * layout.num_microbatches

    cluster = load_cluster("a100-80gb").with_overrides(gpus=1)
    ctx = PassContext(cluster=cluster)
    graph = trace_model("gpt", GPT, ctx=ctx).graph
    keys = unit_sequence(graph)
    t_units = len(keys)
    layout = next(lay for lay in layouts(graph, cluster, 8, {"mbs": 2, "recompute": "none"}))
    assert layout.num_microbatches == 4
    costs, _ = UnitCostCache(graph, cluster, ctx, "cbc", 60.0).get(1, 2, False, "fast")
    counts = {k: keys.count(k) for k in dict.fromkeys(keys)}
    flops = ModelFlops.of(graph)

    def measure() -> tuple[float, float]:
        est = estimate_layout(graph, costs, layout, 8, cluster, ctx, float("inf"), flops, keys=keys,
                              shared=SharedWork())
        shared = SharedWork()
        bound = time_bound_s(unit_totals(costs, counts, layout, ctx), layout, cluster, ctx,
                             shared.links(cluster, layout))
        return est.iteration_time_s, bound

    before = measure()
    toy = Technique("toy_host_overhead", unit_step=step, time_bound_s=term)
    monkeypatch.setattr(techniques, "TECHNIQUES", (*techniques.TECHNIQUES, toy))
    after = measure()
    added = overhead_s * t_units * layout.num_microbatches
    assert after[0] - before[0] == pytest.approx(added, rel=1e-6)
    assert after[1] - before[1] == pytest.approx(added, rel=1e-6)


@pytest.fixture
def toy_registered(monkeypatch):
    """Registers (in the one list) a toy technique with a layout knob of its own, ``toy_passes`` (0-2, searched),
    and a framework flag of its own, ``toy_pass_s`` in its table ``[toy_passes]``: each pass adds ``toy_pass_s`` to
    every unit per micro-batch.  Yields the flag's default."""
    from autopar.framework import load_framework

    default_s = 1e-3

    def expand(space, p):
        for n in space.allowed("toy_passes", [0, 1, 2]):
            yield {**p, "toy_passes": n}

    def step(d: UnitLoadDraft) -> None:
        d.compute_s += d.layout.option("toy_passes") * d.ctx.framework.option("toy_pass_s")

    toy = Technique("toy_passes", (Knob("toy_passes", low=0, high=2),), expand=expand, unit_step=step,
                    flags=(("toy_pass_s", default_s),))
    monkeypatch.setattr(techniques, "TECHNIQUES", (*techniques.TECHNIQUES, toy))
    load_framework.cache_clear()  # profiles loaded before the toy was registered lack its flag
    yield default_s
    monkeypatch.undo()
    load_framework.cache_clear()  # nor may later tests get profiles with it


def test_a_technique_s_own_knob_and_flag_need_no_other_file(toy_registered, tmp_path):
    """The toy's knob is pinned by --fix, searched, written to the plan file's layout, shown, and read back; its flag is
    set in its own table of a framework profile, and its value reaches the estimate: layout.py, framework.py, the
    CLI and the plan file know nothing of it."""
    import json

    from autopar.cli import main
    from autopar.errors import AutoparError
    from autopar.framework import FrameworkSpecError, load_framework

    assert "toy_passes" in techniques.fix_keys()
    assert techniques.parse_fix("toy_passes=2,tp=1") == {"toy_passes": 2, "tp": 1}
    with pytest.raises(AutoparError, match=r"^layout key toy_passes=3 is out of range$"):
        techniques.parse_fix("toy_passes=3")
    assert load_framework("torch").option("toy_pass_s") == toy_registered
    profile = tmp_path / "toy.toml"
    profile.write_text('base = "torch"\n[toy_passes]\ntoy_pass_s = 0.25\n')
    assert load_framework(str(profile)).option("toy_pass_s") == 0.25
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "torch"\n[toy_passes]\ntoy_pass_s = "slow"\n')
    with pytest.raises(FrameworkSpecError, match="toy_pass_s must be a float"):
        load_framework(str(bad))

    cluster = load_cluster("a100-80gb").with_overrides(gpus=1)
    graph = trace_model("gpt", GPT, ctx=PassContext(cluster=cluster)).graph
    space = list(layouts(graph, cluster, 8, {"mbs": 2, "recompute": "none"}))
    assert {lay.option("toy_passes") for lay in space} == {0, 1, 2}
    # one search's shared work (its memo of unit loads) tells the toy's values apart
    costs, _ = UnitCostCache(graph, cluster, PassContext(cluster=cluster), "cbc", 60.0).get(1, 2, False, "fast")
    shared, keys = SharedWork(), unit_sequence(graph)
    times = {lay.option("toy_passes"): estimate_layout(graph, costs, lay, 8, cluster, PassContext(cluster=cluster),
                                                        float("inf"), ModelFlops.of(graph), keys=keys,
                                                        shared=shared).iteration_time_s
             for lay in space if lay.zero == 0}
    per_pass_s = toy_registered * len(keys) * space[0].num_microbatches
    assert times[2] - times[1] == pytest.approx(per_pass_s, rel=1e-6)
    assert times[1] - times[0] == pytest.approx(per_pass_s, rel=1e-6)

    def plan(fix: str, framework: str, out: str) -> dict:
        args = ["plan", "gpt", "--config", ",".join(f"{k}={v}" for k, v in GPT.items()), "--gpus", "1",
                "--global-batch", "8", "--fix", fix, "--framework", framework, "--jobs", "1", "-o", str(tmp_path / out),
                "-q"]
        assert main(args) == 0
        return json.loads((tmp_path / out / "plan.json").read_text())

    none = plan("toy_passes=0,mbs=2,recompute=none", "torch", "none")
    two = plan("toy_passes=2,mbs=2,recompute=none", str(profile), "two")
    assert none["layout"]["toy_passes"] == 0 and two["layout"]["toy_passes"] == 2
    assert Layout.of(two["layout"]).option("toy_passes") == 2
    assert Layout.of(two["layout"]).to_dict() == two["layout"]
    assert Layout.of(two["layout"]).describe().endswith(" toy_passes=2")
    units = len(unit_sequence(graph))
    added_s = 2 * 0.25 * units * two["layout"]["num_microbatches"]
    assert (two["estimate"]["iteration_time_s"] - none["estimate"]["iteration_time_s"]
            == pytest.approx(added_s, rel=1e-6))


@pytest.mark.parametrize("fixed,message", [
    ({"dp": 3}, "--fix dp=3 does not divide the 8 devices"),
    ({"cp": 16}, "--fix cp=16 does not divide the 8 devices"),
    ({"dp": 2, "tp": 2, "pp": 1}, "--fix dp*cp*tp*pp = 4 but the cluster has 8 devices"),
    ({"pp": 8}, "--fix pp=8 exceeds the 4 layers"),
    ({"dp": 8, "mbs": 3}, "global batch 64 is not divisible by dp*mbs = 24"),
])
def test_pinned_values_each_technique_refuses_are_one_line_errors(fixed, message):
    from autopar.errors import AutoparError
    from autopar.inter_op.search import check_fixed

    cluster = load_cluster("a100-80gb").with_overrides(gpus=8)
    graph = trace_model("gpt", GPT, ctx=PassContext(cluster=cluster)).graph
    with pytest.raises(AutoparError) as err:
        check_fixed(graph, cluster, 64, fixed)
    assert str(err.value) == message


def test_a_model_of_one_block_refuses_pipeline_stages_in_one_line():
    """One block is no stack: ``--fix pp=2`` has nothing to cut into stages, and says so (it said "exceeds the 0
    layers")."""
    from autopar.errors import AutoparError
    from autopar.inter_op.search import check_fixed

    cluster = load_cluster("a100-80gb").with_overrides(gpus=8)
    graph = trace_model("gpt", {**GPT, "layers": 1}, ctx=PassContext(cluster=cluster)).graph
    assert not graph.layers
    with pytest.raises(AutoparError, match=r"this model has none .* plan with --fix pp=1$") as err:
        check_fixed(graph, cluster, 64, {"pp": 2})
    assert "\n" not in str(err.value)
