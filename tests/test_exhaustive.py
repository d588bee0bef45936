"""Pruning is exact: the search with its bounds and cut-offs writes the same plan file, byte for byte, as the one
that estimates every layout (``autopar plan --exhaustive``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.api import plan_model
from autopar.framework import FRAMEWORKS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HF = str(EXAMPLES / "hf_decoder.py")
GPT = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 256}
GPT8 = {"layers": 8, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 512}
LLAMA = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 352, "vocab": 256, "seq_len": 2048}
MOE = {"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 16, "experts": 8, "top_k": 2}

#: (model, config, cluster, GPUs, global batch, framework, attention): zoo and HuggingFace models, 8 to 1024 GPUs,
#: every framework profile (``tests/test_exhaustive.py::test_the_cases_cover_every_framework``).
CASES = [
    ("gpt", GPT, "a100-80gb", 8, 32, "torch", "flash"),
    ("gpt", GPT8, "a100-80gb", 64, 128, "torch", "flash"),
    ("gpt", GPT, "a100-80gb", 1024, 1024, "torch", "flash"),
    ("gpt", GPT8, "h100-80gb", 16, 64, "torchtitan", "flash"),
    ("gpt", GPT8, "a100-80gb", 32, 64, "megatron-lm", "math"),
    ("gpt", GPT, "a100-40gb", 16, 64, "megatron-lm", "math"),
    ("gpt", GPT8, "h100-80gb", 32, 64, "megatron-core", "flash3"),
    ("gpt", GPT8, "h100-80gb", 16, 32, "nemo", "flash3"),
    ("gpt", GPT8, "a100-80gb", 16, 64, "deepspeed", "math"),
    ("gpt", GPT, "a100-80gb", 128, 256, "deepspeed", "math"),
    ("gpt", GPT8, "h100-80gb", 8, 64, "llm-foundry", "flash1"),
    ("gpt", GPT8, "a100-80gb", 32, 64, "aa-scaling", "flash"),
    ("llama", LLAMA, "h100-80gb", 32, 32, "llama3", "flash"),
    ("llama", LLAMA, "h100-80gb", 64, 64, "torchtitan", "flash"),
    ("llama", LLAMA, "h200", 16, 16, "megatron-core", "flash3"),
    ("llama", LLAMA, "gb200-nvl72", 72, 72, "torch", "flash"),
    ("moe", MOE, "h100-80gb", 16, 32, "torch", "flash"),
    ("moe", MOE, "h100-80gb", 32, 64, "torchtitan", "flash"),
    (HF, {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128}, "a100-80gb", 8, 16, "torch", "flash"),
    (HF, {"arch": "gpt2", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128}, "h100-80gb", 16, 32, "torchtitan",
     "flash"),
    (HF, {"arch": "mixtral", "layers": 2, "hidden": 64, "heads": 4, "vocab": 128}, "h100-80gb", 8, 16, "torch",
     "flash"),
    # an encoder-decoder: the stages split its encoder's blocks, then its decoder's layers
    (str(EXAMPLES / "hf_models.py"), {"arch": "bart", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128,
                                      "seq_len": 64}, "a100-80gb", 16, 32, "torch", "flash"),
]


def test_the_cases_cover_every_framework():
    assert {c[5] for c in CASES} == set(FRAMEWORKS)
    assert len(CASES) >= 20
    assert min(c[3] for c in CASES) == 8 and max(c[3] for c in CASES) == 1024


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{Path(c[0]).stem}-{c[3]}-{c[5]}")
def test_the_pruned_search_writes_the_exhaustive_plan_file(case):
    model, config, cluster, gpus, batch, framework, attention = case
    kwargs = dict(config=config, cluster=cluster, gpus=gpus, global_batch=batch, framework=framework,
                  attention=attention)
    pruned = plan_model(model, **kwargs)
    full = plan_model(model, **kwargs, exhaustive=True)
    assert full.result.evaluated == full.result.enumerated > pruned.result.evaluated
    assert pruned.plan.to_json() == full.plan.to_json()


def test_a_pool_of_ilp_solvers_writes_the_same_plan_file(monkeypatch):
    """``--jobs 2`` solves the intra-op ILPs in two processes: the same answers, byte for byte."""
    from autopar.inter_op import search

    monkeypatch.setattr(search, "POOL_MIN_OPS", 0)  # a small graph, so that the test is quick
    pooled = []
    solve_all = search.UnitCostCache.solve_all

    def counted(self, keys, jobs):
        pooled.append(jobs)
        solve_all(self, keys, jobs)

    monkeypatch.setattr(search.UnitCostCache, "solve_all", counted)
    kwargs = dict(config=GPT8, cluster="a100-80gb", gpus=16, global_batch=64)
    one = plan_model("gpt", **kwargs)
    two = plan_model("gpt", **kwargs, jobs=2)
    assert pooled == [2]  # one process asks no pool
    assert two.result.ilp_solves == one.result.ilp_solves > 1
    assert one.plan.to_json() == two.plan.to_json()


def test_jobs_must_be_positive():
    from autopar.errors import AutoparError

    with pytest.raises(AutoparError, match="jobs"):
        plan_model("gpt", config=GPT, cluster="cpu", gpus=4, global_batch=8, jobs=0)
