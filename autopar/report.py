"""Human-readable rendering with rich. Only the CLI's human output goes through here."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def render_model_summary(summary: dict[str, Any], title: str, console: Console) -> None:
    table = Table(title=f"Model: {title}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("parameters", f"{human_count(summary['parameters'])} ({summary['parameters']:,})")
    types = summary["layer_types"]
    table.add_row("layers", f"{summary['layers']} in {summary['layer_container'] or '-'}, "
                            f"{len(types)} distinct type{'s' if len(types) != 1 else ''}")
    for t in types:
        table.add_row(f"  type {t['hash']}", f"{t['count']} x {t['module_type'] or 'layer'}: "
                      f"{human_count(t['parameters_per_layer'])} params, {t['ops_per_layer']} ops")
    table.add_row("sequence length", str(summary["seq_len"]))
    table.add_row("FLOPs per token", f"{human_flops(summary['flops_per_token'])} (fwd+bwd, model FLOPs)")
    if "flops_per_iteration" in summary:
        table.add_row("FLOPs per iteration", f"{human_flops(summary['flops_per_iteration'])} "
                                             f"(global batch {summary['global_batch']})")
    mem = summary["memory_bytes"]
    table.add_row("weights", human_bytes(mem["weights"]))
    table.add_row("gradients", human_bytes(mem["grads"]))
    table.add_row("optimizer state", human_bytes(mem["optimizer"]))
    table.add_row("activations", f"{human_bytes(mem['activations_per_sample'])} per sample")
    table.add_row("traced", f"{summary['ops']} ops in {summary['trace_time_s']:.2f} s "
                            f"(backward {summary['backward']})")
    console.print(table)
