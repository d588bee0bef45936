"""Human-readable rendering with rich. Only the CLI's human output goes through here."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _scaled(n: float, units: tuple[tuple[str, float], ...], fallback: str) -> str:
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return fallback.format(n)


def human_count(n: float) -> str:
    return _scaled(n, (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)), "{:.0f}")


def human_bytes(n: float) -> str:
    return _scaled(n, ((" TiB", 2**40), (" GiB", 2**30), (" MiB", 2**20), (" KiB", 2**10)), "{:.0f} B")


def human_flops(n: float) -> str:
    return _scaled(n, ((" PFLOP", 1e15), (" TFLOP", 1e12), (" GFLOP", 1e9), (" MFLOP", 1e6)), "{:.0f} FLOP")


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def render_model_summary(summary: dict[str, Any], title: str, console: Console) -> None:
    table = Table(title=f"Model: {title}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("parameters", f"{human_count(summary['parameters'])} ({summary['parameters']:,})")
    trainable = summary.get("trainable_parameters", summary["parameters"])
    if trainable != summary["parameters"]:
        table.add_row("  trainable", f"{human_count(trainable)} ({trainable / summary['parameters']:.2%}); the rest "
                                     "frozen: 16-bit weights, no gradients, no optimizer state")
    types = summary["layer_types"]
    table.add_row("layers", f"{summary['layers']} in {summary['layer_container'] or '-'}, "
                            f"{len(types)} distinct type{'s' if len(types) != 1 else ''}")
    for t in types:
        table.add_row(f"  type {t['hash']}", f"{t['count']} x {t['module_type'] or 'layer'}: "
                      f"{human_count(t['parameters_per_layer'])} params, {t['ops_per_layer']} ops")
    stacks = summary.get("pipeline_stacks", [])
    if len(stacks) > 1:  # an encoder-decoder: the stages' layer numbers run over both stacks
        table.add_row("pipeline layers", " then ".join(f"{s['container']} ({s['blocks']})" for s in stacks))
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


def layout_text(layout: dict[str, Any]) -> str:
    sched = layout["schedule"] + (f" v={layout['v']}" if layout["v"] > 1 else "")
    cp, ep = layout.get("cp", 1), layout.get("ep", 1)
    return (f"dp={layout['dp']}" + (f" ep={ep}" if ep > 1 else "") + (f" cp={cp}" if cp > 1 else "")
            + f" tp={layout['tp']} pp={layout['pp']} "
            f"mbs={layout['mbs']} "
            f"m={layout['num_microbatches']} {sched} recompute={layout['recompute']} "
            f"sp={'on' if layout['sp'] else 'off'} zero={layout['zero']}")


def stage_layers_text(stage: dict[str, Any]) -> str:
    """A plan stage's layers (each chunk's span) and whether it holds the embedding or the head."""
    extra = (" +emb" if stage["has_embedding"] else "") + (" +head" if stage["has_head"] else "")
    spans = [f"{lo}-{hi - 1}" if hi > lo else "none" for lo, hi in (stage.get("chunks") or [stage["layers"]])]
    return ", ".join(spans) + extra


def render_plan(result: dict[str, Any], console: Console) -> None:
    est, lay = result["estimate"], result["layout"]
    table = Table(title="Plan", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("layout", layout_text(lay))
    cp = lay.get("cp", 1)
    table.add_row("mesh", f"pp={lay['pp']} x dp={lay['dp']} x cp={cp} x tp={lay['tp']} = "
                          f"{lay['pp'] * lay['dp'] * cp * lay['tp']} devices")
    table.add_row("iteration", f"{human_time(est['iteration_time_s'])}  ({est['tokens_per_s']:,.0f} tokens/s)")
    table.add_row("throughput", f"{est['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {est['mfu']:.1%} (model FLOPs, "
                                f"attention in full), HFU {est['hfu']:.1%} (executed, recompute included)")
    table.add_row("peak memory", f"{human_bytes(est['peak_memory_bytes'])} per device"
                                 f" ({'fits' if est['fits'] else 'DOES NOT FIT'})")
    table.add_row("precision", est.get("precision", "bf16") + (" (the layers' Linears; attention, norms, embedding "
                                                             "and head in bf16)" if est.get("precision") == "fp8"
                                                             else ""))
    if "compile" in result:
        table.add_row("compile", "each block torch.compile'd (Inductor fuses its element-wise work)"
                      if result["compile"] else "eager (no torch.compile)")
    for key, value in est["breakdown"].items():
        table.add_row(f"  {key.removesuffix('_s').replace('_', ' ')}", human_time(value))
        if key == "compute_s":
            for part, t in est.get("compute_detail", {}).items():
                if t > 0:
                    table.add_row(f"    of which {part.removesuffix('_s').replace('_', ' ')}", human_time(t))
    solve = result["solve"]
    status = solve["status"] + (f", within {solve['gap']:.1%} of optimal" if solve["status"] != "optimal" else "")
    table.add_row("solve", f"{solve['time_s']:.2f} s ({solve['solver']}, {status}, {solve['ilp_solves']} ILP solves)")
    table.add_row("layouts", f"{solve['layouts_enumerated']}: {solve['layouts_pruned_by_bound']} pruned by the time "
                             f"bound, {solve['layouts_pruned_by_memory']} by the memory bound, "
                             f"{solve['layouts_evaluated']} estimated")
    if result.get("plan_file"):
        table.add_row("plan file", result["plan_file"])
    if result.get("trace_file"):
        table.add_row("trace", f"{result['trace_file']} (ui.perfetto.dev or chrome://tracing)")
    console.print(table)
    stages = Table(title="Stages", title_justify="left")
    for col in ("stage", "layers", "ranks", "time / micro-batch", "memory"):
        stages.add_column(col)
    for s in result.get("stages", []):
        stages.add_row(str(s["index"]), stage_layers_text(s),
                       f"{s['ranks'][0]}-{s['ranks'][1] - 1}", human_time(s["estimated_time_per_microbatch_s"]),
                       human_bytes(s["estimated_memory_bytes"]))
    console.print(stages)
    if len(result.get("candidates", [])) > 1:
        top = Table(title="Best layouts", title_justify="left")
        for col in ("#", "layout", "iteration", "MFU", "memory"):
            top.add_column(col)
        for i, c in enumerate(result["candidates"]):
            e = c["estimate"]
            top.add_row(str(i + 1), layout_text(c["layout"]), human_time(e["iteration_time_s"]), f"{e['mfu']:.1%}",
                        human_bytes(e["peak_memory_bytes"]))
        console.print(top)
