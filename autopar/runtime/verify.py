"""``autopar verify``: run a plan locally (CPU, gloo, torch's launcher) and compare with one process."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from autopar.errors import AutoparError
from autopar.frontend import trace_model
from autopar.plan_file import Plan
from autopar.runtime.launch import run_killing_the_group
from autopar.runtime.session import reference_run
from autopar.runtime.support import check_runnable, model_on_meta
from autopar.runtime.training import check_config

log = logging.getLogger(__name__)

MAX_LOCAL_RANKS = 8


@dataclass(frozen=True, slots=True)
class VerifyResult:
    losses: list[float]
    reference_losses: list[float]
    loss_rel_diff: float
    grad_rel_diff: float
    param_rel_diff: float
    tolerance: float
    placements: dict[str, dict[str, str]]
    """How the distributed run held each DTensor parameter: placement per mesh axis (``S(k)``, ``R``)."""
    dropout_off: int = 0
    """Dropouts the model has on, which both sides ran without (they would draw different masks)."""
    activations: dict[int, tuple[int | None, float]] = field(default_factory=dict)
    """With ``memory``: per pipeline stage, the activation bytes its first rank measured in the last step
    (``None`` where torch's tracker cannot follow the stage) and the plan's ``estimated_activation_bytes``."""
    compiled: dict[str, int] = field(default_factory=dict)
    """With ``compile``: what the first rank compiled, ``graphs`` (forward-backward graphs Inductor built) and
    ``breaks`` (graph breaks: code Dynamo left to run eagerly between them)."""

    @property
    def sharded_parameters(self) -> bool:
        """Whether the distributed run held its parameters as DTensors (FSDP / tensor parallel)."""
        return bool(self.placements)

    @property
    def ok(self) -> bool:
        return max(self.loss_rel_diff, self.grad_rel_diff, self.param_rel_diff) <= self.tolerance


#: Tensors that are zero in exact arithmetic (the gradient of a key bias: softmax ignores a constant
#: shift, about 1e-11 here) are compared against this fraction of the largest magnitude in their group
#: (gradients, or parameters) instead of their own: a tensor 1000x smaller than the largest is judged
#: by the absolute error that a 1e-4 relative tolerance allows on 0.1 % of the scale.
ZERO_FLOOR = {"fp32": 1e-3, "bf16": 1.0}
"""By ``--numerics``.  Under bf16 every tensor is judged against the largest magnitude of its group: the sign
of a gradient near zero is a matter of rounding order there, and AdamW moves such a weight by ``lr`` either
way, so a per-tensor relative difference means nothing for near-zero tensors (biases that start at zero)."""


#: Under ``--numerics fp32``, when the fp32 reference alone judges a run too far, the reference runs again in
#: float64, and each tensor is judged against the magnitude at which the tolerance allows this many times the
#: fp32 reference's own rounding error (its distance from the float64 run), when that is larger than its own.
#: A sum whose terms cancel is only as exact as fp32 makes it: a contrastive loss's gradients sum to nearly
#: zero over the batch, and one process computed a LayerNorm bias gradient of CLIP-like towers 1.5e-4
#: (relative) away from float64, while dp2 was 1.8e-4 away.  A layout's different reduction order lands
#: within about twice the reference's error; a bug lands far outside.
ROUNDING_MULTIPLE = 8.0


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12, exact: torch.Tensor | None = None,
         tolerance: float = 1.0) -> float:
    """Largest absolute difference over the reference's largest magnitude (or ``floor``, or the magnitude at
    which ``tolerance`` allows ``ROUNDING_MULTIPLE`` times the reference's distance from ``exact``)."""
    if not b.numel():
        return 0.0
    scale = max(float(b.abs().max()), floor)
    if exact is not None:
        scale = max(scale, ROUNDING_MULTIPLE * float((b.double() - exact.double()).abs().max()) / tolerance)
    return float((a.double() - b.double()).abs().max()) / scale


def _max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], floor: float,
             exact: dict[str, torch.Tensor] | None = None, tolerance: float = 1.0) -> float:
    missing = sorted(set(want) - set(got))
    if missing:
        raise AutoparError(f"the distributed run lost parameter {missing[0]}")
    biggest = max((float(t.abs().max()) for t in want.values() if t.numel()), default=0.0)
    return max((_rel(got[k], want[k], floor * biggest, None if exact is None else exact.get(k), tolerance)
                for k in want), default=0.0)


def _compare(got: dict, want: dict, exact: dict | None, floor: float, tolerance: float) -> VerifyResult:
    """The distributed run ``got`` against the fp32 reference ``want`` (and, given, its float64 run)."""
    losses = torch.tensor(got["losses"], dtype=torch.float64)
    ref = torch.tensor(want["losses"], dtype=torch.float64)
    exact_losses = None if exact is None else torch.tensor(exact["losses"], dtype=torch.float64)
    return VerifyResult(got["losses"], want["losses"], _rel(losses, ref, 1e-12, exact_losses, tolerance),
                        _max_rel(got["grads"], want["grads"], floor, None if exact is None else exact["grads"],
                                 tolerance),
                        _max_rel(got["params"], want["params"], floor, None if exact is None else exact["params"],
                                 tolerance),
                        tolerance, got["placements"], want["dropout_off"])


def _exact_reference(plan: Plan, steps: int, seed: int, lr: float, numerics: str) -> dict[str, object] | None:
    """The fp32 check's reference run again in float64 (``ROUNDING_MULTIPLE``); ``None`` under bf16, or for a
    model that does not run in float64."""
    if numerics != "fp32":
        return None
    try:
        return reference_run(plan, steps, seed, check_config(numerics, lr), dtype=torch.float64)
    except Exception as exc:  # any op without a float64 kernel: judge by the fp32 reference alone
        log.warning("the float64 reference run failed (%s: %s); judging by fp32 alone", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return None


#: A rank's exception as torchrun relays it (``[rank1]: RuntimeError: ...``, or with its module path:
#: ``torch.utils.checkpoint.CheckpointError: ...``): the root cause to report.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]: )?((?:\w+\.)*\w+(?:Error|Exception): .*)$")


def root_cause(stderr: str) -> str:
    """The line of a failed launch's ``stderr`` that says why: autopar's own error, else the first exception a rank
    raised, else the last line with words in it (not torchrun's closing rule of ``=`` signs)."""
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("autopar: error")]
    raised = [m.group(1) for line in lines if (m := _EXCEPTION_LINE.search(line))]
    worded = [line.strip() for line in lines if re.search(r"[A-Za-z]", line)]
    return (errors or raised or worded[-1:] or ["no output"])[0]


def run_plans(plan_paths: Sequence[str | Path], steps: int, *, seed: int = 0, lr: float = 0.1, start_step: int = 0,
              resume: str | Path | None = None, checkpoint: str | Path | None = None, numerics: str = "fp32",
              memory: bool = False, timeout_s: float = 600, compile: bool = False) -> list[dict]:
    """Launch the plans (all of one world size) in turn on local CPU ranks, with one launch of torch's
    launcher; per plan, the losses and every stage's grads and params (and, with ``memory``, every
    stage's measured activation peak of the last step).  ``compile``: each block runs ``torch.compile``d
    (Inductor's CPU backend); otherwise eagerly, whatever the plan says.  ``resume`` and ``checkpoint``: a
    checkpoint folder, of each plan's own checkpoints (``FOLDER/i``) when there are several."""
    sizes = {Plan.load(path).num_devices for path in plan_paths}
    if len(sizes) != 1:
        raise AutoparError(f"plans run in one launch need one world size; these have {sorted(sizes)}")
    n = sizes.pop()
    if n > MAX_LOCAL_RANKS:
        raise AutoparError(f"verify runs plans of at most {MAX_LOCAL_RANKS} ranks locally; this one has {n}")
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               "-m", "autopar.runtime.worker", str(out), *map(str, plan_paths), "--steps", str(steps),
               "--seed", str(seed), "--lr", str(lr), "--start-step", str(start_step), "--numerics", numerics]
        cmd += ["--resume", str(resume)] if resume else []
        cmd += ["--checkpoint", str(checkpoint)] if checkpoint else []
        cmd += ["--memory"] if memory else []
        cmd += ["--compile"] if compile else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPAR_DEVICE": "cpu"}
        limit_s = timeout_s * len(plan_paths)
        try:
            proc = run_killing_the_group(cmd, env=env, timeout_s=limit_s)
        except subprocess.TimeoutExpired:
            raise AutoparError(f"the distributed run took more than {limit_s:g} s: stopped its ranks") from None
        done = all((out / str(i) / "rank0.pt").exists() for i in range(len(plan_paths)))
        if proc.returncode != 0 or not done:
            raise AutoparError(f"the distributed run failed: {root_cause(proc.stderr)}")
        return [_merge(out / str(i)) for i in range(len(plan_paths))]


def _activations(plan: Plan, ran: dict) -> dict[int, tuple[int | None, float]]:
    measured = ran.get("activation_peak", {})
    return {s["index"]: (measured.get(s["index"]), float(s["estimated_activation_bytes"])) for s in plan.stages}


def run_plan(plan_path: str | Path, steps: int, **options) -> dict:
    """``run_plans`` for one plan (``options``: its keywords)."""
    return run_plans([plan_path], steps, **options)[0]


def _merge(folder: Path) -> dict:
    """Rank 0's file with the other pipeline stages' parameters added."""
    merged = torch.load(folder / "rank0.pt", weights_only=True)
    for path in sorted(folder.glob("rank*.pt")):
        part = torch.load(path, weights_only=True)
        for key in ("grads", "params", "placements", "activation_peak"):
            for name, value in part[key].items():
                merged[key].setdefault(name, value)
    return merged


#: Largest relative difference ``autopar verify`` accepts, by ``--numerics``.  fp32 with SGD agrees to
#: rounding (reduction order only).  bf16 rounds every product to 8 mantissa bits (2^-8 = 0.4 %), in an
#: order that depends on the layout, and AdamW turns tiny gradient differences into updates of full size
#: ``lr``: about 1 % after a few steps (judged against the scale of all weights, ``ZERO_FLOOR``).
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
#: Learning rate of the check, by ``--numerics``: SGD's is large enough to move every weight; AdamW's small
#: enough that a flipped sign of a near-zero gradient stays within the tolerance.
CHECK_LR = {"fp32": 0.1, "bf16": 1e-4}


def inductor_cpu_missing() -> str | None:
    """Why Inductor cannot compile for the CPU here (``None``: it can): its C++ backend needs a compiler."""
    import shutil

    from torch._inductor import cpp_builder

    try:
        cxx = cpp_builder.get_cpp_compiler()
    except Exception as exc:  # torch raises its own errors (RuntimeError, InvalidCxxCompiler, ...)
        return f"Inductor finds no C++ compiler ({str(exc).splitlines()[0]})"
    if shutil.which(cxx) is None and not Path(cxx).is_file():
        return f"Inductor's C++ compiler {cxx!r} is not installed"
    return None


def verify(plan_path: str | Path, steps: int = 3, seed: int = 0, lr: float | None = None,
           tolerance: float | None = None, numerics: str = "fp32", memory: bool = False,
           timeout_s: float = 600, compile: bool = False) -> VerifyResult:
    """Run the plan on local ranks and one process; compare losses, gradients and parameters (and, with
    ``memory``, measure the activation memory the plan estimates; with ``compile``, run the blocks
    ``torch.compile``d on the ranks)."""
    return verify_many([plan_path], steps, seed, lr, tolerance, numerics, memory, timeout_s, compile)[0]


def verify_many(plan_paths: Sequence[str | Path], steps: int = 3, seed: int = 0, lr: float | None = None,
                tolerance: float | None = None, numerics: str = "fp32", memory: bool = False,
                timeout_s: float = 600, compile: bool = False) -> list[VerifyResult]:
    """``verify`` for several plans, with one launch per world size; every plan is checked before any runs."""
    if compile and (why := inductor_cpu_missing()) is not None:
        raise AutoparError(f"verify --compile compiles the blocks on the CPU ranks, and {why}: verify without "
                           "--compile, or install a C++ compiler (g++ or clang++)")
    plans = [Plan.load(path) for path in plan_paths]
    traces: dict[tuple[str, str, int], object] = {}  # plans of one model share its trace (seconds each)
    for path, plan in zip(plan_paths, plans):
        if plan.fp8:  # verify runs on CPU ranks, which have no FP8 products
            raise AutoparError(f"{path}: this plan trains in FP8 (precision fp8) and verify runs on CPU, which has "
                               "no FP8 products: plan the layout with --precision bf16 to verify it")
        ref = plan.model.get("path") or plan.model["ref"]
        key = (ref, json.dumps(plan.model["config"], sort_keys=True), plan.seq_len)
        try:
            if key not in traces:
                traces[key] = trace_model(ref, dict(plan.model["config"]), plan.seq_len,
                                          example_inputs=plan.model.get("example_inputs"))
            traced = traces[key]
            # the plan's own config: tracing at the plan's sequence length adds it to a config that left it to
            # the model's default, and the graph already says whether the two build the same model
            plan.check_model(traced.graph, dict(plan.model["config"]))
            check_runnable(plan, model_on_meta(plan), compiled=compile)
        except AutoparError as exc:
            raise AutoparError(f"{path}: {exc}" if len(plans) > 1 else str(exc)) from None
    lr = CHECK_LR[numerics] if lr is None else lr
    tolerance = TOLERANCE[numerics] if tolerance is None else tolerance
    got: dict[int, dict] = {}
    for n in sorted({plan.num_devices for plan in plans}):
        group = [i for i, plan in enumerate(plans) if plan.num_devices == n]
        ran = run_plans([plan_paths[i] for i in group], steps, seed=seed, lr=lr, numerics=numerics,
                        memory=memory, timeout_s=timeout_s, compile=compile)
        got.update(zip(group, ran))
    floor = ZERO_FLOOR[numerics]
    results = []
    for i, plan in enumerate(plans):
        trained = sorted(k for k in got[i]["grads"] if plan.parameters.get(k, {}).get("frozen"))
        if trained:
            raise AutoparError(f"{plan_paths[i]}: the distributed run computed a gradient of {trained[0]}, which the "
                               "model freezes")
        want = reference_run(plan, steps, seed, check_config(numerics, lr))
        result = _compare(got[i], want, None, floor, tolerance)
        if not result.ok and (exact := _exact_reference(plan, steps, seed, lr, numerics)) is not None:
            result = _compare(got[i], want, exact, floor, tolerance)  # only where fp32 alone judges it too far
        results.append(replace(result, activations=_activations(plan, got[i]) if memory else {},
                               compiled=got[i].get("compiled", {}) if compile else {}))
    return results
