"""The ``autopar`` command: ``plan`` (trace, search, write a plan), ``evaluate`` (estimate given layouts),
``show`` and ``diff`` (look at saved plans), ``codegen`` (plan -> training script), ``verify`` (run a plan
locally and compare with one process)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from autopar import __version__
from autopar.api import plan_model, setup
from autopar.cluster import PRESETS, Cluster
from autopar.errors import AutoparError
from autopar.framework import DEFAULT_FRAMEWORK, FRAMEWORKS
from autopar.frontend import TracedModel, trace_model
from autopar.inter_op.search import default_jobs, search
from autopar.inter_op.techniques import fix_keys, normalize_fix
from autopar.modelfile import parse_config
from autopar.passes import PassContext
from autopar.passes.context import ATTENTION_KERNELS
from autopar.plan_file import Plan
from autopar.plan_view import plan_changes, render_diff, render_explain, render_show
from autopar.report import human_bytes, render_model_summary, render_plan
from autopar.summary import model_summary
from autopar.timeline import write_trace

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"autopar: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(EXIT_USER)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="model file (.py defining build_model), zoo name (gpt, llama, mlp, moe) or "
                        "hf:PATH (a HuggingFace config.json, or a folder holding one)")
    p.add_argument("--config", metavar="K=V,...", help="model config overrides passed to build_model")
    p.add_argument("--seq-len", type=int, metavar="S", help="sequence length (default: the model's)")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                   help="attention kernel to cost: flash (FlashAttention-2, default), flash1, flash3 "
                        "(FlashAttention-3 / cuDNN on Hopper), math (unfused, fused softmax) or eager (unfused)")
    p.add_argument("--trace-every-layer", action="store_true",
                   help="export every block (default: export three identical blocks and repeat them)")


def _add_framework_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--framework", default=DEFAULT_FRAMEWORK, metavar="PRESET|FILE",
                   help=f"the software that trains the plan ({', '.join(FRAMEWORKS)}) or a TOML file; "
                        f"autopar's own runtime is {DEFAULT_FRAMEWORK} (default)")
    p.add_argument("--precision", choices=("bf16", "fp8", "auto"), default="bf16",
                   help="training precision: bf16 (default), fp8 (the layers' Linears in FP8, on devices with FP8 "
                        "tensor cores) or auto (plan: the faster of the two)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each block, and price what Inductor fuses (default: on where the framework "
                        "compiles, as torch and torchtitan do)")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default="a100-80gb", metavar="PRESET|FILE",
                   help=f"cluster preset ({', '.join(PRESETS)}) or TOML file (default: a100-80gb)")
    p.add_argument("--gpus", type=int, metavar="N", help="number of devices (overrides the spec)")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="devices per node (overrides the spec)")
    p.add_argument("--inter-node-gbps", type=float, metavar="X", help="per-GPU network line rate in Gb/s")


def _add_search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch", type=int, metavar="B",
                   help="global batch size in samples (default: max(256, number of devices))")
    p.add_argument("--memory-limit", type=float, metavar="GB",
                   help="per-device memory limit in GiB (default: HBM minus the cluster's reserve)")
    p.add_argument("--solver", choices=("cbc", "highs", "cpsat"), default="cbc", help="intra-op ILP backend")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="time limit of one ILP solve")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def _add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print nothing but errors (the exit code says how it went)")


@contextlib.contextmanager
def _silenced(quiet: bool) -> Iterator[None]:
    """With ``--quiet``: no output, notes, warnings or progress (errors are printed after, by ``main``)."""
    if not quiet:
        yield
        return
    logging.disable(logging.WARNING)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), \
                contextlib.redirect_stderr(devnull):
            yield
    finally:
        logging.disable(logging.NOTSET)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Automatic parallelization planner for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="trace a model and plan its parallel layout")
    _add_model_args(plan)
    _add_cluster_args(plan)
    _add_framework_arg(plan)
    _add_search_args(plan)
    plan.add_argument("--fix", metavar="KEY=VALUE,...", help=f"pin layout keys: {', '.join(fix_keys())}")
    plan.add_argument("--top", type=int, default=1, metavar="K", help="report the K best distinct layouts")
    plan.add_argument("--exhaustive", action="store_true",
                      help="estimate every layout, with no lower bound or cut-off (slow: it plans the same)")
    plan.add_argument("--jobs", type=int, default=default_jobs(), metavar="N",
                      help="processes that solve the intra-op ILPs (default: the cores less one, at least 1; "
                           "the plan is the same)")
    plan.add_argument("-o", "--output", metavar="DIR", help="write DIR/plan.json and DIR/train.py")
    plan.add_argument("--trace", metavar="FILE.json",
                      help="write the simulated iteration as a Chrome trace (Perfetto, chrome://tracing)")
    _add_quiet_arg(plan)
    plan.set_defaults(run=cmd_plan)

    ev = sub.add_parser("evaluate", help="estimate candidate layouts given as JSON lines")
    _add_model_args(ev)
    _add_cluster_args(ev)
    _add_framework_arg(ev)
    _add_search_args(ev)
    ev.add_argument("--layouts", required=True, metavar="FILE.jsonl",
                    help="one JSON object per line with --fix keys; the rest of each layout is searched")
    _add_quiet_arg(ev)
    ev.set_defaults(run=cmd_evaluate)

    gen = sub.add_parser("codegen", help="write a torchrun training script for a plan (the plan's choices as literals)")
    gen.add_argument("plan", metavar="PLAN.json")
    gen.add_argument("-o", "--output", metavar="FILE", default="train.py", help="script to write (train.py)")
    gen.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    _add_quiet_arg(gen)
    gen.set_defaults(run=cmd_codegen)

    show = sub.add_parser("show", help="a saved plan at a glance: mesh, stages, sharding, time and memory")
    show.add_argument("plan", metavar="PLAN.json")
    show.add_argument("--trace", metavar="FILE.json",
                      help="also write the simulated iteration as a Chrome trace (Perfetto, chrome://tracing)")
    show.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    show.set_defaults(run=cmd_show)

    explain = sub.add_parser("explain", help="why an op or parameter is split as it is: its strategy and the "
                                             "cheapest alternatives with their time and memory")
    explain.add_argument("plan", metavar="PLAN.json")
    explain.add_argument("name", metavar="NAME", help="an op name or a parameter FQN (or module path) of the plan")
    explain.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    explain.set_defaults(run=cmd_explain)

    diff = sub.add_parser("diff", help="what changed between two plans, and the estimated effect "
                                       "(exit 0: the same plan, 1: they differ)")
    diff.add_argument("before", metavar="A.json")
    diff.add_argument("after", metavar="B.json")
    diff.add_argument("--json", action="store_true", help="print the changes as one JSON object")
    diff.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    diff.set_defaults(run=cmd_diff)

    rep = sub.add_parser("replan", help="plan a saved plan again for another number of devices (a lost node), "
                                        "and check that a checkpoint loads under it")
    rep.add_argument("plan", metavar="PLAN", help="the plan file to start from")
    rep.add_argument("--gpus", type=int, required=True, metavar="N", help="the devices the new plan runs on")
    rep.add_argument("--gpus-per-node", type=int, metavar="N", help="devices per node (default: the plan's)")
    rep.add_argument("--framework", metavar="PRESET|FILE", help="the plan's framework (default: the one it names)")
    rep.add_argument("--checkpoint", metavar="DIR", help="check that this checkpoint (or the latest under it) "
                                                         "loads under the new plan (reads its metadata only)")
    rep.add_argument("--jobs", type=int, default=default_jobs(), metavar="N", help="processes for the ILPs")
    rep.add_argument("-o", "--output", metavar="DIR", help="write DIR/plan.json and DIR/train.py")
    rep.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _add_quiet_arg(rep)
    rep.set_defaults(run=cmd_replan)

    sw = sub.add_parser("sweep", help="the best plan of every GPU type at every cluster size, and what training "
                                      "on it takes: time, GPU-hours, cost, energy, and the frontier")
    _add_model_args(sw)
    sw.add_argument("--tokens", required=True, metavar="N", help="tokens to train on (15T, 2.5e12)")
    sw.add_argument("--gpus", default="64,128,...,8192", metavar="N,N,...",
                    help="GPU counts; 'a,b,...,c' fills the progression (default 64,128,...,8192)")
    sw.add_argument("--cluster", default="a100-80gb,h100-80gb,h200,b200,gb200-nvl72", metavar="TYPE,...",
                    help="GPU types: cluster presets or TOML files (default: a100-80gb, h100-80gb, h200, b200, "
                         "gb200-nvl72)")
    batch = sw.add_mutually_exclusive_group()
    batch.add_argument("--tokens-per-batch", metavar="N",
                       help="tokens per global batch, held fixed across the points (default 4Mi: 4,194,304)")
    batch.add_argument("--global-batch", type=int, metavar="B", help="sequences per global batch, instead")
    sw.add_argument("--deadline", metavar="TIME", help="train within this time (60d, 12w)")
    sw.add_argument("--budget", metavar="AMOUNT", help="spend at most this (2M), in the price file's currency")
    sw.add_argument("--prices", metavar="FILE.toml",
                    help="prices per GPU-hour by GPU type (examples/prices.toml: dated public list prices); "
                         "without it, cost is in GPU-hours")
    _add_framework_arg(sw)
    sw.add_argument("--memory-limit", type=float, metavar="GB", help="per-device memory limit in GiB")
    sw.add_argument("--solver", choices=("cbc", "highs", "cpsat"), default="cbc", help="intra-op ILP backend")
    sw.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="time limit of one ILP solve")
    sw.add_argument("--pue", type=float, default=None, metavar="X",
                    help="the facility's power usage effectiveness (default 1.10: Google's 2023 fleet)")
    sw.add_argument("--node-overhead-w", type=float, metavar="W",
                    help="what a node draws beyond its GPUs (default: the cluster spec's, from its datasheet)")
    sw.add_argument("--interruptions-per-gpu-day", type=float, metavar="X",
                    help="interruption rate (default: Llama 3's, 419 in 54 days on 16,384 GPUs)")
    sw.add_argument("--restart-time", metavar="TIME", help="time to detect, diagnose and restart after an "
                                                           "interruption (default 10m: MegaScale's)")
    sw.add_argument("--checkpoint-every", metavar="TIME",
                    help="checkpoint interval (default: Young's optimum for each point)")
    sw.add_argument("--checkpoint-gbps", type=float, metavar="GB/s",
                    help="storage write bandwidth per GPU, GB/s (default 0.122: Llama 3's 2 TB/s for 16,384 GPUs)")
    sw.add_argument("--jobs", type=int, default=default_jobs(), metavar="N",
                    help="processes that plan the points (default: the cores less one, at least 1)")
    sw.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                    help="run the points as Ray tasks: on the Ray cluster at ADDRESS (default: the one this "
                         "machine is part of, 'auto'), or 'local' for a new local instance")
    sw.add_argument("--json", action="store_true", help="print the sweep as one JSON object on stdout")
    sw.add_argument("--csv", metavar="FILE.csv", help="also write the points as CSV")
    sw.add_argument("-o", "--output", metavar="DIR",
                    help="write DIR/report.html, DIR/frontier.png, DIR/sweep.json, DIR/sweep.csv and DIR/plans/")
    sw.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    _add_quiet_arg(sw)
    sw.set_defaults(run=cmd_sweep)

    ver = sub.add_parser("verify", help="run plans locally (CPU, gloo) and compare with one process")
    ver.add_argument("plan", metavar="PLAN.json", nargs="+",
                     help="one or more plans; plans of one world size share one launch")
    ver.add_argument("--steps", type=int, default=3, help="training steps to compare (default 3)")
    ver.add_argument("--numerics", choices=("fp32", "bf16"), default="fp32",
                     help="fp32: SGD in fp32, exact to rounding (default); bf16: AdamW in bf16 mixed precision, "
                          "as the plan prices training")
    ver.add_argument("--memory", action="store_true",
                     help="also measure each stage's activation memory (torch's MemTracker) against the plan's")
    ver.add_argument("--compile", action="store_true",
                     help="torch.compile each block on the ranks (Inductor's CPU backend, which needs a C++ "
                          "compiler) and compare with the eager single process")
    ver.add_argument("--tolerance", type=float, default=None,
                     help="max relative difference (default 1e-4 for fp32, 2e-2 for bf16)")
    ver.add_argument("--json", action="store_true",
                     help="print one JSON object on stdout (a list of them for several plans)")
    ver.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    _add_quiet_arg(ver)
    ver.set_defaults(run=cmd_verify)
    return parser


def _setup(args: argparse.Namespace) -> tuple[Cluster, PassContext, TracedModel, int, float]:
    cluster, ctx, batch, budget = setup(args.cluster, args.gpus, args.gpus_per_node, args.inter_node_gbps,
                                        args.global_batch, args.time_limit, args.memory_limit, args.attention,
                                        args.framework, args.precision, args.compile)
    traced = trace_model(args.model, parse_config(args.config), args.seq_len, ctx, args.trace_every_layer)
    return cluster, ctx, traced, batch, budget


def _progress(console: Console | None):
    if console is None:
        return None, None
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                        transient=True)
    task = progress.add_task("planning", total=None)
    return progress, lambda what: progress.update(task, description=what)


def cmd_plan(args: argparse.Namespace) -> int:
    stderr = Console(stderr=True)
    progress, tick = _progress(stderr if stderr.is_terminal else None)
    if progress is not None:
        progress.start()
    try:
        planning = plan_model(args.model, config=parse_config(args.config), cluster=args.cluster, gpus=args.gpus,
                              gpus_per_node=args.gpus_per_node, inter_node_gbps=args.inter_node_gbps,
                              global_batch=args.global_batch, seq_len=args.seq_len, fix=args.fix,
                              memory_limit_gb=args.memory_limit, attention=args.attention, solver=args.solver,
                              time_limit_s=args.time_limit, top=args.top, framework=args.framework,
                              every_layer=args.trace_every_layer, on_progress=tick, precision=args.precision,
                              exhaustive=args.exhaustive, jobs=args.jobs, compile=args.compile)
    finally:
        if progress is not None:
            progress.stop()
    plan, res, traced, cluster, batch = (planning.plan, planning.result, planning.traced, planning.cluster,
                                         planning.global_batch)
    best = res.best
    assert best is not None
    plan_file = None
    if args.output:
        from autopar.codegen.train_script import write_train_script

        plan_file = str(plan.save(Path(args.output) / "plan.json"))
        try:
            write_train_script(plan, Path(args.output) / "train.py")
        except AutoparError as exc:  # a layout the runtime cannot run yet: the plan itself is still good
            print(f"autopar: note: train.py not written: {exc}", file=sys.stderr)
    if res.ilp_status != "optimal":
        print(f"autopar: note: an intra-op ILP stopped at its time limit ({args.time_limit:g} s): the plan uses the "
              f"best solution found, within {res.ilp_gap:.1%} of optimal (raise --time-limit to close the gap)",
              file=sys.stderr)
    if args.trace:  # the plan as its file holds it (rounded), so that 'autopar show --trace' writes the same
        write_trace(Plan.from_json(plan.to_json()), args.trace)
    result: dict[str, Any] = {
        "autopar_version": __version__,
        "model": model_summary(traced.graph, batch),
        "cluster": {"name": cluster.name, "device": cluster.device, "gpus": cluster.gpus,
                    "gpus_per_node": cluster.gpus_per_node},
        "layout": best.estimate.layout.to_dict(),
        "estimate": best.estimate.to_dict(),
        "compile": plan.compile,
        "solve": {"time_s": res.solve_time_s, "solver": args.solver, "status": res.ilp_status,
                  "gap": res.ilp_gap, "layouts_enumerated": res.enumerated, "layouts_pruned_by_bound": res.pruned_bound,
                  "layouts_pruned_by_memory": res.pruned_memory, "layouts_evaluated": res.evaluated,
                  "ilp_solves": res.ilp_solves},
        "plan_file": plan_file, "trace_file": args.trace,
        "stages": plan.stages,
        "candidates": [{"layout": c.estimate.layout.to_dict(), "estimate": c.estimate.to_dict()}
                       for c in res.candidates],
    }
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        console = Console()
        render_model_summary(result["model"], args.model, console)
        render_plan(result, console)
    return EXIT_OK


def _changes_json(changes: list) -> list[dict[str, Any]]:
    """``autopar diff``'s and ``replan``'s changes, as their ``--json`` prints them."""
    return [{"what": c.what, "before": c.before, "after": c.after} for c in changes]


def cmd_evaluate(args: argparse.Namespace) -> int:
    path = Path(args.layouts)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AutoparError(f"cannot read {path}: {exc.strerror}") from exc
    requests = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AutoparError(f"{path}:{i}: not a JSON object ({exc.msg})") from exc
        if not isinstance(raw, dict):
            raise AutoparError(f"{path}:{i}: expected a JSON object of layout keys")
        requests.append((i, raw))
    if args.precision == "auto":
        raise AutoparError("evaluate prices the layouts it is given: --precision must be bf16 or fp8, not auto")
    cluster, ctx, traced, batch, budget = _setup(args)
    for i, raw in requests:
        out: dict[str, Any] = {"line": i, "input": raw}
        try:
            fixed = normalize_fix(raw)
            res = search(traced.graph, cluster, ctx, batch, fixed, budget, args.solver, args.time_limit, 1)
            best = res.best
            if best is None:
                raise AutoparError("the layout does not divide the cluster and the global batch")
            if not best.estimate.fits:
                raise AutoparError(f"the layout does not fit: it needs {human_bytes(best.estimate.peak_memory_bytes)}"
                                   f" per device, {human_bytes(budget)} available")
            out["layout"] = best.estimate.layout.to_dict()
            out["estimate"] = best.estimate.to_dict()
        except AutoparError as exc:
            out["error"] = str(exc)
        print(json.dumps(out, sort_keys=True), flush=True)
    return EXIT_OK


def cmd_codegen(args: argparse.Namespace) -> int:
    from autopar.codegen.train_script import write_train_script

    plan = Plan.load(args.plan)
    path = write_train_script(plan, args.output)
    print(f"wrote {path} (run: torchrun --nproc-per-node {plan.num_devices} {path})")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    render_show(plan, Console())
    if args.trace:
        Console().print(f"wrote {write_trace(plan, args.trace)} (open it in ui.perfetto.dev or chrome://tracing)")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    render_explain(Plan.load(args.plan), args.name, Console())
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = Plan.load(args.before), Plan.load(args.after)
    changes = plan_changes(a, b)
    if args.json:
        print(json.dumps({"same": not changes, "changes": _changes_json(changes),
                          "iteration_time_s": [a.estimate["iteration_time_s"], b.estimate["iteration_time_s"]],
                          "peak_memory_bytes": [a.estimate["peak_memory_bytes"], b.estimate["peak_memory_bytes"]]},
                         indent=2, sort_keys=True))
    else:
        render_diff(a, b, changes, Console(), (args.before, args.after))
    return EXIT_OK if not changes else EXIT_INTERNAL


def cmd_replan(args: argparse.Namespace) -> int:
    from autopar.replan import check_checkpoint, replan

    old = Plan.load(args.plan)
    new = replan(old, args.gpus, args.framework, args.jobs, args.gpus_per_node).plan
    checked = check_checkpoint(new, args.checkpoint) if args.checkpoint else None
    written = None
    if args.output:
        from autopar.codegen.train_script import write_train_script

        written = str(new.save(Path(args.output) / "plan.json"))
        try:
            write_train_script(new, Path(args.output) / "train.py")
        except AutoparError as exc:
            print(f"autopar: note: train.py not written: {exc}", file=sys.stderr)
    changes = plan_changes(old, new)
    if args.json:
        print(json.dumps({"plan_file": written, "devices": [old.num_devices, new.num_devices],
                          "layout": new.layout, "estimate": new.estimate,
                          "changes": _changes_json(changes),
                          "checkpoint": None if checked is None else {"path": str(checked[0]),
                                                                      "tensors_checked": checked[1]}},
                         indent=2, sort_keys=True))
        return EXIT_OK
    console = Console()
    render_diff(old, new, changes, console, (args.plan, written or f"replanned for {args.gpus} devices"))
    if checked is not None:
        console.print(f"checkpoint {checked[0]}: its {checked[1]} tensors fit the new plan; resume with "
                      f"train.py --resume {checked[0]}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    from autopar.sweep.command import run_sweep_command

    return run_sweep_command(args)


def cmd_verify(args: argparse.Namespace) -> int:
    from autopar.runtime.verify import verify_many

    if args.steps < 1:
        raise AutoparError("--steps must be >= 1")
    results = verify_many(args.plan, steps=args.steps, tolerance=args.tolerance, numerics=args.numerics,
                          memory=args.memory, compile=args.compile)
    reports = []
    for path, res in zip(args.plan, results):
        reports.append({"plan": path, "ok": res.ok, "numerics": args.numerics, "losses": res.losses,
                        "reference_losses": res.reference_losses, "loss_rel_diff": res.loss_rel_diff,
                        "grad_rel_diff": res.grad_rel_diff, "param_rel_diff": res.param_rel_diff,
                        "tolerance": res.tolerance, "sharded_parameters": res.sharded_parameters,
                        "placements": res.placements, "dropout_off": res.dropout_off})
        if args.compile:
            reports[-1]["compiled"] = res.compiled
        if args.memory:
            reports[-1]["activations"] = [{"stage": k, "measured_bytes": got, "estimated_bytes": want}
                                          for k, (got, want) in sorted(res.activations.items())]
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, sort_keys=True))
    else:
        console = Console()
        for path, res in zip(args.plan, results):
            got = ", ".join(f"{x:.6f}" for x in res.losses)
            want = ", ".join(f"{x:.6f}" for x in res.reference_losses)
            console.print(f"{path + ': ' if len(results) > 1 else ''}losses {got} (reference {want})\n"
                          f"max relative difference: loss {res.loss_rel_diff:.2e}, grads {res.grad_rel_diff:.2e}, "
                          f"params {res.param_rel_diff:.2e} (tolerance {res.tolerance:.0e}): "
                          f"{'OK' if res.ok else 'FAILED'}")
            if res.compiled:
                console.print(f"  compiled: {res.compiled['graphs']} graphs by Inductor on rank 0, "
                              f"{res.compiled['breaks']} graph breaks")
            if res.dropout_off:
                console.print(f"  dropout was off for the check in both runs ({res.dropout_off} dropout "
                              "probabilities of the model set to 0: the runs would draw different masks); "
                              "train.py keeps them")
            for k, (measured, planned) in sorted(res.activations.items()):
                seen = (f"measured {measured / 2**20:.2f} MiB ({measured / planned:.2f}x)" if measured is not None
                        else "not measured (torch's memory tracker takes one model chunk per rank)")
                console.print(f"  stage {k} activations: planned {planned / 2**20:.2f} MiB, {seen}")
    return EXIT_OK if all(res.ok for res in results) else EXIT_INTERNAL


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("AUTOPAR_DEBUG") == "1"
    try:
        with _silenced(getattr(args, "quiet", False)):
            return args.run(args)
    except AutoparError as exc:
        if debug:
            traceback.print_exc()
        print(f"autopar: error: {exc}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        print(f"autopar: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
