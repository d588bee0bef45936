"""Benchmark: the tensor-parallel communication the runtime really issues, against what the plan priced.

For each case a plan is made for a real cluster preset; then, in this one process, a fake process group
of the plan's world size stands in for the cluster (``torch.testing._internal.distributed.fake_pg``), the
plan is applied to the model in bf16 (the plan's activation precision), and one training iteration runs
under a dispatch mode that records every collective's kind, bytes and process group.  The collectives
on the tp group are sized as the planner sizes them (``autopar.collectives``: an all-gather by its gathered
output) and compared with the bytes the plan records: its first stage's tp collectives per micro-batch
times the micro-batches, plus the per-iteration gradient synchronization on tp.  A ratio near 1 says the
runtime communicates what the plan assumed; far from 1, the runtime differs from the plan.  The times
both come to are reported too.  With expert parallelism, the dispatch and combine all-to-alls off the tp group
are compared the same way with the plan's ``estimated_ep_bytes_per_microbatch``.

Rank 0's compute runs for real on the CPU, so the models are small.  Writes
``benchmarks/results/runtime_comm.json``.

    python benchmarks/runtime_comm.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor, placement_types
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.cli import main as cli
from autopar.cluster import Cluster, mesh_links
from autopar.collectives import collective_s
from autopar.plan_file import Plan
from autopar.runtime.apply import apply
from autopar.runtime.session import batch_for_step, build_model

ROOT = Path(__file__).resolve().parents[1]
BIG = "layers=2,hidden=4096,heads=32,vocab=32000,seq_len=512"
CASES = [
    # name, model, config, --fix (8 a100-80gb in one node, global batch 8); big enough that tp shards weights
    ("gpt megatron tp8", "gpt", BIG, "tp=8,sp=off"),
    ("gpt megatron tp8 sp", "gpt", BIG, "tp=8,sp=on"),
    ("llama dp2 x tp4", "llama", "layers=2,hidden=4096,heads=32,vocab=32000,seq_len=512", "dp=2,tp=4,sp=off,zero=0"),
    ("moe tp8 (experts on tp)", "moe", "layers=2,hidden=2048,heads=16,vocab=32000,seq_len=512,experts=8",
     "tp=8,sp=off"),
    ("moe dp4 x tp2, ep2", "moe", "layers=2,hidden=2048,heads=16,vocab=32000,seq_len=512,experts=8",
     "dp=4,tp=2,ep=2,sp=off"),
]

#: Functional collective -> (the planner's collective, whether the tensor argument is the gathered output's
#: 1/n shard, so that the priced size is n times the argument).  Sizes are the tensors' real bytes: a
#: collective the runtime runs in fp32 where the plan priced bf16 counts twice.
KINDS = {"all_reduce": ("all_reduce", False), "all_gather_into_tensor": ("all_gather", True),
         "reduce_scatter_tensor": ("reduce_scatter", False), "all_to_all_single": ("all_to_all", False)}


class CommBytes(TorchDispatchMode):
    """Records each functional collective's name, tensor bytes and group name (a plain dispatch mode:
    ``CommDebugMode``'s module tracking trips over FSDP2's hooks).

    Like ``CommDebugMode`` it steps aside for DTensor arguments (``NotImplemented``), so the collectives
    DTensor issues inside an op's dispatch, when it redistributes an operand, are seen too.  A shard-to-shard
    redistribution is an all-to-all on GPU; gloo has none, so DTensor falls back to an all-gather on CPU
    (``shard_dim_alltoall``).  That call is recorded as the all-to-all a cluster runs, sized by one rank's
    buffer as ``autopar.collectives.all_to_all_s`` prices it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []  # (collective, bytes of its tensor, group name)
        self._inside_all_to_all = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.HigherOrderOperator) or self._inside_all_to_all:
            return out
        name = func._overloadpacket.__name__
        if name in KINDS:
            tensor = next(a for a in tree_leaves(args) if isinstance(a, torch.Tensor))
            group = next(a for a in reversed(args) if isinstance(a, str))
            self.records.append((name, tensor.numel() * tensor.element_size(), group))
        return out

    def __enter__(self) -> CommBytes:
        original = placement_types.shard_dim_alltoall

        def all_to_all(tensor: torch.Tensor, gather_dim: int, shard_dim: int, mesh: Any, mesh_dim: int) -> Any:
            group = mesh.get_group(mesh_dim).group_name
            self.records.append(("all_to_all_single", tensor.numel() * tensor.element_size(), group))
            self._inside_all_to_all = True
            try:
                return original(tensor, gather_dim, shard_dim, mesh, mesh_dim)
            finally:
                self._inside_all_to_all = False

        self._patch = mock.patch.object(placement_types, "shard_dim_alltoall", all_to_all)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patch.stop()


def measure(plan_path: Path) -> dict:
    plan = Plan.load(plan_path)
    n = plan.num_devices
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        session = build_model(plan, None)  # structure only: the synthetic data's vocabulary
        trainer = apply(plan, session.loss_fn)
        tp_group = trainer.mesh["tp"].get_group().group_name
        if trainer.mesh["tp"].size() != plan.layout["tp"]:
            raise SystemExit("the plan shards only the batch on tp: pick a larger model for this benchmark")
        inputs = batch_for_step(plan, session, 0, 0)
        local = plan.global_batch // trainer.dp_size
        with CommBytes() as comm:
            trainer.step(inputs.rows(0, local))
    finally:
        dist.destroy_process_group()
    cluster = Cluster.from_dict(plan.cluster)  # the cluster the plan was made for, overrides included
    shape = tuple(plan.layout[a] for a in ("pp", "dp", "tp"))
    tp_link = mesh_links(cluster, shape)[2]
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for name, nbytes, group in comm.records:
        if group != tp_group:
            continue
        kind, sharded = KINDS[name]
        size = nbytes * (plan.layout["tp"] if sharded else 1)
        row = by_kind[kind]
        row[0] += 1
        row[1] += size
        row[2] += collective_s(kind, size, tp_link)
    m = plan.schedule["num_microbatches"]
    stage = plan.stages[0]
    planned = {kind: m * nbytes for kind, nbytes in stage["estimated_tp_bytes_per_microbatch"].items()}
    for kind, nbytes in stage["estimated_tp_sync_bytes_per_iteration"].items():
        planned[kind] = planned.get(kind, 0.0) + nbytes
    runtime_bytes = sum(r[1] for r in by_kind.values())
    planned_bytes = sum(planned.values())
    runtime_s = sum(r[2] for r in by_kind.values())
    planned_s = plan.estimate["breakdown"]["tp_comm_s"]
    # expert parallelism's dispatch and combine: the all-to-alls off the tp group (DTensor's on tp are above)
    ep_runtime = sum(nbytes for name, nbytes, group in comm.records
                     if name == "all_to_all_single" and group != tp_group)
    ep_planned = m * stage.get("estimated_ep_bytes_per_microbatch", {}).get("all_to_all", 0.0)
    return {"planned_ep_bytes": ep_planned, "runtime_ep_bytes": ep_runtime,
            "ep_ratio": ep_runtime / ep_planned if ep_planned else None,
            "layout": plan.layout, "num_microbatches": m, "planned_tp_bytes": planned_bytes,
            "runtime_tp_bytes": runtime_bytes, "ratio": runtime_bytes / planned_bytes if planned_bytes else None,
            "planned_tp_comm_s": planned_s, "runtime_tp_comm_s": runtime_s,
            "planned": dict(sorted(planned.items())),
            "collectives": {k: {"count": c, "bytes": b, "priced_s": s} for k, (c, b, s) in sorted(by_kind.items())}}


def main() -> None:
    os.environ["AUTOPAR_DEVICE"] = "cpu"
    rows = []
    for name, model, config, fix in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["plan", model, "--config", config, "--cluster", "a100-80gb", "--gpus", "8", "--global-batch", "8",
                    "--fix", fix, "-o", tmp]
            with contextlib.redirect_stdout(io.StringIO()):  # the plan summary: not what this reports
                assert cli(argv) == 0, name
            rows.append({"case": name, "fix": fix, **measure(Path(tmp) / "plan.json")})
    table = Table(title="tp communication per iteration: bytes the runtime moves vs bytes the plan priced")
    for col in ("case", "planned MiB", "runtime MiB", "ratio", "runtime (count x MiB)", "planned (MiB)"):
        table.add_column(col)
    for r in rows:
        parts = ", ".join(f"{k} {v['count']}x {v['bytes'] / 2**20:.1f}" for k, v in r["collectives"].items())
        planned = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["planned"].items())
        table.add_row(r["case"], f"{r['planned_tp_bytes'] / 2**20:.1f}", f"{r['runtime_tp_bytes'] / 2**20:.1f}",
                      f"{r['ratio']:.2f}" if r["ratio"] else "-", parts, planned)
    Console().print(table)
    for r in rows:
        if r["ep_ratio"] is not None:
            print(f"{r['case']}: expert-parallel all-to-all {r['runtime_ep_bytes'] / 2**20:.1f} MiB moved, "
                  f"{r['planned_ep_bytes'] / 2**20:.1f} MiB planned (ratio {r['ep_ratio']:.2f})")
    out = ROOT / "benchmarks" / "results" / "runtime_comm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
