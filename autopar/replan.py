"""Replan a saved plan for another number of devices (a lost node, a grown allocation), and check that a run's
checkpoint loads under the new plan: the recipe for going on with the devices that are left.

The new plan keeps everything the old one was planned with (the model and its config, the cluster spec, the
framework, the precision, the global batch, the sequence length, the memory limit); only the device count changes.
The checkpoint check reads the checkpoint's metadata only (no process group, no GPU): every parameter of the new
plan, and its optimizer state where the checkpoint has some, must be there with the same global shape; DCP
reshards them to the new layout when the run resumes (``autopar.runtime.checkpoint``).
"""

from __future__ import annotations

import math
from pathlib import Path

from autopar.api import Planning, plan_model
from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.framework import DEFAULT_FRAMEWORK, FRAMEWORKS
from autopar.plan_file import Plan
from autopar.plan_view import memory_limit_bytes
from autopar.runtime.checkpoint import OPTIMIZER_PREFIX, saved_shapes


def replan(plan: Plan, gpus: int, framework: str | None = None, jobs: int = 1,
           gpus_per_node: int | None = None) -> Planning:
    """``plan``'s model, cluster, framework, precision and batch, planned again for ``gpus`` devices (and, if
    given, ``gpus_per_node``)."""
    if gpus < 1:
        raise AutoparError("--gpus must be >= 1")
    framework = framework or plan.estimate.get("framework", DEFAULT_FRAMEWORK)
    if framework not in FRAMEWORKS and not Path(framework).is_file():
        raise AutoparError(f"the plan was made for framework {framework!r}, which is no preset: pass its TOML file "
                           "with --framework")
    model = plan.model.get("path") or plan.model.get("ref")
    if not model:
        raise AutoparError("the plan does not say which model it was made for (no path or zoo name)")
    cluster = Cluster.from_dict(plan.cluster).with_overrides(gpus=gpus, gpus_per_node=gpus_per_node)
    try:
        planning = plan_model(model, config=plan.model.get("config") or {}, cluster=cluster,
                              global_batch=plan.global_batch, seq_len=plan.seq_len, attention=plan.attention,
                              precision=plan.precision.get("training", "bf16"), framework=framework,
                              compile=plan.compile,
                              memory_limit_gb=memory_limit_bytes(plan) / 2**30, jobs=jobs)
    except AutoparError as exc:
        if plan.global_batch % gpus == 0:
            raise
        batch = math.lcm(plan.global_batch, gpus)
        raise AutoparError(f"{exc}; the global batch of {plan.global_batch} may have to change for {gpus} devices: "
                           f"{batch} (a multiple of both) lets every device take its share") from None
    for new in planning.plans:  # the model as the user named it (a zoo name, an hf: folder), not its file
        new.model["ref"] = plan.model.get("ref") or new.model["ref"]
    return planning


def check_checkpoint(plan: Plan, path: str | Path) -> tuple[Path, int]:
    """The checkpoint ``path`` resolves to and how many tensors of ``plan`` it holds, after checking that every
    parameter of ``plan`` (and its optimizer state, where the checkpoint has some) is in it with the plan's global
    shape."""
    found, shapes = saved_shapes(path)
    optimized = any(k.startswith(OPTIMIZER_PREFIX) for k in shapes)
    checked = 0
    for fqn, spec in sorted(plan.parameters.items()):
        shape = tuple(spec["shape"])
        # the optimizer's per-element state (AdamW's moments), not its scalars (the step count)
        state = [k for k in shapes if k.startswith(f"{OPTIMIZER_PREFIX}{fqn}.") and shapes[k]]
        if fqn not in shapes or (optimized and not state):
            missing = fqn if fqn not in shapes else f"optimizer state of {fqn}"
            raise AutoparError(f"{found}: the checkpoint has no {missing}, which the new plan needs")
        for key in [fqn, *state]:
            if shapes[key] != shape:
                raise AutoparError(f"{found}: {key} is {list(shapes[key])} in the checkpoint and {list(shape)} in "
                                   "the plan")
            checked += 1
    return found, checked


__all__ = ["check_checkpoint", "replan"]
