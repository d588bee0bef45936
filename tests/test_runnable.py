"""The planner's runtime filter (``autopar.runnable``) checks each distinct intra-op solution once."""

from __future__ import annotations

from autopar.solvers.pipeline import SPLIT_BACKWARD

from autopar.api import plan_model
from autopar.runnable import RuntimeFilter


def test_solutions_that_place_every_op_alike_share_one_runtime_check(monkeypatch):
    """The solves at several micro-batch sizes and both variants often place every op alike: the runtime's check
    (a plan built, its styles laid out) runs once per distinct placements and layout flags, not once per solve."""
    checked = []
    refusal = RuntimeFilter._refusal

    def recorded(self, estimate, strategies):
        lay = estimate.layout
        checked.append((frozenset(strategies.items()), lay.tp, lay.sp, lay.pp > 1, lay.cp > 1, lay.ep > 1,
                        lay.schedule in SPLIT_BACKWARD, lay.recompute == "selective"))
        return refusal(self, estimate, strategies)

    monkeypatch.setattr(RuntimeFilter, "_refusal", recorded)
    planning = plan_model("gpt", config={"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 128},
                          cluster="cpu", gpus=8, global_batch=32, top=3)
    assert planning.plans
    assert len(checked) > 1 and len(checked) == len(set(checked))
