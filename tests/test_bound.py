"""The search's lower bounds (``autopar.inter_op.bound``) never exceed the estimate they stand for."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from autopar.passes import PassContext

from autopar.cluster import load_cluster
from autopar.framework import load_framework
from autopar.frontend import trace_model
from autopar.inter_op.bound import memory_bound_bytes, time_bound_s, unit_totals
from autopar.inter_op.estimate import ModelFlops, SharedWork, estimate_layout
from autopar.inter_op.search import UnitCostCache, expert_parallel_runs, layouts
from autopar.inter_op.unit_costs import unit_sequence

LORA = str(Path(__file__).parent.parent / "examples" / "lora_llama.py")
MODELS = str(Path(__file__).parent.parent / "examples" / "hf_models.py")
TINY_LORA = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 512, "rank": 8}

#: (model, config, cluster, GPUs, global batch, framework, attention): dense, grouped-query and MoE models, every
#: framework profile's way of reducing, overlapping, storing and splitting stages.
CASES = [
    ("gpt", {"layers": 8, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 512}, "a100-80gb", 32, 64, "torch",
     "flash"),
    ("gpt", {"layers": 6, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 256, "dropout": 0.1}, "a100-80gb", 16,
     32, "megatron-lm", "math"),
    ("gpt", {"layers": 6, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 256}, "a100-80gb", 16, 32, "deepspeed",
     "math"),
    ("llama", {"layers": 6, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn": 704, "vocab": 512, "seq_len": 2048},
     "h100-80gb", 32, 32, "llama3", "flash"),
    ("llama", {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn": 704, "vocab": 512, "seq_len": 1024},
     "h100-80gb", 16, 32, "megatron-core", "flash3"),
    ("gpt", {"layers": 4, "hidden": 256, "heads": 4, "vocab": 512, "seq_len": 512}, "h100-80gb", 16, 64, "llm-foundry",
     "flash1"),
    ("moe", {"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 16, "experts": 8, "top_k": 2},
     "h100-80gb", 16, 32, "torchtitan", "flash"),
    # a frozen base (LoRA): no gradients, no optimizer state, 16-bit weights, in both state layouts
    (LORA, {**TINY_LORA, "seq_len": 256}, "h100-80gb", 16, 32, "torch", "flash"),
    (LORA, {**TINY_LORA, "seq_len": 256}, "a100-80gb", 16, 32, "megatron-core", "flash"),
    # an encoder-decoder, whose pipeline splits the encoder's blocks then the decoder's layers
    (MODELS, {"arch": "t5", "layers": 4, "hidden": 128, "heads": 4, "vocab": 512, "seq_len": 256}, "h100-80gb", 16,
     32, "torch", "flash"),
]


def _traced(case: tuple) -> tuple:
    """A case's graph, cluster, context, global batch, unit-cost cache, unit sequence and unit counts."""
    model, config, cluster_name, gpus, batch, framework, attention = case
    cluster = load_cluster(cluster_name).with_overrides(gpus=gpus)
    ctx = PassContext(cluster=cluster, attention=attention, framework=load_framework(framework))
    graph = trace_model(model, config, ctx=ctx).graph
    keys = unit_sequence(graph)
    return (graph, cluster, ctx, batch, UnitCostCache(graph, cluster, ctx, "cbc", 60.0), keys,
            {k: keys.count(k) for k in dict.fromkeys(keys)})


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{Path(c[0]).stem}-{c[5]}")
def test_bounds_never_exceed_the_estimate(case):
    """On random layouts of each model (every kind the search enumerates: schedules, v, groups, cp, ep, ZeRO,
    recomputation), the time bound stays at or under the estimated iteration time, and the memory bound under
    the peak memory of the split the estimate settles on (any split holds at least that much)."""
    graph, cluster, ctx, batch, cache, keys, counts = _traced(case)
    shared, flops = SharedWork(), ModelFlops.of(graph)
    everything = list(layouts(graph, cluster, batch, {}, ctx.framework))
    rng = random.Random(0)
    checked = 0
    for layout in rng.sample(everything, min(60, len(everything))):
        costs, _ = cache.get(layout.tp, layout.mbs, layout.sp, "fast")
        if not expert_parallel_runs(layout, costs):
            continue
        est = estimate_layout(graph, costs, layout, batch, cluster, ctx, float("inf"), flops, keys=keys,
                              shared=shared)
        if est is None:
            continue  # interleaving whose chunks a split cannot fill
        totals = unit_totals(shared.shares(costs, layout, cluster), counts, layout, ctx)
        time_lb = time_bound_s(totals, layout, cluster, ctx, shared.links(cluster, layout))
        assert 0 < time_lb <= est.iteration_time_s * (1 + 1e-9), layout
        assert memory_bound_bytes(totals, layout, ctx) <= est.peak_memory_bytes * (1 + 1e-9), layout
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 3, 4, 6)], ids=lambda c: f"{Path(c[0]).stem}-{c[5]}")
def test_a_family_s_floor_is_under_the_bound_of_each_of_its_layouts(case):
    """The search queues the layouts that differ only in the last technique's knobs (the schedule, v, groups) as one
    family under a floor.  On random families of each model the floor is at or under every member's own bound, and
    the unit totals are the same for all members (they do not read those knobs): a family never opened holds no
    layout that could have won."""
    from autopar.inter_op.layout import Layout
    from autopar.inter_op.search import last_expanding_technique, layout_families

    graph, cluster, ctx, batch, cache, _, counts = _traced(case)
    shared = SharedWork()
    deferred = last_expanding_technique()
    families = layout_families(graph, cluster, batch, {}, ctx.framework)
    rng = random.Random(1)
    several = [f for f in families if len(f) > 1]  # the families of several schedules, and a few of one
    single = [f for f in families if len(f) == 1]
    assert several
    for family in rng.sample(several, min(30, len(several))) + rng.sample(single, min(10, len(single))):
        first = Layout.of(family[0])
        costs, _ = cache.get(first.tp, first.mbs, first.sp, "fast")
        totals = unit_totals(shared.shares(costs, first, cluster), counts, first, ctx)
        floor = time_bound_s(totals, first, cluster, ctx, shared.links(cluster, first), deferred=deferred)
        assert floor > 0
        for p in family:
            layout = Layout.of(p)
            assert unit_totals(shared.shares(costs, layout, cluster), counts, layout, ctx) == totals
            assert floor <= time_bound_s(totals, layout, cluster, ctx, shared.links(cluster, layout)) * (1 + 1e-12), \
                layout


def test_the_bound_prunes_across_pipeline_depths():
    """The bubble, the optimizer step and the unhidden dp traffic make the bound differ across pp, where the old
    ``m * work / pp`` gave every depth the same: most of a large search is never estimated, and the plan is the
    exhaustive search's."""
    from autopar.inter_op.search import search

    cluster = load_cluster("a100-80gb").with_overrides(gpus=64)
    ctx = PassContext(cluster=cluster)
    graph = trace_model("gpt", {"layers": 16, "hidden": 1024, "heads": 16, "vocab": 2048, "seq_len": 1024},
                        ctx=ctx).graph
    pruned = search(graph, cluster, ctx, 256, {}, cluster.usable_memory_bytes)
    assert pruned.enumerated == pruned.evaluated + pruned.pruned_bound + pruned.pruned_memory
    assert pruned.pruned_bound > 5 * pruned.evaluated
    full = search(graph, cluster, ctx, 256, {}, cluster.usable_memory_bytes, exhaustive=True)
    assert full.evaluated == full.enumerated
    assert full.best.estimate.layout == pruned.best.estimate.layout
    assert full.best.estimate.iteration_time_s == pruned.best.estimate.iteration_time_s
