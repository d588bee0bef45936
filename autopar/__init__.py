"""autopar: an automatic parallelization planner for PyTorch training.

Public API::

    plan = autopar.plan("gpt", gpus=16, global_batch=64)  # trace, search: the best Plan (autopar.api)
    plan.save("out/plan.json")
    plan = autopar.Plan.load("out/plan.json")              # a saved plan (JSON; loading runs no code)
    cluster = autopar.load_cluster("a100-80gb")            # a Cluster
    trainer = autopar.apply(plan)                          # under torchrun: this rank's part of the model
    graph = autopar.trace(model, example_inputs)           # OpGraph (fake tensors, no real memory)
    rows = autopar.gather_batch(embeddings)                # in a loss_fn: the whole batch's rows (contrastive)

    @autopar.parallelize(cluster="a100-80gb", gpus=64, global_batch=512)  # plan a model class where it is
    class MyModel(nn.Module): ...                                          # defined (autopar.decorator)
"""

from __future__ import annotations

__version__ = "0.1.0"

from autopar.api import plan
from autopar.batch_loss import gather_batch
from autopar.cluster import Cluster, load_cluster
from autopar.decorator import parallelize
from autopar.ir import OpGraph
from autopar.plan_file import Plan
from autopar.runtime.apply import apply
from autopar.tracing import trace

__all__ = ["Cluster", "OpGraph", "Plan", "__version__", "apply", "gather_batch", "load_cluster", "parallelize", "plan",
           "trace"]
