"""``autopar sweep``: the command line's options into a ``SweepRequest``, a progress bar over the points, and the
table and files of the answer."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from autopar.errors import AutoparError
from autopar.modelfile import parse_config
from autopar.sweep.economics import GOOGLE_2023_PUE, Power, Reliability, load_prices
from autopar.sweep.quantities import parse_amount, parse_duration_s, parse_gpu_counts
from autopar.sweep.report import render_table, to_csv, to_json, write_report
from autopar.sweep.sweep import SweepRequest, check_request, run_sweep


def request_from_args(args: argparse.Namespace) -> SweepRequest:
    """The sweep the options ask for; one-line errors for bad values."""
    if args.jobs < 1:
        raise AutoparError("--jobs must be >= 1")
    reliability = Reliability()
    overrides = {}
    if args.interruptions_per_gpu_day is not None:
        overrides["interruptions_per_gpu_day"] = args.interruptions_per_gpu_day
    if args.restart_time is not None:
        overrides["restart_s"] = parse_duration_s(args.restart_time, "--restart-time")
    if args.checkpoint_every is not None:
        overrides["checkpoint_every_s"] = parse_duration_s(args.checkpoint_every, "--checkpoint-every")
    if args.checkpoint_gbps is not None:
        overrides["checkpoint_bytes_per_s_per_gpu"] = args.checkpoint_gbps * 1e9
    if overrides:
        reliability = dataclasses.replace(reliability, **overrides)
    req = SweepRequest(
        model=args.model, clusters=[c.strip() for c in args.cluster.split(",") if c.strip()],
        gpus=parse_gpu_counts(args.gpus), tokens=parse_amount(args.tokens, "--tokens"),
        config=parse_config(args.config), seq_len=args.seq_len,
        tokens_per_batch=parse_amount(args.tokens_per_batch, "--tokens-per-batch") if args.tokens_per_batch else None,
        global_batch=args.global_batch, framework=args.framework, precision=args.precision, attention=args.attention,
        solver=args.solver, time_limit_s=args.time_limit, memory_limit_gb=args.memory_limit, compile=args.compile,
        every_layer=args.trace_every_layer, prices=load_prices(args.prices) if args.prices else None,
        power=Power(args.pue if args.pue is not None else GOOGLE_2023_PUE, args.node_overhead_w),
        reliability=reliability,
        deadline_s=parse_duration_s(args.deadline, "--deadline") if args.deadline else None,
        budget=parse_amount(args.budget, "--budget") if args.budget else None)
    check_request(req)
    return req


def run_sweep_command(args: argparse.Namespace) -> int:
    req = request_from_args(args)
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        raise AutoparError(f"-o {args.output}: exists and is not a folder")
    missing = [m for m in ("matplotlib", "plotly") if args.output and importlib.util.find_spec(m) is None]
    if missing:  # found out before the sweep runs, not after
        raise AutoparError(f"-o writes frontier.png and report.html, which need {' and '.join(missing)}: "
                           "pip install -c constraints.txt -e '.[sweep]'")
    stderr = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("left"), TimeRemainingColumn(), console=stderr, transient=True,
                        disable=not stderr.is_terminal)
    task = progress.add_task("sweep", total=None)

    def tick(what: str, done: int, total: int) -> None:
        progress.update(task, description=what, completed=done, total=total)

    with progress:
        result = run_sweep(req, jobs=args.jobs, ray_address=args.ray, on_progress=tick)
    written = write_report(result, args.output) if args.output else []
    if args.csv:
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(to_csv(result))
        tmp.replace(path)
        written.append(path)
    if args.json:
        sys.stdout.write(to_json(result))
    else:
        out = Console()
        out = out if out.is_terminal else Console(width=160)
        render_table(result, out)
        if written:
            out.print("wrote " + ", ".join(str(p) for p in written if "plans" not in p.parts)
                            + (f" and {len(result.plans)} plans under {Path(args.output) / 'plans'}"
                               if result.plans and args.output else ""), style="dim", highlight=False)
    return 0


__all__ = ["request_from_args", "run_sweep_command"]
