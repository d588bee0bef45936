"""Write a readable training script for a plan (``autopar plan -o DIR`` writes ``DIR/train.py``).

The plan's choices are literals at the top of the script (mesh shape, the ``parallelize_module`` styles
of each pipeline chunk, the chunks' layers, the schedule, the ZeRO level, the recompute mode, the plan's
estimate); the fixed body (``script_body.py``) passes them to autopar's runtime, which applies them in
torchtitan's order on a meta-device model: pipeline split, TP, EP, activation checkpointing, data parallelism,
then this rank's shards are allocated and initialized.  The script therefore needs autopar installed, and
runs the same code ``autopar verify`` checks.  It trains ``--steps`` steps (AdamW, bf16 mixed precision,
warmup and cosine decay), on ``--data`` or the model file's ``batches`` or synthetic tokens; it prints the
loss, tokens/s, MFU and peak memory of every step against the plan's estimate, then one JSON line.
"""

from __future__ import annotations

import pprint
from pathlib import Path

from torch import nn

from autopar import __version__, modelfile
from autopar.codegen.script_body import BODY
from autopar.plan_file import Plan
from autopar.runtime.apply import run_shape
from autopar.runtime.expert_parallel import planned_experts
from autopar.runtime.pipeline import tied_pairs
from autopar.runtime.stages import prune_to_stage, stage_layer_ranges
from autopar.runtime.styles import StyleSpec, evaluate, style_source
from autopar.runtime.support import check_runnable, model_on_meta
from autopar.runtime.tensor_parallel import runs_loss_parallel, tp_style_specs

IMPORTS = """import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.errors import AutoparError
from autopar.modelfile import build as build_from
from autopar.modelfile import load_module, loss_fn_of
from autopar.runtime import checkpoint
from autopar.runtime.apply import device_for_rank, end_distributed, init_distributed
from autopar.runtime.data import TokenData, run_batches
from autopar.runtime.fp8 import check_fp8_device
from autopar.runtime.materialize import build_on_meta
from autopar.runtime.parallelize import MESH_DIMS, compiled_blocks, context_of, parallelize
from autopar.runtime.pipeline import rank_chunks
from autopar.runtime.report import MetricsLog, StepReport, return_freed_tensors_to_the_os
from autopar.runtime.support import check_compiled, check_document_masking
from autopar.runtime.training import Trainer, TrainingConfig
"""

#: The runtime's own styles (``autopar.runtime.styles``); the others are torch's.
AUTOPAR_STYLES = ("PlacedParameters", "PrepareActivation")


def _tp_plans(plan: Plan, model: nn.Module,
              specs: dict[str, StyleSpec] | None) -> dict[int, dict[str, StyleSpec]]:
    """The ``parallelize_module`` styles of every pipeline chunk (one chunk without pipelining), given the
    whole model's (``specs``); empty when the runtime uses the tp axis for the batch."""
    if specs is None:
        return {}
    if plan.layout["pp"] == 1:
        return {0: specs}
    return {c: tp_style_specs(plan, prune_to_stage(model, plan, c)) or {} for c in range(len(stage_layer_ranges(plan)))}


def _tp_plan_source(plans: dict[int, dict[str, StyleSpec]]) -> str:
    """``TP_PLAN``, with the op strategies of ``PlacedParameters`` regions hoisted into one named tuple per
    distinct region (the layers of a stack share theirs)."""
    names: dict[str, str] = {}  # ops source -> constant name
    lines = ["TP_PLAN = {  # pipeline chunk -> module -> parallelize_module style"]
    for chunk, specs in plans.items():
        lines.append(f"    {chunk}: {{")
        for name, (kind, kwargs) in specs.items():
            if "ops" in kwargs:
                ops = names.setdefault(kwargs["ops"], f"REGION_OPS_{len(names)}")
                kwargs = {**kwargs, "ops": ops}
            lines.append(f"        {name!r}: {style_source((kind, kwargs))},")
        lines.append("    },")
    constants = []
    for source, name in names.items():
        constants.append(f"{name} = (  # a region's ops in graph order: tp placements of inputs -> outputs")
        constants += [f"    {op!r}," for op in evaluate(source)]
        constants.append(")")
    return "".join(f"{line}\n" for line in constants) + "\n".join(lines) + "\n}\n"


def generate_train_script(plan: Plan, script_name: str = "train.py") -> str:
    """The source of a torchrun training script that applies ``plan``."""
    lay = plan.layout
    model = model_on_meta(plan)
    specs = check_runnable(plan, model)
    plans = _tp_plans(plan, model, specs)
    shape = run_shape(plan, specs)
    pp, dp, cp, tp, mbs = shape.pp, shape.dp, shape.cp, shape.tp, shape.micro_batch
    note = ""
    if tp != lay["tp"]:
        note = "# The plan shards no parameter on its tp axis, so that axis runs as data parallelism.\n"
    path = plan.model.get("path") or modelfile.locate(plan.model["ref"])
    layout = ", ".join(f"{k}={v}" for k, v in sorted(lay.items()))
    stacks = (plan.model.get("stack_ends") or {}).get("stacks", [])
    over = (" (numbered over " + " then ".join(f"{s['container']}'s {s['layers']}" for s in stacks) + ")") \
        if stacks else ""
    est = plan.estimate
    estimate = {k: est[k] for k in ("iteration_time_s", "model_flops_per_iter", "mfu", "peak_memory_bytes",
                                    "tokens_per_s")}
    header = (
        "#!/usr/bin/env python3\n"
        f'"""Training script generated by autopar {__version__} from a plan.\n\n'
        f"Layout: {layout}.\n"
        f"Run: torchrun --nproc-per-node {plan.num_devices} {script_name} --steps 10 [--data TOKENS.bin] "
        "[--checkpoint DIR [--checkpoint-every N] [--keep K]] [--resume DIR] [--log-every N]\n\n"
        "Every choice of the plan is a literal below; autopar's runtime (the code `autopar verify` checks)\n"
        "applies them. Edit freely.\n"
        f'Estimated iteration time on {plan.cluster["name"]}: {est["iteration_time_s"]:.4g} s.\n"""\n\n'
    )
    fp8_linears = plan.precision.get("fp8_linears", []) if plan.fp8 else []
    literals = (
        f"MODEL_FILE = {str(path)!r}\n"
        f"EXAMPLE_INPUTS = {plan.model.get('example_inputs')!r}  # a SOURCE:FUNCTION replacing the model's own\n"
        f"CONFIG = {pprint.pformat(plan.model['config'], sort_dicts=True)}\n"
        f"GLOBAL_BATCH = {plan.global_batch}\n"
        f"SEQ_LEN = {plan.seq_len}\n"
        f"{note}MESH_SHAPE = ({pp}, {dp}, {cp}, {tp})  # (pp, dp, cp, tp): cp ranks share each sequence\n"
        f"MICRO_BATCH = {mbs}  # samples per micro-batch on one data-parallel rank\n"
        f"NUM_MICROBATCHES = {lay['num_microbatches']}\n"
        f"SCHEDULE = {lay['schedule']!r}  # gpipe | 1f1b | interleaved | interleaved_zb | zbv | dualpipev\n"
        f"STAGE_LAYERS = {[tuple(r) for r in stage_layer_ranges(plan)]!r}  # layers of each pipeline chunk{over}\n"
        f"LAYER_CONTAINER = {plan.model['layer_container']!r}\n"
        f"STACK_ENDS = {plan.model.get('stack_ends')!r}  # modules run before / after the layers\n"
        f"RECOMPUTE = {lay['recompute']!r}  # none | selective | op | full\n"
        f"ZERO = {plan.zero}  # 0: replicate; 1, 2: fully_shard, kept gathered; 3: resharded after forward\n"
        f"TIED = {tied_pairs(plan)!r}  # (parameter, alias) pairs\n"
        f"EP = {lay.get('ep', 1)}  # expert parallelism: the experts split over groups of EP data-parallel ranks\n"
        f"EXPERTS = {pprint.pformat(planned_experts(plan), sort_dicts=True)}  # experts module -> split on tp too\n"
        f"{_tp_plan_source(plans)}"
        f"LOSS_PARALLEL = {any(runs_loss_parallel(specs) for specs in plans.values())}"
        "  # the head keeps its logits sharded on the vocabulary: the loss runs under loss_parallel\n"
        f"ESTIMATE = {pprint.pformat(estimate, sort_dicts=True)}  # the plan's, on {plan.cluster['name']}\n"
        f"PEAK_FLOPS = {plan.cluster['peak_flops']!r}  # per device of {plan.cluster['name']}: MFU is against it\n"
        "# Linears that train in FP8 (torchao float8; CUDA with compute capability >= 8.9): empty in a bf16 plan\n"
        f"FP8_LINEARS = {pprint.pformat(fp8_linears, compact=True, width=116)}\n"
        f"FP8_PARAM_GATHER = {bool(plan.precision.get('fp8_param_gather'))}  # ZeRO-3 gathers their weights in FP8\n"
        f"COMPILE = {plan.compile}  # torch.compile each block (what the estimate priced); --compile/--no-compile\n"
    )
    kinds = {kind for specs in plans.values() for kind, _ in specs.values()}
    torch_styles = sorted(kinds - set(AUTOPAR_STYLES))
    ours = sorted(kinds & set(AUTOPAR_STYLES))
    imports = IMPORTS
    placements = sorted(p for p in ("Replicate", "Shard") if f"{p}(" in literals)
    if placements:
        imports += f"from torch.distributed.tensor import {', '.join(placements)}\n"
    if torch_styles:
        imports += f"from torch.distributed.tensor.parallel import {', '.join(torch_styles)}\n"
    if ours:
        imports += f"from autopar.runtime.styles import {', '.join(ours)}\n"
    return header + imports + "\n" + literals + BODY


def write_train_script(plan: Plan, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(generate_train_script(plan, path.name))
    path.chmod(0o755)
    return path
