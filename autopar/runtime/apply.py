"""``autopar.runtime.apply(plan)``: build the plan's model on this torchrun rank, parallelized as planned.

The steps are ``autopar.runtime.parallelize``'s, in torchtitan's order (pipeline split, TP, activation
checkpointing, data parallelism, then allocation and initialization of this rank's shards), with the values
the plan holds; generated ``train.py`` scripts call the same steps with the same values as literals.

- pipeline parallelism on ``pp``: this rank's chunks under the plan's schedule;
- tensor parallelism on ``tp`` through ``parallelize_module`` styles derived from the plan's parameter
  placements (``autopar.runtime.tensor_parallel``); a plan that keeps every parameter replicated on
  ``tp`` uses that axis for the batch, and runs it as data parallelism;
- activation checkpointing per the plan's recompute mode;
- ``torch.compile`` of each block where the plan compiles;
- data parallelism on ``dp`` (and ``cp``, whose ranks hold the same weights) at the plan's ZeRO level
  (``autopar.runtime.parallelize.apply_dp``);
- context parallelism on ``cp``: each rank a load-balanced slice of every sequence
  (``autopar.runtime.context_parallel``);
- gradient accumulation over the plan's micro-batches, AdamW and bf16 mixed precision
  (``autopar.runtime.training``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar import modelfile
from autopar.errors import AutoparError
from autopar.plan_file import Plan
from autopar.runtime.expert_parallel import planned_experts
from autopar.runtime.fp8 import check_fp8_device
from autopar.runtime.materialize import build_on_meta
from autopar.runtime.parallelize import MESH_DIMS, context_of, parallelize
from autopar.runtime.pipeline import rank_chunks, tied_pairs
from autopar.runtime.stages import stage_layer_ranges
from autopar.runtime.styles import StyleSpec
from autopar.runtime.tensor_parallel import runs_loss_parallel, tp_style_specs, tp_styles
from autopar.runtime.training import Trainer, TrainingConfig


@dataclass(frozen=True, slots=True)
class RunShape:
    """How a plan runs on the ranks: its mesh, and the micro-batch of one data-parallel rank."""

    pp: int
    dp: int
    cp: int
    tp: int
    micro_batch: int

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """The device mesh's shape over ``MESH_DIMS`` (pp, dp, cp, tp)."""
        return (self.pp, self.dp, self.cp, self.tp)


def run_shape(plan: Plan, tp_specs: dict[str, StyleSpec] | None) -> RunShape:
    """The plan's mesh, given its tp styles (``tp_style_specs``); a plan that shards nothing on tp
    (``None``, and no experts split there) runs that axis as data parallelism."""
    lay = plan.layout
    pp, dp, tp, mbs = lay["pp"], lay["dp"], lay["tp"], lay["mbs"]
    if tp > 1 and tp_specs is None and not any(planned_experts(plan).values()):
        dp, tp, mbs = dp * tp, 1, mbs // tp
    return RunShape(pp, dp, lay.get("cp", 1), tp, mbs)


def _check_launch(plan: Plan, model: nn.Module) -> None:
    """World size and parameter table must be the plan's (checked on every rank before anything runs)."""
    if not dist.is_initialized():
        raise AutoparError("autopar.apply needs torch.distributed to be initialized (run under torchrun)")
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise AutoparError(f"world size {world} differs from the plan's {plan.num_devices} devices")
    have = {n: list(p.shape) for n, p in model.named_parameters()}
    want = {n: p["shape"] for n, p in plan.parameters.items()}
    if have != want:
        diff = sorted(set(have) ^ set(want)) or sorted(n for n in have if have[n] != want.get(n))
        raise AutoparError(f"the model does not match the plan (parameter {diff[0]} differs)")


def device_for_rank() -> torch.device:
    """This rank's device: ``AUTOPAR_DEVICE`` (``cpu`` / ``cuda``), else a GPU when torch sees one."""
    want = os.environ.get("AUTOPAR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cpu":
        return torch.device("cpu")
    if want != "cuda":
        raise AutoparError(f"AUTOPAR_DEVICE must be cpu or cuda, not {want!r}")
    local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= gpus:
        raise AutoparError(f"the device mesh cannot be built: local rank {local} needs a GPU and this node "
                           f"has {gpus}")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_distributed(device: torch.device) -> None:
    """The default process group (NCCL on GPUs, gloo on the CPU), from torchrun's environment.

    A run that torchrun restarted (``--max-restarts``) meets in a store of its own: torchrun's agent keeps one
    store across attempts, and the process group's keys from the attempt before (a dead rank's address among
    them) would otherwise still be there (gloo then fails to connect to it; pytorch/pytorch#167288 reports the
    like for NCCL)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/attempt_{attempt}", agent),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def end_distributed(code: int = 0) -> NoReturn:
    """End this rank's process after a run every rank finished: the ranks meet, the process groups go, and the
    process exits with ``code`` without the interpreter's teardown.  That teardown destroys C++ objects gloo's
    threads may still be using: ranks that had finished their work died there of SIGABRT ("terminate called
    without an active exception"), 2 of 5 FSDP runs without the barrier and destroy (the torch 2.13 probe's
    notes), and in two of the test suite's recent runs on 2 busy cores with them.  Whatever the script opened
    (metrics, checkpoints) must be closed before; stdout and stderr are flushed here."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def plan_builder(plan: Plan) -> Callable[[], nn.Module]:
    """``build_model(**config)`` of the plan's model file."""
    module = modelfile.load_for(plan.model)
    config, ref = dict(plan.model["config"]), plan.model["ref"]
    return lambda: modelfile.build(module, config, ref)


def apply(plan: Plan, loss_fn: Callable[..., torch.Tensor] | None = None, *,
          build: Callable[[], nn.Module] | None = None, config: TrainingConfig | None = None,
          seed: int = 0, mesh: DeviceMesh | None = None, device: torch.device | None = None,
          compile: bool | None = None) -> Trainer:
    """Build ``plan``'s model on this rank as the plan lays it out; returns its ``Trainer``.

    ``build`` makes the model (default: the plan's model file and config); it is called on the meta device,
    once per pipeline chunk and once for the whole model (checked against the plan, and the recipe of the
    initial weights of ``seed``), so no rank allocates more than its own shards.  ``loss_fn`` defaults to
    the model file's.  ``mesh``: a ``(pp, dp, cp, tp)`` device mesh of the plan's shape to use instead of
    building one.  ``device``: where this rank's shards
    live (default: its GPU, else the CPU; ``meta`` lays out the shards without allocating or initializing
    them, to check what a rank would hold).  ``compile``: run each block ``torch.compile``d (default: as the plan
    says).
    """
    from torch.distributed.device_mesh import init_device_mesh

    build = build or plan_builder(plan)
    config = config or TrainingConfig()
    if loss_fn is None:
        loss_fn = modelfile.loss_fn_of(modelfile.load_for(plan.model))
    whole = build_on_meta(build)  # the unsharded model: what the plan describes, and every weight's recipe
    _check_launch(plan, whole.model)
    specs = tp_style_specs(plan, whole.model) if plan.layout["tp"] > 1 else None
    shape = run_shape(plan, specs)
    device = device or device_for_rank()
    if plan.fp8 and device.type != "meta":
        check_fp8_device(device)
    dims = shape.dims
    if mesh is None:
        try:
            mesh = init_device_mesh(device.type, dims, mesh_dim_names=MESH_DIMS)
        except (RuntimeError, ValueError) as exc:
            raise AutoparError(f"the device mesh (pp, dp, cp, tp) = {dims} cannot be built: "
                               f"{str(exc).splitlines()[0]}") from exc
    elif tuple(mesh.mesh.shape) != dims or mesh.mesh_dim_names != MESH_DIMS:
        raise AutoparError(f"the given device mesh is {tuple(mesh.mesh.shape)} over {mesh.mesh_dim_names}; the "
                           f"plan runs on (pp, dp, cp, tp) = {dims}")
    context = context_of(mesh, plan.seq_len)
    if plan.layout.get("group", 0):
        raise AutoparError(f"this plan runs its interleaved schedule in groups of {plan.layout['group']} "
                           "micro-batches (a framework's tunable schedule, such as Llama 3's), which "
                           "torch.distributed.pipelining does not run: plan it again with --framework torch")
    ranges = [tuple(r) for r in stage_layer_ranges(plan)]
    pp_rank = mesh.get_local_rank("pp")
    chunks = rank_chunks(plan.layout["schedule"], pp_rank, shape.pp, len(ranges))
    tied = tied_pairs(plan)
    parts = parallelize(build, mesh, device, seed, stage_layers=ranges, chunks=chunks,
                        container=plan.model.get("layer_container"), ends=plan.model.get("stack_ends"),
                        tp_styles=lambda chunk, part: tp_styles(plan, part) or {}, tied=tied,
                        recompute=plan.layout["recompute"], zero=plan.zero, precision=config.precision,
                        reference=whole, context=context,
                        fp8_linears=plan.precision.get("fp8_linears", ()) if plan.fp8 else (),
                        fp8_param_gather=bool(plan.precision.get("fp8_param_gather")), ep=plan.layout.get("ep", 1),
                        experts=planned_experts(plan), compile=plan.compile if compile is None else compile)
    sharded_loss = shape.tp > 1 and runs_loss_parallel(specs)
    return Trainer(parts, mesh, loss_fn, chunks=chunks, num_chunks=len(ranges), schedule=plan.layout["schedule"],
                   num_microbatches=plan.layout["num_microbatches"], micro_batch=shape.micro_batch, zero=plan.zero,
                   tied=tied, config=config, device=device, loss_parallel=sharded_loss, context=context)
