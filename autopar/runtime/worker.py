"""One rank of ``autopar verify``: ``python -m torch.distributed.run ... -m autopar.runtime.worker OUTDIR PLAN...``.

The plans run one after another in the same processes (one launch: starting torch on every rank costs more
than training a small plan).  For plan ``i`` every rank trains; the first rank of each pipeline stage writes
``OUTDIR/i/rank{N}.pt`` (whole gradients and parameters of the stage, and how they were placed), rank 0
with the losses.  Files rather than a gather over gloo: pickling every tensor through ``all_gather_object``
took minutes and gigabytes at 12M params.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.plan_file import Plan
from autopar.runtime import checkpoint
from autopar.runtime.apply import apply, end_distributed
from autopar.runtime.memory import activation_peak_bytes
from autopar.runtime.session import batch_for_step, build_model, disable_dropout
from autopar.runtime.training import RUN_NUMERICS, check_config


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _placements(p: torch.Tensor) -> dict[str, str]:
    """A DTensor parameter's placement on each named mesh axis, in the plan's words (``{"tp": "S(0)"}``)."""
    def text(pl: object) -> str:  # FSDP over a tp-sharded dim holds a _StridedShard: a shard all the same
        return f"S({pl.dim})" if hasattr(pl, "dim") else "R" if pl.is_replicate() else "P"
    return {axis: text(pl) for axis, pl in zip(p.device_mesh.mesh_dim_names, p.placements)}


def run_one(plan_path: str, out: Path, args: argparse.Namespace, resume: str | None = None,
            save: str | None = None) -> None:
    """Train one plan for ``args.steps`` steps and write this rank's file under ``out``; ``resume`` from a
    checkpoint (or the latest in a folder) first, ``save`` one in a folder at the end."""
    from torch._dynamo.utils import counters

    counters.clear()
    plan = Plan.load(plan_path)
    session = build_model(plan, None)  # structure only: the synthetic data's vocabulary
    trainer = apply(plan, session.loss_fn, config=check_config(args.numerics, args.lr), seed=args.seed,
                    compile=args.compile)
    for part in trainer.parts:  # the reference run draws other masks: both sides run without dropout
        disable_dropout(part)
    start = args.start_step
    if resume:  # the run's whole state: its data continues where the checkpoint's step left it
        start = checkpoint.load(trainer, resume).step
    steps = range(start, start + args.steps)
    local = plan.global_batch // trainer.dp_size
    lo = trainer.dp_rank * local
    losses, peak = [], None
    for step in steps:
        batch = batch_for_step(plan, session, step, args.seed).rows(lo, lo + local)
        if args.memory and step == steps[-1]:  # forward and backward: what activations are for
            loss, peak = activation_peak_bytes(trainer.parts, lambda b=batch: trainer.forward_backward(b))
            losses.append(trainer.update(loss))
        else:
            losses.append(trainer.step(batch))
    if save:
        end = steps.stop
        checkpoint.save(trainer, save, checkpoint.Position(end, end * plan.global_batch))
    named = trainer.named_parameters()
    grads = {n: _full(p.grad).detach() for n, p in named if p.grad is not None}
    params = {n: _full(p).detach() for n, p in named}
    placements = {n: _placements(p) for n, p in named if hasattr(p, "placements")}
    # one rank per pipeline stage writes the (whole) tensors it holds; rank 0 adds the losses
    mesh, rank = trainer.mesh, dist.get_rank()
    if rank == 0 or all(mesh.get_local_rank(axis) == 0 for axis in ("dp", "cp", "tp")):
        out.mkdir(parents=True, exist_ok=True)
        compiled = {"graphs": counters["aot_autograd"].get("ok", 0), "breaks": sum(counters["graph_break"].values())}
        torch.save({"losses": losses, "grads": grads, "params": params, "placements": placements,
                    "activation_peak": {mesh.get_local_rank("pp"): peak}, "compiled": compiled},
                   out / f"rank{rank}.pt")
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="folder for the rank files (one subfolder per plan: 0, 1, ...)")
    ap.add_argument("plans", nargs="+", help="plan files, run in turn (all of the same world size)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--numerics", choices=RUN_NUMERICS, default="fp32")
    ap.add_argument("--memory", action="store_true",
                    help="measure the last step's activation memory (torch's MemTracker)")
    ap.add_argument("--start-step", type=int, default=0, help="index of the first step (its data) without --resume")
    ap.add_argument("--resume", help="load the run's state from this checkpoint (or the latest in this folder) "
                                     "and continue from its step (several plans: plan i's under FOLDER/i)")
    ap.add_argument("--checkpoint", help="save the run's state under this folder at the end (several plans: "
                                         "plan i's under FOLDER/i)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (eager otherwise)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    i = 0
    try:
        def own(folder: str | None, i: int) -> str | None:
            return str(Path(folder) / str(i)) if folder and len(args.plans) > 1 else folder

        for i, plan_path in enumerate(args.plans):
            run_one(plan_path, Path(args.out) / str(i), args, own(args.resume, i), own(args.checkpoint, i))
    except AutoparError as exc:
        print(f"autopar: error (rank {rank}, {args.plans[i]}): {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    except BaseException:
        dist.destroy_process_group()
        raise
    end_distributed()  # every plan ran on every rank

if __name__ == "__main__":
    raise SystemExit(main())
