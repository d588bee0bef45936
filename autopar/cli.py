"""The ``autopar`` command.  Commands: ``plan`` (trace and summarize a model; later: solve a layout)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from rich.console import Console

from autopar import __version__
from autopar.cluster import PRESETS, cluster_from_args
from autopar.errors import AutoparError
from autopar.frontend import trace_model
from autopar.modelfile import parse_config
from autopar.passes import PassContext
from autopar.report import render_model_summary
from autopar.summary import model_summary

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"autopar: error: {message} (see 'autopar {self.prog.split()[-1]} --help')", file=sys.stderr)
        raise SystemExit(EXIT_USER)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="model file (.py defining build_model) or zoo name: gpt, llama, mlp, moe")
    p.add_argument("--config", metavar="K=V,...", help="model config overrides passed to build_model")
    p.add_argument("--seq-len", type=int, metavar="S", help="sequence length (default: the model's)")
    p.add_argument("--attention", choices=("flash", "math"), default="flash",
                   help="attention kernel to cost: flash (default, no s^2 tensors) or math")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default="a100-80gb", metavar="PRESET|FILE",
                   help=f"cluster preset ({', '.join(PRESETS)}) or TOML file (default: a100-80gb)")
    p.add_argument("--gpus", type=int, metavar="N", help="number of devices (overrides the spec)")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="devices per node (overrides the spec)")
    p.add_argument("--inter-node-gbps", type=float, metavar="X", help="per-GPU network line rate in Gb/s")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Automatic parallelization planner for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="trace a model and plan its parallel layout")
    _add_model_args(plan)
    _add_cluster_args(plan)
    plan.add_argument("--global-batch", type=int, metavar="B", help="global batch size in samples")
    plan.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    plan.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    plan.set_defaults(run=cmd_plan)
    return parser


def cmd_plan(args: argparse.Namespace) -> int:
    cluster = cluster_from_args(args.cluster, args.gpus, args.gpus_per_node, args.inter_node_gbps)
    if args.global_batch is not None and args.global_batch < 1:
        raise AutoparError("--global-batch must be >= 1")
    ctx = PassContext(cluster=cluster, attention=args.attention)
    traced = trace_model(args.model, parse_config(args.config), args.seq_len, ctx)
    summary = model_summary(traced.graph, args.global_batch)
    result: dict[str, Any] = {
        "autopar_version": __version__,
        "model": summary,
        "cluster": {"name": cluster.name, "device": cluster.device, "gpus": cluster.gpus,
                    "gpus_per_node": cluster.gpus_per_node},
    }
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        console = Console()
        render_model_summary(summary, args.model, console)
        console.print(f"cluster: {cluster.name}, {cluster.gpus} x {cluster.device}, {cluster.gpus_per_node} per node")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("AUTOPAR_DEBUG") == "1"
    try:
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
