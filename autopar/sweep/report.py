"""A sweep's answer: the rich table, the JSON and CSV rows, ``frontier.png`` (matplotlib) and ``report.html``
(plotly, inline: one self-contained page).  Every figure carries its GPU type's accuracy band."""

from __future__ import annotations

import csv
import html
import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.errors import AutoparError
from autopar.sweep.frontier import cost_of
from autopar.sweep.quantities import human_amount, human_duration
from autopar.sweep.sweep import SweepResult

#: The columns of ``--csv``, in order (a row's missing values are empty).
CSV_COLUMNS = ("point", "gpu_type", "device", "gpus", "rounded", "status", "layout", "iteration_time_s",
               "tokens_per_s", "mfu", "train_s", "wall_s", "goodput", "gpu_hours", "cost", "energy_kwh",
               "busy_fraction", "scaling_efficiency", "compute_s", "recompute_s", "bubble_s", "communication_s",
               "peak_memory_bytes", "memory_budget_bytes", "leanest_bytes", "checkpoint_every_s",
               "checkpoint_save_s", "interruptions", "pareto_time_cost", "pareto_time_energy", "meets_deadline",
               "meets_budget", "best_choice", "error_band", "plan_file", "note")


def sorted_rows(result: SweepResult) -> list[dict[str, Any]]:
    """Planned points by cost (then time), then the points that could not be planned."""
    ok = sorted(result.ok(), key=lambda r: (cost_of(r), r["wall_s"], r["point"]))
    return ok + [r for r in result.rows if r["status"] != "ok"]


def _money(value: float, unit: str) -> str:
    return f"{human_amount(value)} {unit}" if unit != "USD" else f"${human_amount(value)}"


def render_table(result: SweepResult, console: Console) -> None:
    """The sweep as a rich table sorted by cost, with the frontier marked, and what every figure rests on."""
    meta = result.meta
    unit = meta["cost_unit"]
    table = Table(title=f"{meta['model']}: {human_amount(meta['tokens'])} tokens, "
                        f"{human_amount(meta['tokens_per_batch'])} tokens per batch ({meta['global_batch']} x "
                        f"{meta['seq_len']})", title_justify="left")
    for name, justify in (("GPU type", "left"), ("GPUs", "right"), ("layout", "left"), ("time", "right"),
                          ("cost" if unit != "GPU-hours" else "GPU-hours", "right"), ("energy", "right"),
                          ("MFU", "right"), ("goodput", "right"), ("scaling", "right"), ("memory", "right"),
                          ("frontier", "center"), ("note", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    footnotes: list[str] = []

    def footnote(text: str) -> str:
        if not text:
            return ""
        footnotes.append(text)
        return f"[{len(footnotes)}]"

    for r in sorted_rows(result):
        gpus = f"{r['gpus']}*" if r["rounded"] else str(r["gpus"])
        if r["status"] != "ok":
            table.add_row(r["gpu_type"], gpus, f"[red]{r['status']}[/red]", "", "", "", "", "", "", "", "",
                          footnote(r["note"]))
            continue
        band = f" ±{r['error_band']:.0%}" if r["error_band"] is not None else " ±?"
        marks = ("T" if r["pareto_time_cost"] else "") + ("E" if r["pareto_time_energy"] else "")
        if r["best_choice"]:
            marks = f"[bold green]{marks or '-'} best[/bold green]"
        late = r["meets_deadline"] is False or r["meets_budget"] is False
        style = "dim" if late else ""
        table.add_row(r["gpu_type"], gpus, r["layout"], human_duration(r["wall_s"]) + band,
                      _money(r["cost"], unit) if r["cost"] is not None else f"{human_amount(r['gpu_hours'])}",
                      f"{r['energy_kwh'] / 1e3:,.0f} MWh" if r["energy_kwh"] >= 1e4 else f"{r['energy_kwh']:,.0f} kWh",
                      f"{r['mfu']:.1%}", f"{r['goodput']:.1%}", f"{r['scaling_efficiency']:.0%}",
                      f"{r['peak_memory_bytes'] / 2**30:.0f}/{r['memory_budget_bytes'] / 2**30:.0f} GiB", marks,
                      footnote(r["note"]), style=style)
    console.print(table)
    for i, text in enumerate(footnotes, 1):
        console.print(f"[{i}] {text}", highlight=False, markup=False)
    lines = ["frontier: T = Pareto-optimal on (time, cost), E = on (time, energy); * = GPU count rounded to what "
             "the cluster takes; time includes the expected loss to interruptions (goodput)"]
    if meta["deadline_s"] is None and meta["budget"] is None:
        best = next((r for r in result.ok() if r["best_choice"]), None)
        if best is not None:
            lines.append(f"best: the cheapest point, {best['gpu_type']} x {best['gpus']} (--deadline and --budget "
                         "pick the cheapest that meets them)")
    else:
        asked = [f"deadline {human_duration(meta['deadline_s'])}" if meta["deadline_s"] is not None else "",
                 f"budget {_money(meta['budget'], unit)}" if meta["budget"] is not None else ""]
        best = next((r for r in result.ok() if r["best_choice"]), None)
        lines.append(f"{' and '.join(a for a in asked if a)}: " + (
            f"the cheapest point that meets it is {best['gpu_type']} x {best['gpus']}" if best else
            "no point meets it (dimmed rows miss it)"))
    if meta["prices"] is None:
        lines.append("cost in GPU-hours: no --prices given (examples/prices.toml holds dated public list prices)")
    else:
        lines.append(f"prices from {meta['prices']}")
    lines += [f"accuracy: {note}" for note in meta["accuracy"].values()]
    for line in lines:
        console.print(line, style="dim", highlight=False)


def to_json(result: SweepResult) -> str:
    return json.dumps({"meta": result.meta, "points": sorted_rows(result)}, indent=2, sort_keys=True,
                      allow_nan=False) + "\n"


def to_csv(result: SweepResult) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in sorted_rows(result):
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})
    return out.getvalue()


def frontier_png(result: SweepResult) -> bytes:
    """The frontier as a PNG (matplotlib): each GPU type's points on (time to train, cost), with the accuracy
    band of their type around each, and the Pareto frontier joined."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise AutoparError("frontier.png needs matplotlib: pip install -c constraints.txt -e '.[sweep]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = result.meta["cost_unit"]
    fig, ax = plt.subplots(figsize=(9, 6))
    for gpu_type, rows in _by_type(result).items():
        xs = [r["wall_s"] / 86400 for r in rows]
        ys = [cost_of(r) for r in rows]
        band = rows[0]["error_band"]
        err = ([x * band for x in xs], [y * band for y in ys]) if band is not None else (None, None)
        label = f"{gpu_type} (±{band:.0%})" if band is not None else f"{gpu_type} (no published check)"
        ax.errorbar(xs, ys, xerr=err[0], yerr=err[1], fmt="o", capsize=3, label=label)
        for x, y, r in zip(xs, ys, rows, strict=True):
            ax.annotate(str(r["gpus"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = sorted((r for r in result.ok() if r["pareto_time_cost"]), key=lambda r: r["wall_s"])
    if front:
        ax.plot([r["wall_s"] / 86400 for r in front], [cost_of(r) for r in front], "k--", linewidth=1,
                label="Pareto frontier")
    if result.meta["deadline_s"]:
        ax.axvline(result.meta["deadline_s"] / 86400, color="tab:red", linewidth=1, label="deadline")
    if result.meta["budget"]:
        ax.axhline(result.meta["budget"], color="tab:purple", linewidth=1, label="budget")
    ax.set(xscale="log", yscale="log", xlabel="time to train (days, with interruptions)",
           ylabel=f"cost ({unit})", title=f"{result.meta['model']}: {human_amount(result.meta['tokens'])} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _by_type(result: SweepResult) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(result.ok(), key=lambda r: (r["gpu_type"], r["gpus"])):
        out.setdefault(r["gpu_type"], []).append(r)
    return out


def report_html(result: SweepResult) -> str:
    """One self-contained page (plotly inlined): the frontier, time and cost against GPU count per GPU type,
    each point's breakdown and memory, and a table linking each point's plan file (``plans/KEY.json``)."""
    try:
        import plotly.graph_objects as go
    except ModuleNotFoundError as exc:
        raise AutoparError("report.html needs plotly: pip install -c constraints.txt -e '.[sweep]'") from exc
    meta, unit = result.meta, result.meta["cost_unit"]
    by_type = _by_type(result)
    frontier = go.Figure()
    for gpu_type, rows in by_type.items():
        band = rows[0]["error_band"] or 0.0
        days = [r["wall_s"] / 86400 for r in rows]
        costs = [cost_of(r) for r in rows]
        frontier.add_trace(go.Scatter(
            x=days, y=costs, mode="markers+text", name=gpu_type, text=[str(r["gpus"]) for r in rows],
            textposition="top right", hovertext=[f"{r['gpus']} GPUs: {r['layout']}" for r in rows],
            error_x={"type": "data", "array": [d * band for d in days], "visible": band > 0},
            error_y={"type": "data", "array": [c * band for c in costs], "visible": band > 0}))
    front = sorted((r for r in result.ok() if r["pareto_time_cost"]), key=lambda r: r["wall_s"])
    frontier.add_trace(go.Scatter(x=[r["wall_s"] / 86400 for r in front], y=[cost_of(r) for r in front],
                                  mode="lines", name="Pareto frontier", line={"dash": "dash", "color": "black"}))
    frontier.update_layout(title="Time to train and cost (bars: each GPU type's median estimate error)",
                           xaxis={"type": "log", "title": "days"}, yaxis={"type": "log", "title": unit})
    scaling = go.Figure()
    costs = go.Figure()
    for gpu_type, rows in by_type.items():
        gpus = [r["gpus"] for r in rows]
        scaling.add_trace(go.Scatter(x=gpus, y=[r["wall_s"] / 86400 for r in rows], mode="lines+markers",
                                     name=gpu_type))
        costs.add_trace(go.Scatter(x=gpus, y=[cost_of(r) for r in rows], mode="lines+markers", name=gpu_type))
    scaling.update_layout(title="Time to train against GPU count", xaxis={"type": "log", "title": "GPUs"},
                          yaxis={"type": "log", "title": "days"})
    costs.update_layout(title="Cost against GPU count", xaxis={"type": "log", "title": "GPUs"},
                        yaxis={"type": "log", "title": unit})
    ok = sorted(result.ok(), key=lambda r: (r["gpu_type"], r["gpus"]))
    names = [r["point"] for r in ok]
    breakdown = go.Figure()
    for term, label in (("compute_s", "compute"), ("recompute_s", "recomputation"), ("bubble_s", "pipeline bubble"),
                        ("communication_s", "exposed communication")):
        breakdown.add_trace(go.Bar(x=names, y=[r[term] for r in ok], name=label))
    breakdown.update_layout(barmode="stack", title="One iteration, by what it spends (s)")
    memory = go.Figure([go.Bar(x=names, y=[r["peak_memory_bytes"] / 2**30 for r in ok], name="peak"),
                        go.Bar(x=names, y=[r["memory_budget_bytes"] / 2**30 for r in ok], name="usable")])
    memory.update_layout(barmode="group", title="Memory per device (GiB)")
    figures = [frontier, scaling, costs, breakdown, memory]
    divs = [fig.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=f"fig{i}")
            for i, fig in enumerate(figures)]
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in meta["accuracy"].values())
    return _PAGE.format(title=html.escape(f"autopar sweep: {meta['model']}"),
                        heading=html.escape(f"{meta['model']}: {human_amount(meta['tokens'])} tokens, "
                                            f"{meta['global_batch']} x {meta['seq_len']} tokens per batch"),
                        notes=notes, figures="\n".join(divs), table=_html_table(result))


def _html_table(result: SweepResult) -> str:
    unit = result.meta["cost_unit"]
    head = ("GPU type", "GPUs", "status", "layout", "time to train", "GPU-hours", f"cost ({unit})", "energy (kWh)",
            "MFU", "frontier", "plan", "note")
    rows = []
    for r in sorted_rows(result):
        if r["status"] == "ok":
            marks = " ".join(m for m, on in (("time-cost", r["pareto_time_cost"]),
                                             ("time-energy", r["pareto_time_energy"]),
                                             ("best", r["best_choice"])) if on)
            cells = [r["gpu_type"], str(r["gpus"]), "ok", r["layout"], human_duration(r["wall_s"]),
                     f"{r['gpu_hours']:,.0f}", "" if r["cost"] is None else f"{r['cost']:,.0f}",
                     f"{r['energy_kwh']:,.0f}", f"{r['mfu']:.1%}", marks]
            link = f'<a class="plan-link" href="{html.escape(r["plan_file"])}">{html.escape(r["point"])}</a>'
        else:
            cells, link = [r["gpu_type"], str(r["gpus"]), r["status"], "", "", "", "", "", "", ""], ""
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f"<td>{link}</td>"
                    + f"<td>{html.escape(r['note'])}</td></tr>")
    return ("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:left}}</style></head>
<body><h1>{heading}</h1>
<p>Estimates by autopar; each GPU type's error against published runs:</p><ul>{notes}</ul>
{figures}
<h2>Points</h2>
{table}
</body></html>
"""


def write_report(result: SweepResult, folder: str | Path) -> list[Path]:
    """Write ``frontier.png``, ``report.html``, ``sweep.json``, ``sweep.csv`` and ``plans/KEY.json`` under
    ``folder``: every file is made in memory first, so an error leaves nothing half-written."""
    folder = Path(folder)
    files = {"sweep.json": to_json(result).encode(), "sweep.csv": to_csv(result).encode(),
             "frontier.png": frontier_png(result), "report.html": report_html(result).encode()}
    files.update({f"plans/{key}.json": text.encode() for key, text in sorted(result.plans.items())})
    written = []
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        written.append(path)
    return written


__all__ = ["CSV_COLUMNS", "frontier_png", "render_table", "report_html", "sorted_rows", "to_csv", "to_json",
           "write_report"]
