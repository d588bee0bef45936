"""Turn llm-foundry's published MPT benchmark tables into reference rows (a wider check than the 19 rows).

MosaicML's ``scripts/train/benchmarking/README.md`` tabulates ~200 measured MPT training runs (125M-70B
parameters, sequences of 512-65,536 tokens, 8-512 A100 or H100 GPUs, FSDP).  This script reads that file
and writes its bf16 rows in the schema of ``reference/calibration.json``, so that

    python benchmarks/calibration.py --references benchmarks/reference/llm_foundry_tables.json \\
        --output benchmarks/results/llm_foundry_tables.json

estimates every one of them with its published layout pinned.  The rows are a check, never a fit: no number
of the cost model is derived from them.  The FP8 rows are left out (Composer's ``amp_fp8`` runs Transformer
Engine, which the llm-foundry preset does not model).

    python benchmarks/import_llm_foundry.py PATH/TO/llm-foundry/scripts/train/benchmarking/README.md [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "reference" / "llm_foundry_tables.json"

#: MPT sizes -> (layers, d_model, heads), from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml.  The
#: tables' NumParams column confirms them: it is 12 L d^2 + vocab x d + seq x d (learned positions) plus the
#: biases and LayerNorms, e.g. 1,315,950,592 for 1b at 2,048 tokens.
DIMS = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
        "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64),
        "70b": (80, 8192, 64)}
VOCAB = 50368  # MPT's padded GPT-NeoX vocabulary (mpt-*.yaml: vocab_size 50368)
GPUS = {"h100_80gb": "H100-SXM5-80GB", "a100_80gb": "A100-SXM4-80GB", "a100_40gb": "A100-SXM4-40GB"}


def table_rows(markdown: str) -> list[tuple[str, list[str]]]:
    """(section title, cells) of every table row naming an MPT size."""
    section, rows = "", []
    for line in markdown.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 20 and cells[0] in DIMS:
            rows.append((section, cells))
    return rows


def case_of(section: str, cells: list[str], commit: str) -> dict[str, Any]:
    """One table row as a reference case (columns: Model, SeqLen, #GPUs, GPU, MFU, HFU, Model TFLOP,
    MicroBatchSize, GradAccum, GlobalBatchSize, S/s, T/s, T/s/GPU, GlobalBatchSize (T), Precision, MP Mode,
    Sharding Strategy, Activation Checkpointing, Activation CPUOffload, NumParams)."""
    name, seq, gpus, gpu = cells[0], int(cells[1]), int(cells[2]), cells[3]
    layers, hidden, heads = DIMS[name]
    mbs, accum, batch = int(cells[7]), int(cells[8]), int(cells[9])
    roce = "1600 Gbps" in section  # the A100 sections' title: "with 1600 Gbps node-node interconnect (RoCE)"
    return {
        "source": f"mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit {commit}), section '{section}'",
        "case_id": f"mpt_{name}_{seq}_{gpus}_{gpu}_{mbs}x{accum}",
        "model": {"name": f"MPT-{name}", "layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq,
                  "vocab": VOCAB, "params": int(cells[19])},
        "cluster": {"gpu": GPUS[gpu], "n_gpus": gpus, "gpus_per_node": 8,
                    "inter_node": "1600 Gbps node-node RoCE (per section title)" if roce else None,
                    "inter_node_bw": 200.0 if roce else None},
        "global_batch": batch,
        "layout": {"tp": 1, "pp": 1, "dp": gpus, "dp_type": f"FSDP {cells[16]}", "micro_batch": mbs,
                   "grad_accum": accum, "recompute": "full" if cells[17] == "True" else "none",
                   "cpu_offload": cells[18] == "True", "precision": cells[14], "mp_mode": cells[15]},
        "measured": {"mfu": float(cells[4]) / 100, "hfu": float(cells[5]) / 100,
                     "tokens_per_s_per_gpu": float(cells[12]), "iteration_time_s": None},
        "reliability": "vendor benchmark table, short 12-step runs",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("readme", type=Path, help="llm-foundry's scripts/train/benchmarking/README.md")
    ap.add_argument("--commit", default="unknown", help="the llm-foundry commit the README was read at")
    ap.add_argument("--output", type=Path, default=OUT)
    args = ap.parse_args()
    cases = [case_of(section, cells, args.commit) for section, cells in table_rows(args.readme.read_text())
             if "fp8" not in cells[14].lower()]
    about = ("MosaicML llm-foundry's published MPT training benchmarks (scripts/train/benchmarking/README.md), bf16 "
             "rows; written by benchmarks/import_llm_foundry.py. A wider check of the cost model, not a fit.")
    args.output.write_text(json.dumps({"about": about, "cases": cases}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(cases)} rows to {args.output}")


if __name__ == "__main__":
    main()
