"""autopar: an automatic parallelization planner for PyTorch training.

Public API::

    graph = autopar.trace(model, example_inputs)        # OpGraph (fake tensors, no real memory)
    cluster = autopar.load_cluster("a100-80gb")        # a Cluster
    plan = autopar.Plan.load("out/plan.json")            # a saved plan
"""

from __future__ import annotations

__version__ = "0.1.0"

from autopar.cluster import Cluster, load_cluster
from autopar.ir import OpGraph
from autopar.tracing import trace

__all__ = ["Cluster", "OpGraph", "__version__", "load_cluster", "trace"]
