"""Regenerate ``docs/accuracy.md`` and ``docs/accuracy.png`` from the benchmark results.

Reads ``benchmarks/results/calibration.json`` (``python benchmarks/calibration.py``) and
``benchmarks/results/ranking.json`` (``python benchmarks/ranking.py``), and, when present, the wider checks
of ``WIDER`` (``calibration.py --references`` on another published table, e.g. llm-foundry's, see
``import_llm_foundry.py``).  The figure needs matplotlib, the
``bench`` extra: ``pip install -c constraints.txt -e '.[bench]'``.

    python benchmarks/accuracy_report.py
"""

from __future__ import annotations

import json
import re
import statistics
import textwrap
from pathlib import Path
from typing import Any

from autopar.inter_op.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
#: Per-GPU accuracy, packaged: ``autopar sweep`` prints it beside every figure.
ACCURACY_JSON = ROOT / "autopar" / "accuracy.json"


#: Wider checks: (results file stem, what the rows are, the command that writes the results).
WIDER = (("llm_foundry_tables", "MosaicML llm-foundry's MPT benchmark tables (FSDP, 125M-70B, 8-512 GPUs)",
          "python benchmarks/calibration.py --references benchmarks/reference/llm_foundry_tables.json "
          "--output benchmarks/results/llm_foundry_tables.json"),
         ("megatron_core_h100_table", "the Megatron-LM README's H100 table (Megatron-Core, 1.7B-462B, 48-6144 GPUs)",
          "python benchmarks/calibration.py --references benchmarks/reference/megatron_core_h100_table.json "
          "--output benchmarks/results/megatron_core_h100_table.json"),
         ("nvidia_h100_tables", "NVIDIA's published H100 BF16 and FP8 runs (DGX Cloud recipes, NeMo 24.07, "
          "Megatron-Bridge 25.09; 8-2048 GPUs)",
          "python benchmarks/calibration.py --references benchmarks/reference/nvidia_h100_tables.json "
          "--output benchmarks/results/nvidia_h100_tables.json"),
         ("torchtitan_h100_tables", "torchtitan's H100 runs of Llama 3.1 8B eager, compiled and compiled with Float8 "
          "(FSDP, 8 and 128 GPUs; what torch.compile and compiled FP8 casts buy)",
          "python benchmarks/calibration.py --references benchmarks/reference/torchtitan_h100_tables.json "
          "--output benchmarks/results/torchtitan_h100_tables.json"),
         ("nvidia_blackwell_tables", "NVIDIA's published Blackwell FP8 runs (NeMo 25.02 and 25.04, Megatron-Bridge "
          "25.11 and 26.06: DGX B200 and GB200 NVL72, beside the H100 runs of the same models and releases; "
          "8-1024 GPUs)",
          "python benchmarks/calibration.py --references benchmarks/reference/nvidia_blackwell_tables.json "
          "--output benchmarks/results/nvidia_blackwell_tables.json"))


#: Models other than decoder LMs: (results file stem, what, command); each row shown, none pooled into the per-GPU
#: accuracy ``autopar sweep`` prints (those are LLM training runs).
BEYOND_DECODERS = ("beyond_decoders", "models other than decoder LMs (a diffusion transformer, BERT-large)",
                   "python benchmarks/calibration.py --references benchmarks/reference/beyond_decoders.json "
                   "--output benchmarks/results/beyond_decoders.json")


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: run python benchmarks/{name}.py first")
    return json.loads(path.read_text())


def _layout(r: dict[str, Any]) -> str:
    if "per_layer" in r:
        return f"one layer, tp{r['fixed']['tp']} mbs{r['fixed']['mbs']}"
    return Layout.of(r["layout"]).describe()


def _scatter(calib: dict[str, Any], ranking: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    ax = axes[0]
    rows = [r for r in calib["rows"] if r["error"] is not None]
    for r in rows:
        refused = r.get("fits") is False
        ax.scatter(r["measured_s"], r["estimate_s"], marker="x" if refused else "o",
                   color="tab:red" if abs(r["error"]) > 0.2 else "tab:blue")
    lo = min(min(r["measured_s"], r["estimate_s"]) for r in rows) / 1.5
    hi = max(max(r["measured_s"], r["estimate_s"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1)
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.2, label="±20 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured iteration time (s)",
           ylabel="autopar estimate (s)", title="Published runs (layouts pinned)")
    ax.legend(loc="upper left")
    ax = axes[1]
    for sweep in ranking["sweeps"]:
        pts = [(r["measured_s"], r["estimate_s"]) for r in sweep["rows"] if r["estimate_s"] is not None]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=f"{sweep['sweep']} "
                   f"(Spearman {sweep['spearman']:.2f})")
        pick = sweep["top_pick"]
        ax.scatter([pick["measured_s"]], [pick["estimate_s"]], marker="*", s=200, color="tab:orange",
                   label="autopar's top pick")
    ax.set(xlabel="measured step time (s)", ylabel="autopar estimate (s)", title="Layout sweep")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(calib: dict[str, Any], ranking: dict[str, Any]) -> str:
    s = calib["summary"]
    lines = [
        "# How accurate autopar's estimates are",
        "",
        "Generated by `python benchmarks/accuracy_report.py` from `benchmarks/results/calibration.json` and",
        "`benchmarks/results/ranking.json`; do not edit by hand.",
        "",
        "Every published run in `benchmarks/reference/calibration.json` is planned with its published layout",
        "pinned (knobs the source does not publish are searched), on its cluster preset and framework profile,",
        "and the estimate is compared with the measured iteration time.",
        "",
        f"- **{s['rows']} runs**: median |error| **{s['median_abs_error']:.1%}**, largest "
        f"**{s['max_abs_error']:.1%}**, median signed error **{s['median_signed_error']:+.1%}**; "
        f"{s['within_10pct']} of {s['scored']} within 10 %; {s.get('too_slow', 0)} estimated too slow "
        f"(pessimistic), {s['scored'] - s.get('too_slow', 0)} too fast.",
        f"- Layouts that ran but are refused for memory: {', '.join(s['refused']) or 'none'}.",
    ]
    for sweep in ranking["summary"]:
        pick, best = sweep["top_pick"], sweep["measured_best"]
        lines.append(f"- **Sweep {sweep['sweep']}** ({sweep['runs']} layouts): Spearman **{sweep['spearman']:.3f}**; "
                     f"autopar's top pick measured {pick['measured_s']:.1f} s against the best "
                     f"{best['measured_s']:.1f} s (regret **{sweep['top_pick_regret']:+.1%}**).")
    lines += ["", "![estimate vs measured](accuracy.png)", "", "## Published runs, by GPU", ""]
    lines += _by_gpu(calib["rows"])
    lines += ["| run | GPU | GPUs | framework | attention | layout | estimate | measured | error | MFU (est.) |",
              "|---|---|---:|---|---|---|---:|---:|---:|---:|"]
    for r in calib["rows"]:
        if r["error"] is None:
            lines.append(f"| {r['case_id']} | {r['gpus']} | {r['framework']} | | {r.get('note', '')} | | | | |")
            continue
        unit = "ms" if "per_layer" in r else "s"
        scale = 1e3 if unit == "ms" else 1.0
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else ""
        refused = " (does not fit)" if r.get("fits") is False else ""
        lines.append(f"| {r['case_id']} | {r.get('cluster', '')} | {r['gpus']} | {r['framework']} | {r['attention']} | "
                     f"{_layout(r)}{refused} | "
                     f"{r['estimate_s'] * scale:.3g} {unit} | {r['measured_s'] * scale:.3g} {unit} | "
                     f"{r['error']:+.1%} | {mfu} |")
    lines += ["", "The per-layer row sums its variants (no recompute, sequence parallel, full and selective",
              "recompute); each variant is in `benchmarks/results/calibration.json`.", ""]
    lines += _wider_checks()
    lines += _beyond_decoders()
    lines += _ablation()
    return "\n".join(lines) + "\n"


#: The terms ``term_ablation.py`` switches off, in column order (its ``TERMS``; not imported: it imports torch).
ABLATED = ("power", "interference", "host", "kernel_latency", "gemm_store", "metrics")


def _ablation() -> list[str]:
    """What each term of the cost model moves, from ``results/term_ablation.json`` (``term_ablation.py``)."""
    path = RESULTS / "term_ablation.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    lines = ["## What each term moves", "",
             "Written by `python benchmarks/term_ablation.py`: every table's median signed error per GPU with the full",
             "model, and with one term switched off (`power`: no power cap; `interference`: collectives take no SMs",
             "or HBM bandwidth from the compute beside them; `host`: launches cost the host nothing;",
             "`kernel_latency`: a product kernel has no fixed time; `gemm_store`: products store their results",
             "beside their main loop on every GPU, Ampere's included; `metrics`: the training loop computes no",
             "metric over the logits, as llm-foundry's Composer does twice per micro-batch).", "",
             "| table | GPU | full model | " + " | ".join(f"{t.replace('_', ' ')} off" for t in ABLATED) + " |",
             "|---|---|---:|" + "---:|" * len(ABLATED)]
    for stem, variants in data.items():
        full = variants["full model"]
        for group, value in full.items():
            cells = [f"{variants[t].get(group, float('nan')):+.1%}" if t in variants else "" for t in ABLATED]
            lines.append(f"| {stem} | {group} | {value:+.1%} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _wider_checks() -> list[str]:
    """Per-cluster summaries of the wider published tables whose results exist."""
    lines: list[str] = []
    for stem, what, command in WIDER:
        path = RESULTS / f"{stem}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())["rows"]
        lines += [f"## Wider check: {what}", "", f"Written by `{command}`; none of these rows set a number of the",
                  "cost model.", ""]
        lines += _by_gpu(rows)
        lines += _generations(rows)
    return lines


#: A wider row's case id: (what ran, GPUs, GPU type, precision), e.g. ``mbridge2606_llama31_405b_256_gb200_fp8``.
_CASE = re.compile(r"^(?P<what>.+)_(?P<gpus>\d+)_(?P<gpu>[a-z0-9]+)_(?P<precision>bf16|fp8)$")


def _generations(rows: list[dict[str, Any]]) -> list[str]:
    """What one GPU type does per GPU over another, measured and estimated, where a table ran the same model and
    global batch on both (case ids alike but for the GPUs): the ratio capacity planning across GPU types rests on."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if (m := _CASE.match(r["case_id"])) and r.get("error") is not None:
            groups.setdefault((m["what"], m["precision"]), []).append(r)
    lines = []
    for (what, precision), group in sorted(groups.items()):
        if len({r["cluster"] for r in group}) < 2:
            continue
        base, *others = sorted(group, key=lambda r: r["measured_s"] * r["gpus"], reverse=True)  # slowest per GPU
        for r in others:
            measured = base["measured_s"] * base["gpus"] / (r["measured_s"] * r["gpus"])
            estimated = base["estimate_s"] * base["gpus"] / (r["estimate_s"] * r["gpus"])
            lines.append(f"- {what} ({precision}): {r['cluster']} over {base['cluster']}, per GPU: measured "
                         f"{measured:.2f}x, estimated {estimated:.2f}x ({estimated / measured - 1:+.1%}).")
    return [*lines, ""] if lines else []


def _beyond_decoders() -> list[str]:
    """Every row of the published runs of other model kinds, with its source's own words in the reference file."""
    stem, what, command = BEYOND_DECODERS
    path = RESULTS / f"{stem}.json"
    if not path.exists():
        return []
    lines = [f"## Beyond decoders: {what}", "", f"Written by `{command}`; the sources and what they leave unstated "
             f"are in `benchmarks/reference/{stem}.json`. None of these rows set a number of the cost model.", "",
             "| run | GPU | GPUs | layout | estimate | measured | error | MFU (est.) |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in json.loads(path.read_text())["rows"]:
        error = f"{r['error']:+.1%}" if r["error"] is not None else "refused"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        lines.append(f"| {r['case_id']} | {r.get('cluster')} | {r['gpus']} | {_layout(r)} | "
                     f"{_seconds(r.get('estimate_s'))} | {_seconds(r.get('measured_s'))} | {error} | {mfu} |")
    lines += ["", *textwrap.wrap(
        "The DiT run trained under `torch.autocast` on fp32 weights: LayerNorm and softmax write fp32 outputs there, "
        "and every product casts its weight again, recomputation included. The estimate does not price that; it "
        "prices FSDP2's bf16 weights, cast once. The run's A100 variant (SXM, or the 300 W PCIe card) and its "
        "attention kernel (timm's, fused or not by version) are not stated either.", 110), ""]
    return lines


def _seconds(value: float | None) -> str:
    return f"{value:.3g} s" if value is not None else ""


def _by_gpu(rows: list[dict[str, Any]]) -> list[str]:
    """One line per GPU (and training precision, compiled or not): errors' medians, rows within 10 %, beyond 20 %,
    too slow."""
    lines = ["| GPU | precision | runs | median signed error | median abs. error | within 10 % | beyond 20 % | "
             "too slow | refused |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        precision = (r.get("precision") or "bf16") + (", compiled" if r.get("compile") else "")
        groups.setdefault((r.get("cluster") or "?", precision), []).append(r)
    for (cluster, precision), group in sorted(groups.items()):
        errors = [r["error"] for r in group if r["error"] is not None]
        refused = sum(r["error"] is None or r.get("fits") is False for r in group)
        absolute = [abs(e) for e in errors]
        signed, median = (f"{statistics.median(errors):+.1%}", f"{statistics.median(absolute):.1%}") if errors \
            else ("", "")
        lines.append(f"| {cluster} | {precision} | {len(group)} | {signed} | {median} | "
                     f"{sum(e <= 0.1 for e in absolute)} | {sum(e > 0.2 for e in absolute)} | "
                     f"{sum(e > 0 for e in errors)} | {refused} |")
    return [*lines, ""]


def accuracy_by_cluster(tables: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Every published row's error pooled per cluster preset and training precision: what ``autopar sweep`` says
    of each GPU type's figures (``autopar/accuracy.json``).  ``tables``: results file stem -> its rows."""
    groups: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for stem, rows in tables.items():
        for r in rows:
            if r.get("error") is not None and r.get("cluster") and "per_layer" not in r:
                groups.setdefault((r["cluster"], r.get("precision") or "bf16"), []).append((stem, r["error"]))
    out: dict[str, dict[str, Any]] = {}
    for (cluster, precision), found in sorted(groups.items()):
        errors = [e for _, e in found]
        out.setdefault(cluster, {})[precision] = {
            "runs": len(errors), "median_abs_error": statistics.median(abs(e) for e in errors),
            "median_signed_error": statistics.median(errors), "tables": sorted({stem for stem, _ in found})}
    return {"generated_by": "python benchmarks/accuracy_report.py", "clusters": out}


def main() -> None:
    calib, ranking = _load("calibration"), _load("ranking")
    DOCS.mkdir(exist_ok=True)
    (DOCS / "accuracy.md").write_text(render(calib, ranking))
    tables = {"calibration": calib["rows"]}
    tables.update({stem: json.loads((RESULTS / f"{stem}.json").read_text())["rows"] for stem, _, _ in WIDER
                   if (RESULTS / f"{stem}.json").exists()})
    ACCURACY_JSON.write_text(json.dumps(accuracy_by_cluster(tables), indent=2, sort_keys=True) + "\n")
    try:
        _scatter(calib, ranking, DOCS / "accuracy.png")
    except ModuleNotFoundError:
        print(f"wrote {DOCS / 'accuracy.md'}; {DOCS / 'accuracy.png'} not redrawn: it needs matplotlib, the bench "
              "extra (pip install -c constraints.txt -e '.[bench]')")
        return
    print(f"wrote {DOCS / 'accuracy.md'} and {DOCS / 'accuracy.png'}")


if __name__ == "__main__":
    main()
