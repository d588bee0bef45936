"""Write a standalone, readable training script for a plan (``autopar plan -o DIR`` writes ``DIR/train.py``).

The script imports the user's model file and plain PyTorch only.  The plan's choices appear as literals
at the top (mesh shape, the ``parallelize_module`` plan dict, the pipeline chunks, the schedule, the ZeRO
level); the fixed body (``script_body.py``) applies them in torchtitan's order: pipeline split, TP,
activation checkpointing, FSDP, then the schedule.  It trains ``--steps`` steps on synthetic data, logs
the loss of each step, and saves (``--checkpoint``) or resumes (``--resume``) a DCP checkpoint.
"""

from __future__ import annotations

import inspect
import pprint
from pathlib import Path

from autopar import __version__, modelfile, recompute_policy
from autopar.codegen.script_body import BODY
from autopar.plan import Plan
from autopar.runtime import recompute, stages
from autopar.runtime.pipeline import tied_pairs
from autopar.runtime.stages import hf_decoder_kind, stage_layer_ranges
from autopar.runtime.styles import PlacedParameters, PrepareActivation, register_cpu_attention_rules, style_source
from autopar.runtime.support import check_runnable, model_on_meta

IMPORTS = """import argparse
import copy
import importlib.util
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Replicate, Shard
"""

# Only for plans that recompute activations (``autopar.runtime.recompute``).
RECOMPUTE_IMPORTS = """from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
"""

# Only for plans that use the runtime's own styles (stacked experts on tp, sequence parallelism).
CUSTOM_STYLE_IMPORTS = """import functools
import inspect
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils._pytree import tree_map"""


def _pipeline_source(hf_kind: str | None) -> str:
    """The runtime's stage pruning (and HuggingFace stage forward with its mask helpers), copied."""
    parts = [stages._drop_ends]
    if hf_kind:
        parts += [stages._hf_layer_masks, stages._hf_layer_type, stages.hf_stage_forward]
    return "from collections.abc import Callable\n\n\n" + "\n\n".join(inspect.getsource(f) for f in parts) + "\n\n"


def _recompute_source() -> str:
    """The runtime's activation checkpointing (``autopar.runtime.recompute``), copied."""
    parts = [recompute_policy.is_attention_module, recompute_policy.product_is_saved,
             recompute._saved_by_op_checkpointing, recompute.op_checkpoint_context, recompute._op_checkpointed,
             recompute.apply_recompute]
    constants = (f"ATTENTION_NAMES = {recompute_policy.ATTENTION_NAMES!r}\n"
                 f"SAVE_EVERY = {recompute_policy.SAVE_EVERY!r}\n\n\n")
    return constants + "\n\n".join(inspect.getsource(f) for f in parts) + "\n\n"


def _custom_styles_source(kinds: set[str]) -> str:
    """The runtime's own styles the plan uses, copied so the script stays standalone."""
    used = [cls for cls in (PlacedParameters, PrepareActivation) if cls.__name__ in kinds]
    if not used:
        return ""
    if PlacedParameters in used:  # its DTensor region needs rules torch lacks on CPU
        used.insert(0, register_cpu_attention_rules)
    parts = [inspect.getsource(obj) for obj in used]
    return CUSTOM_STYLE_IMPORTS + "\n\n" + "\n\n".join(parts) + "\n\n"


def generate_train_script(plan: Plan, script_name: str = "train.py") -> str:
    """The source of a torchrun training script that applies ``plan``."""
    model = model_on_meta(plan)
    lay = plan.layout
    specs = check_runnable(plan, model)
    hf_kind = hf_decoder_kind(model)
    pp, dp, tp, mbs = lay["pp"], lay["dp"], lay["tp"], lay["mbs"]
    note = ""
    if lay["tp"] > 1 and specs is None:
        dp, tp, mbs = dp * tp, 1, mbs // tp
        note = "# The plan shards only the batch on its tp axis, so that axis runs as data parallelism.\n"
    path = plan.model.get("path") or modelfile.resolve(plan.model["ref"]).resolve()
    tied = tied_pairs(plan)
    tp_lines = "".join(f"    {name!r}: {style_source(spec)},\n" for name, spec in (specs or {}).items())
    layout = ", ".join(f"{k}={v}" for k, v in sorted(lay.items()))
    header = (
        "#!/usr/bin/env python3\n"
        f'"""Training script generated by autopar {__version__} from a plan.\n\n'
        f"Layout: {layout}.\n"
        f"Run: torchrun --nproc-per-node {plan.num_devices} {script_name} --steps 3 [--checkpoint DIR] "
        "[--resume DIR]\n\n"
        "Every choice of the plan is a literal below, applied with plain PyTorch calls; edit freely.\n"
        f'Estimated iteration time on {plan.cluster["name"]}: {plan.estimate["iteration_time_s"]:.4g} s.\n"""\n\n'
    )
    literals = (
        f"MODEL_FILE = {str(path)!r}\n"
        f"CONFIG = {pprint.pformat(plan.model['config'], sort_dicts=True)}\n"
        f"GLOBAL_BATCH = {plan.global_batch}\n"
        f"SEQ_LEN = {plan.seq_len}\n"
        f"{note}MESH_SHAPE = ({pp}, {dp}, {tp})  # (pp, dp, tp)\n"
        f"MICRO_BATCH = {mbs}  # samples per micro-batch on one data-parallel rank\n"
        f"NUM_MICROBATCHES = {lay['num_microbatches']}\n"
        f"SCHEDULE = {lay['schedule']!r}  # gpipe | 1f1b | interleaved\n"
        f"STAGE_LAYERS = {[tuple(r) for r in stage_layer_ranges(plan)]!r}  # layers of each pipeline chunk\n"
        f"LAYER_CONTAINER = {plan.model['layer_container']!r}\n"
        f"HUGGINGFACE_DECODER = {hf_kind!r}  # llama | gpt2: pipeline stages run hf_stage_forward\n"
        f"RECOMPUTE = {lay['recompute']!r}  # none | selective | op | full\n"
        f"ZERO = {plan.zero}  # 0: all-reduce gradients; 1-3: FSDP2 fully_shard (3: reshard after forward)\n"
        f"TIED = {tied!r}  # (parameter, alias) pairs\n"
        f"TP_PLAN = {{\n{tp_lines}}}\n"
    )
    kinds = {kind for kind, _ in (specs or {}).values()}
    torch_kinds = sorted(kinds - {"PlacedParameters", "PrepareActivation"})
    names = ", ".join([*torch_kinds, "parallelize_module"])
    recomputes = lay["recompute"] != "none"
    imports = (IMPORTS + (RECOMPUTE_IMPORTS if recomputes else "")
               + f"from torch.distributed.tensor.parallel import {names}\n")
    helpers = (_custom_styles_source(kinds) + (_pipeline_source(hf_kind) if pp > 1 else "")
               + (_recompute_source() if recomputes else ""))
    return header + imports + "\n" + helpers + literals + BODY


def write_train_script(plan: Plan, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(generate_train_script(plan, path.name))
    path.chmod(0o755)
    return path
