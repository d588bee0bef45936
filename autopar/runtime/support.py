"""What the runtime can run: checked on a meta-device model before anything is launched."""

from __future__ import annotations

import torch
from torch import nn

from autopar import modelfile
from autopar.plan_file import Plan
from autopar.runtime.stages import check_splittable
from autopar.runtime.tensor_parallel import StyleSpec, tp_style_specs


def model_on_meta(plan: Plan) -> nn.Module:
    """The plan's model built on the meta device (structure only, no memory)."""
    module = modelfile.load_for(plan.model)
    with torch.device("meta"):
        return modelfile.build(module, dict(plan.model["config"]), plan.model["ref"])


def check_runnable(plan: Plan, model: nn.Module) -> dict[str, StyleSpec] | None:
    """Raise a one-line ``AutoparError`` for a plan the runtime cannot run; returns its tp styles."""
    lay = plan.layout
    if lay["pp"] > 1:
        check_splittable(model)
    return tp_style_specs(plan, model) if lay["tp"] > 1 else None
