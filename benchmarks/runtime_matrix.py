"""Benchmark: `autopar verify` over a wider matrix of models and layouts than CI has time for.

Each case plans a small model with ``--fix`` on a 4- or 8-device ``cpu`` cluster, launches it on local
CPU ranks (gloo), and compares loss, gradients and parameters with one process over 3 steps (``STEPS`` says
where fewer).  The cases
include the sixteen HuggingFace decoders of ``examples/hf_decoder.py`` (global batch 8, sequence 32) at
dp2 x tp2, pp2 x dp2 and cp2 x dp2, and a LoRA fine-tune (``examples/lora_llama.py``: a frozen base, padded batches).
Plans of one world size run in one launch (``verify_many``); a launch that fails is rerun plan by plan to tell
which.  Prints a table and writes ``benchmarks/results/runtime_matrix.json`` (with ``--only``, the other cases
keep the results it held).

    python benchmarks/runtime_matrix.py [--only SUBSTRING[,SUBSTRING...]]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar import modelfile
from autopar.cli import main as cli
from autopar.errors import AutoparError
from autopar.runtime.verify import VerifyResult, verify, verify_many

ROOT = Path(__file__).resolve().parents[1]
GPT = "layers=4,hidden=256,heads=8,vocab=256,seq_len=16"
WIDE = "layers=2,hidden=512,heads=8,vocab=256,seq_len=16"
LLAMA = "layers=4,hidden=512,heads=8,kv_heads=4,vocab=256,seq_len=32"
MOE = "layers=4,hidden=128,heads=4,vocab=256,seq_len=16,experts=4"
HF_LLAMA = "layers=4,hidden=512,heads=8,ffn=1024,vocab=256,seq_len=16"
HF_GPT2 = "layers=4,hidden=512,heads=8,vocab=256,seq_len=16"
LORA = "layers=4,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=256,seq_len=32,rank=8"

CASES = [
    # name, model, config, --fix, devices
    ("gpt zero1", "gpt", GPT, "dp=4,zero=1", 4),
    ("gpt zero2 x2 micro-batches", "gpt", GPT, "dp=4,zero=2,mbs=1", 4),
    ("gpt tp4 sp", "gpt", WIDE, "tp=4,sp=on", 4),
    ("gpt pp2 interleaved x tp2 sp", "gpt", GPT, "pp=2,tp=2,sp=on,schedule=interleaved,v=2", 4),
    ("gpt pp2 x dp2 x tp2 zero3", "gpt", GPT, "pp=2,dp=2,tp=2,sp=off,zero=3", 8),
    ("llama (GQA) tp4 sp", "llama", LLAMA, "tp=4,sp=on", 4),
    ("llama pp2 x tp2 full recompute", "llama", LLAMA, "pp=2,tp=2,sp=off,recompute=full", 4),
    ("moe pp2 x tp2", "moe", MOE, "pp=2,tp=2,sp=off", 4),
    ("moe dp2 x tp2 selective", "moe", MOE, "dp=2,tp=2,sp=on,recompute=selective", 4),
    ("hf llama tp4 sp zero0", str(ROOT / "examples/hf_llama.py"), HF_LLAMA, "tp=4,sp=on", 4),
    ("hf llama pp4 1f1b", str(ROOT / "examples/hf_llama.py"), HF_LLAMA, "pp=4,schedule=1f1b", 4),
    ("hf gpt2 dp2 x tp2 (Conv1D)", str(ROOT / "examples/hf_gpt2.py"), HF_GPT2, "dp=2,tp=2,sp=off", 4),
    ("lora llama dp2 x tp2 zero3 (frozen base, padded)", str(ROOT / "examples/lora_llama.py"), LORA,
     "dp=2,tp=2,zero=3", 4),
    ("lora llama pp2 x dp2 interleaved_zb v2", str(ROOT / "examples/lora_llama.py"), LORA,
     "pp=2,dp=2,schedule=interleaved_zb,v=2", 4),
]
HF_MODELS = ROOT / "examples" / "hf_models.py"
# beyond decoders: encoders, encoder-decoders, vision, speech, contrastive and state-space models; a layout the
# runtime cannot run is refused in one line, which the table shows
CASES += [(f"hf {arch} {name}", str(HF_MODELS), f"arch={arch},seq_len=32", fix, 4)
          for arch in modelfile.load_module(str(HF_MODELS)).ARCHS
          for name, fix in (("dp2 x tp2", "dp=2,tp=2"), ("pp2 x dp2", "pp=2,dp=2"))]
# the zoo's diffusion transformer: adaLN-Zero blocks split on tp, the conditioning carried across pipeline stages
DIT = "layers=2,hidden=256,heads=4,image=8,classes=10"
CASES += [(f"dit {name}", str(ROOT / "models" / "dit.py"), DIT, fix, 4)
          for name, fix in (("dp2 x tp2", "dp=2,tp=2"), ("pp2 x dp2", "pp=2,dp=2"))]
#: Steps of a case other than 3: T5 under SGD at verify's rate diverges within three steps (its losses grow tenfold,
#: one process too), and rounding then decides a comparison of its pipeline's weights; one step checks the whole
#: forward and backward, the position bias's gradient sent back over the cut included.
STEPS = {"hf t5 pp2 x dp2": 1}
HF_DECODER = ROOT / "examples" / "hf_decoder.py"
CASES += [(f"hf {arch} {name}", str(HF_DECODER), f"arch={arch},layers=4,hidden=64,heads=4,vocab=128,seq_len=32", fix, 4)
          for arch in modelfile.load_module(str(HF_DECODER)).ARCHS
          for name, fix in (("dp2 x tp2", "dp=2,tp=2"), ("pp2 x dp2", "pp=2,dp=2"), ("cp2 x dp2", "cp=2,dp=2"))]


def plan_case(model: str, config: str, fix: str, devices: int, workdir: Path) -> tuple[dict | None, str]:
    """Plan one case into ``workdir``: its plan, or ``None`` and the planner's one-line error (a layout the
    runtime cannot run is refused so, with its reason)."""
    argv = ["plan", model, "--config", config, "--cluster", "cpu", "--gpus", str(devices), "--global-batch", "8",
            "--fix", fix, "-o", str(workdir)]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):  # the summary is not reported
        code = cli(argv)
    if code == 0:
        return json.loads((workdir / "plan.json").read_text()), ""
    errors = [line for line in err.getvalue().splitlines() if line.startswith("autopar: error: ")]
    return None, errors[-1].removeprefix("autopar: error: ") if errors else "planning failed"


def report(plan: dict, res: VerifyResult) -> dict:
    return {"ok": res.ok, "layout": plan["layout"], "loss_rel_diff": res.loss_rel_diff,
            "grad_rel_diff": res.grad_rel_diff, "param_rel_diff": res.param_rel_diff, "dropout_off": res.dropout_off,
            "sharded_on_tp": sorted({k for k, v in res.placements.items() if v.get("tp", "R") != "R"})[:3]}


def verify_all(plans: dict[str, tuple[dict, Path]]) -> dict[str, dict]:
    """Verify the planned cases, one launch per world size and step count; a failing launch is rerun plan by
    plan."""
    out: dict[str, dict] = {}
    for devices, steps in sorted({(_devices(plan), STEPS.get(n, 3)) for n, (plan, _) in plans.items()}):
        names = [n for n, (plan, _) in plans.items() if (_devices(plan), STEPS.get(n, 3)) == (devices, steps)]
        try:
            results = verify_many([plans[n][1] for n in names], steps=steps)
            out.update({n: report(plans[n][0], r) for n, r in zip(names, results)})
            continue
        except AutoparError:
            pass
        for n in names:
            try:
                out[n] = report(plans[n][0], verify(plans[n][1], steps=steps))
            except AutoparError as exc:
                out[n] = {"ok": False, "error": str(exc), "layout": plans[n][0]["layout"]}
    return out


def _devices(plan: dict) -> int:
    p, d, c, t = plan["mesh"]["shape"]
    return p * d * c * t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this (or any of A,B,...)")
    args = ap.parse_args()
    wanted = args.only.split(",") if args.only else []
    cases = [c for c in CASES if not wanted or any(w in c[0] for w in wanted)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plans, rows = {}, {}
        for i, (name, model, config, fix, devices) in enumerate(cases):
            workdir = Path(tmp) / str(i)
            plan, error = plan_case(model, config, fix, devices, workdir)
            if plan is None:
                refused = "autopar's runtime can run" in error  # the planner's one line: this layout cannot run
                rows[name] = {"ok": False, "refused": error} if refused else {"ok": False, "error": error}
            else:
                plans[name] = (plan, workdir / "plan.json")
        rows.update(verify_all(plans))
    rows = [{"case": name, "fix": fix, "steps": STEPS.get(name, 3), **rows[name]} for name, _, _, fix, _ in cases]
    table = Table(title=f"autopar verify matrix (3 steps unless said, tolerance 1e-4; "
                        f"{time.perf_counter() - t0:.0f} s)")
    for col in ("case", "ok", "loss", "grads", "params", "dropout off"):
        table.add_column(col)
    for r in rows:
        diffs = [f"{r[k]:.1e}" if k in r else "-" for k in ("loss_rel_diff", "grad_rel_diff", "param_rel_diff")]
        status = "OK" if r["ok"] else f"refused: {r['refused']}" if "refused" in r else f"FAIL {r.get('error', '')}"
        steps = f" ({r['steps']} step{'s' if r['steps'] > 1 else ''})" if r["steps"] != 3 else ""
        table.add_row(r["case"] + steps, status, *diffs, str(r.get("dropout_off", "-")))
    Console().print(table)
    out = ROOT / "benchmarks" / "results" / "runtime_matrix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if wanted and out.exists():  # --only: the other cases keep their last results
        ran = {r["case"]: r for r in rows}
        kept = {r["case"]: r for r in json.loads(out.read_text())}
        rows = [ran.get(name) or kept[name] for name, *_ in CASES if name in ran or name in kept]
    out.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
