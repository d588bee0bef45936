"""Published training runs (``benchmarks/reference/``) as planner inputs: model, cluster, framework, layout.

Each row of ``calibration.json`` (and each run of a sweep in ``sweeps.json``) names its model, cluster,
global batch, parallel layout and what was measured.  This module turns a row into what ``autopar plan``
takes, from the row's own published facts only:

- **model**: Llama rows use the zoo's ``llama`` (RMSNorm, RoPE, SwiGLU, GQA; RoPE in fp32 and RMSNorm fused or
  in fp32 as torchtitan's configs ran them); every other row the zoo's
  ``gpt`` (learned positions, LayerNorm, GeLU, biases, tied embeddings: GPT-2/3 and MPT, whose benchmark
  configs keep learned positions and biases).  Rows that ran Megatron-LM's 2021-22 argument defaults keep
  its dropout of 0.1 (``--attention-dropout`` and ``--hidden-dropout`` default to 0.1 and the published
  scripts do not set them).
- **cluster**: the preset of the row's GPU, with its GPU count and, when the row gives it, its NIC rate.
- **framework**: the software that ran it (``autopar/frameworks/``), which decides what overlaps and how
  data-parallel collectives are issued; the attention kernel follows the row's era (``README.md``).
- **layout**: every published knob is pinned with ``--fix``; a knob the source does not publish (a ``null``
  micro-batch, recompute or schedule) is left to the search, as the run's engineers tuned it.
- **measured**: ``measured.iteration_time_s`` or ``derived.iteration_time_s``, else global batch x sequence
  over the published tokens per second.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.passes import PassContext
from autopar.passes.context import PrecisionPolicy

from autopar.cluster import Cluster, load_cluster
from autopar.errors import AutoparError
from autopar.framework import load_framework
from autopar.inter_op.techniques import normalize_fix

HERE = Path(__file__).resolve().parent
REFERENCE_DIR = HERE / "reference"
CALIBRATION = REFERENCE_DIR / "calibration.json"
SWEEPS = REFERENCE_DIR / "sweeps.json"

#: Megatron-LM's 2021-22 defaults for --attention-dropout and --hidden-dropout (megatron/arguments.py).
MEGATRON_2021_DROPOUT = 0.1


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """One published measurement, ready to plan."""

    case_id: str
    source: str
    model_ref: str
    config: dict[str, Any]
    cluster: Cluster
    framework: str
    framework_overrides: dict[str, Any]
    """Framework settings the row publishes (``--DDP-impl torch``, FSDP mixed precision ``PURE``)."""
    attention: str
    global_batch: int
    fixed: dict[str, Any]
    measured_s: float | None
    searched: tuple[str, ...] = ()
    """Layout knobs the source does not publish, left to the search."""
    per_layer_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """For per-layer rows: measured forward/backward milliseconds of one layer per variant."""
    precision: str = "bf16"
    """What the layers' Linears trained in: ``bf16`` or ``fp8``."""
    compile: bool = False
    """Whether the run ``torch.compile``d its blocks (``compile_of``)."""

    def context(self) -> PassContext:
        """The pass context of the row: its cluster, attention kernel, framework, training precision and whether
        its blocks ran compiled."""
        framework = load_framework(self.framework).with_overrides(**self.framework_overrides)
        return PassContext(cluster=self.cluster, attention=self.attention, framework=framework,
                           precision=PrecisionPolicy(training=self.precision), compile=framework.compiles(self.compile))

    @property
    def model_key(self) -> tuple:
        """Rows with the same key share one trace."""
        return (self.model_ref, tuple(sorted(self.config.items())), self.attention)


def load_calibration(path: Path = CALIBRATION) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["cases"]


def load_sweeps(path: Path = SWEEPS) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text())["sweeps"]


# ------------------------------------------------------------------------------------------------------
# model, cluster, framework


def _lower(*parts: Any) -> str:
    return " ".join(str(p) for p in parts if p).lower()


def framework_of(case: dict[str, Any]) -> str:
    """The software stack that ran the row, from its source and layout text."""
    lay = case.get("layout", {})
    case_id = _lower(case.get("case_id"))
    if "ptd-p" in case_id:
        return "megatron-lm"  # Narayanan et al.'s own PTD-P rows (their Table 2 compares it with ZeRO-3)
    text = _lower(case.get("source"), lay.get("framework"), lay.get("dp_type"), case.get("case_id"))
    if "torchtitan" in text:  # before Llama 3's own stack: torchtitan's benchmarks train Llama 3 models
        return "torchtitan"
    if "llama 3" in text or "llama team" in text:
        return "llama3"  # Meta's PyTorch-native FSDP + TP + PP stack with its own pipeline schedule (sec. 3.3.2)
    if "hagemann" in text or "aleph alpha" in text:
        return "aa-scaling"  # Hagemann et al. 2023 measured their sweeps on Aleph Alpha's Scaling codebase
    if "llm-foundry" in text or "mosaicml" in text:
        return "llm-foundry"
    if "nemo" in text or "dgx cloud" in text or "megatron-bridge" in text:
        return "nemo"  # NVIDIA's recipes on Megatron-Core + Transformer Engine
    if "zero-3" in case_id or "deepspeed" in text or "mt-nlg" in text:
        return "deepspeed"
    if "megatron-core" in text or "megatron-lm readme" in text or "nvidia/megatron-lm readme" in text:
        return "megatron-core"
    if "megatron" in text or "narayanan" in text or "korthikanti" in text or "megascale" in text:
        return "megatron-lm"
    return "torch"


def framework_overrides_of(case: dict[str, Any]) -> dict[str, Any]:
    """Settings of the framework the row states explicitly."""
    lay = case.get("layout", {})
    out: dict[str, Any] = {}
    if str(lay.get("ddp_impl", "")).lower() == "torch":
        out["overlap_grad_reduce"] = True  # PyTorch DDP's bucketed all-reduce from autograd hooks
    if str(lay.get("mp_mode", "")).upper() == "PURE":
        out["grad_reduce_bytes"] = 2  # FSDP mixed precision PURE reduces in bf16 ...
        if framework_of(case) == "llm-foundry":
            out["zero3_copy_bytes_per_param"] = 0  # ... so nothing is cast (and FSDP1 copies nothing)
    if _lower(lay.get("fp8_recipe")) == "current":
        out["fp8_scaling"] = "dynamic"  # per-tensor current scaling (TE's Float8CurrentScaling): an amax pass, a cast
    if _before_gradient_accumulation_fusion(case) and framework_of(case) == "megatron-lm":
        # the 2021 runs' DDP added each micro-batch's .grad into the main gradient (model/distributed.py)
        out["grad_accumulation_fused"] = False
    precision = _lower(lay.get("precision"))
    if "bf16" in precision and framework_of(case) == "megatron-lm":
        out["grad_reduce_bytes"] = 4  # bf16 forces fp32 gradient accumulation and all-reduce
        out["main_grad_bytes"] = 4
        out["optimizer_bytes_per_param"] = 42  # the fp32 main gradient needs no copy and no unscaling
    return out


def _before_flash_attention(case: dict[str, Any]) -> bool:
    """Rows from before FlashAttention (2022) ran unfused attention (reference README)."""
    text = _lower(case.get("source"), case.get("case_id"))
    return any(k in text for k in ("narayanan", "korthikanti", "mt-nlg", "mtnlg", "bloom"))


def attention_of(case: dict[str, Any]) -> str:
    """The row's attention kernel: unfused before FlashAttention; Megatron-Core on Hopper and Blackwell runs
    Transformer Engine's cuDNN fused attention (FlashAttention-3 class; FlashAttention-4's on Blackwell);
    llm-foundry's tables MPT's Triton kernel (FlashAttention v1 class); other rows FlashAttention-2.  A row may
    name its kernel (``layout.attention_kernel``)."""
    if case.get("layout", {}).get("attention_kernel"):
        return case["layout"]["attention_kernel"]
    if _before_flash_attention(case):
        return "math"
    if framework_of(case) in ("megatron-core", "nemo") and any(g in _lower(case["cluster"].get("gpu"))
                                                                for g in ("h100", "b200")):
        return "flash3"
    if framework_of(case) == "llm-foundry":
        # The benchmark tables (scripts/train/benchmarking/README.md, last regenerated 2023-10 and 2024-01) come
        # from submit_benchmarks.py, whose --attn_impl defaulted to 'triton' until 2024-03 (sweep.sh never sets
        # it): llmfoundry/models/layers/flash_attn_triton.py, FlashAttention in Triton (Dec 2022), whose header
        # says "Overall Triton forward + backward is slightly slower than CUDA forward + backward", the CUDA
        # FlashAttention of its day being version 1.
        return "flash1"
    return "flash"


def _before_sequence_parallelism(case: dict[str, Any]) -> bool:
    """Rows from before sequence parallelism (Korthikanti et al. 2022 introduced it): Narayanan et al. 2021."""
    return "narayanan" in _lower(case.get("source"), case.get("case_id"))


def _before_gradient_accumulation_fusion(case: dict[str, Any]) -> bool:
    """Rows from before Megatron-LM's --gradient-accumulation-fusion (commit 83b1e42f30, February 2022): Narayanan
    et al. 2021."""
    return "narayanan" in _lower(case.get("source"), case.get("case_id"))


def _megatron_2021_defaults(case: dict[str, Any]) -> bool:
    text = _lower(case.get("source"), case.get("case_id"))
    return any(k in text for k in ("narayanan", "korthikanti", "mt-nlg", "mtnlg"))


def model_of(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Zoo model and config of a row: the model file the row names (``model.file``, relative to the repository,
    with ``model.config``), else the zoo's Llama or GPT of the row's shape."""
    m = case["model"]
    if m.get("file"):
        return str(HERE.parent / m["file"]), dict(m.get("config", {}))
    if "llama" in m["name"].lower():
        cfg = {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"],
               "kv_heads": m.get("kv_heads") or m["heads"], "ffn": m["ffn"], "vocab": m["vocab"],
               "seq_len": m["seq_len"]}
        if "torchtitan" in _lower(case.get("source")):
            # torchtitan's (and Meta's reference) Llama rotates q and k on xq.float() (models/llama/model.py);
            # its train_configs of the performance.md commit (2024-04, aea510d) set norm_type fused_rmsnorm
            # (a Triton kernel) for the 7B/8B/13B models and rmsnorm (on x.float()) for the 70B ones
            cfg.update(rope="fp32", rms_norm="fp32" if m["hidden"] >= 8192 else "fused")
        if m.get("rms_norm"):  # the row names its RMSNorm ("fp32": on x.float(), op by op)
            cfg["rms_norm"] = m["rms_norm"]
        return "llama", cfg
    cfg: dict[str, Any] = {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "vocab": m["vocab"],
                           "seq_len": m["seq_len"]}
    if m.get("ffn"):
        cfg["ffn"] = m["ffn"]
    if _megatron_2021_defaults(case):
        cfg["dropout"] = MEGATRON_2021_DROPOUT
    return "gpt", cfg


def cluster_of(case: dict[str, Any]) -> Cluster:
    """The preset of the row's GPU, sized to the row."""
    c = case["cluster"]
    gpu = _lower(c.get("gpu"))
    fabric = _lower(c.get("inter_node"))
    if "h100" in gpu:
        preset = "h100-80gb-roce" if "roce" in fabric else "h100-80gb"
    elif "gb200" in gpu:
        preset = "gb200-nvl72"
    elif "b200" in gpu:
        preset = "b200"
    elif "40gb" in gpu:
        preset = "a100-40gb"
    else:
        preset = "a100-80gb"
    cluster = load_cluster(preset)
    gpn = c.get("gpus_per_node") or cluster.gpus_per_node
    overrides: dict[str, Any] = {"gpus": c["n_gpus"], "gpus_per_node": min(gpn, c["n_gpus"])}
    rate = c.get("inter_node_bw_Gbps_per_gpu") or c.get("inter_node_bw")
    if rate:
        overrides["inter_node_bandwidth_bytes_per_s"] = float(rate) * 1e9 / 8
    # a variant of the GPU the row names (Grand Teton's H100s: 96 GB of HBM2e at 2.4 TB/s, capped at 500 W)
    if c.get("hbm_gbps"):
        overrides["hbm_bandwidth_bytes_per_s"] = float(c["hbm_gbps"]) * 1e9
    if c.get("hbm_gb"):
        overrides["hbm_bytes"] = int(float(c["hbm_gb"]) * 2**30)
    if c.get("power_limit_w"):
        overrides["power_cap_w"] = float(c["power_limit_w"])
    return cluster.with_overrides(**overrides)


# ------------------------------------------------------------------------------------------------------
# layout


def recompute_of(text: Any) -> str | None:
    """Published recompute wording -> ``none`` / ``selective`` / ``op`` / ``full``; ``None`` if unpublished."""
    if text is None:
        return None
    t = str(text).lower()
    if t.startswith(("full", "every_layer", "every layer")) or t in ("true", "yes"):
        return "full"
    if "op" in t.split() or "per-op" in t:
        return "op"
    if t.startswith("selective"):
        return "selective"
    if t.startswith(("none", "disabled", "no", "false")):
        return "none"
    return None


def zero_of(lay: dict[str, Any]) -> int | None:
    """ZeRO level from the row's data-parallel wording; ``None`` if unpublished."""
    if lay.get("zero_stage") is not None:
        return int(lay["zero_stage"])
    text = _lower(lay.get("dp_type"), lay.get("overlap"))
    if "opt+grads" in text or "shard_grad_op" in text or "not resharded" in text:
        return 2
    if "full shard" in text or "full_shard" in text or "fsdp" in text:
        return 3
    if "overlap-param-gather" in text or "distributed optimizer" in text:
        return 1  # Megatron's distributed optimizer shards the optimizer state (ZeRO-1)
    if lay.get("ddp_impl") is not None:
        return 0
    return None


def schedule_of(lay: dict[str, Any]) -> tuple[str | None, int | None]:
    text = _lower(lay.get("pipeline_schedule"))
    v = lay.get("virtual_stages")
    if not text:
        return None, (int(v) if v else None)
    if "interleav" in text:
        if not v:
            m = re.search(r"(\d+)\s+interleaving", text) or re.search(r"m\s*=\s*(\d+)", text)
            v = int(m.group(1)) if m else None
        return "interleaved", (int(v) if v else None)
    if "gpipe" in text:
        return "gpipe", 1
    if "1f1b" in text:
        return "1f1b", 1
    return None, None


def fix_of(lay: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``--fix`` keys of the published layout and the knobs left to the search."""
    if (lay.get("ep") or 1) > 1:
        raise AutoparError(f"expert parallelism (ep={lay['ep']}) is not in autopar's layouts yet")
    fix: dict[str, Any] = {"tp": lay["tp"], "pp": lay["pp"], "dp": lay["dp"], "cp": lay.get("cp") or 1}
    searched = []
    if isinstance(lay.get("micro_batch"), int):
        fix["mbs"] = lay["micro_batch"]
    else:
        searched.append("mbs")
    rec = recompute_of(lay.get("recompute"))
    if rec is None:
        searched.append("recompute")
    else:
        fix["recompute"] = rec
    if lay["tp"] > 1:
        if lay.get("sequence_parallel") is None:
            searched.append("sp")
        else:
            fix["sp"] = "on" if lay["sequence_parallel"] else "off"
    if lay["pp"] > 1:
        sched, v = schedule_of(lay)
        if sched is None:
            searched.append("schedule")
        else:
            fix["schedule"] = sched
            if v is None:
                searched.append("v")
            else:
                fix["v"] = v
    if lay["dp"] > 1:
        zero = zero_of(lay)
        if zero is None:
            searched.append("zero")
        else:
            fix["zero"] = zero
    return normalize_fix(fix), tuple(searched)


def measured_time_s(case: dict[str, Any]) -> float | None:
    meas, der = case.get("measured") or {}, case.get("derived") or {}
    if meas.get("iteration_time_s"):
        return float(meas["iteration_time_s"])
    if der.get("iteration_time_s"):
        return float(der["iteration_time_s"])
    if meas.get("tokens_per_s_per_gpu"):
        m = case["model"]
        return case["global_batch"] * m["seq_len"] / (meas["tokens_per_s_per_gpu"] * case["cluster"]["n_gpus"])
    return None


def reference_run(case: dict[str, Any]) -> ReferenceRun:
    """A calibration row as planner inputs."""
    ref, cfg = model_of(case)
    fixed, searched = fix_of(case["layout"])
    if "sp" in searched and _before_sequence_parallelism(case):
        fixed, searched = {**fixed, "sp": False}, tuple(k for k in searched if k != "sp")
    attention = attention_of(case)
    return ReferenceRun(
        case_id=case["case_id"], source=case["source"], model_ref=ref, config=cfg, cluster=cluster_of(case),
        framework=framework_of(case), framework_overrides=framework_overrides_of(case), attention=attention,
        global_batch=case.get("global_batch") or 0,
        fixed=fixed, measured_s=measured_time_s(case), searched=searched,
        per_layer_ms=case.get("measured_per_layer_ms", {}), precision=precision_of(case["layout"]),
        compile=compile_of(case["layout"]))


def compile_of(lay: dict[str, Any]) -> bool:
    """Whether the row ran its blocks ``torch.compile``d: its layout says so (``compile: true``, or
    ``torch.compile`` among its techniques); a row that does not say ran eagerly (the frameworks' defaults of
    their day: torchtitan's train configs set ``compile = false`` until 2025, Megatron and DeepSpeed do not
    compile)."""
    flag = lay.get("compile")
    if isinstance(flag, bool):
        return flag
    return "torch.compile" in _lower(lay.get("techniques"))


def precision_of(lay: dict[str, Any]) -> str:
    """``fp8`` where the row trained its Linears in FP8, else ``bf16``."""
    return "fp8" if "fp8" in _lower(lay.get("precision")) else "bf16"


#: A sweep run's "kernel" field -> (attention kernel, RMSNorm implementation).  "fused" is Megatron-LM's
#: fused scale-mask-softmax around unfused products, "torch" plain PyTorch ops; the "RMS kernel" is a
#: fused RMSNorm, the other runs compute RMSNorm op by op.
def kernels_of(kernel: str) -> tuple[str, str]:
    k = kernel.lower()
    norm = "fused" if "rms kernel" in k else "eager"
    if "flash_attention2" in k or "flash-attention-2" in k or "flash_attn2" in k:
        return "flash", norm
    if "flash" in k:
        return "flash1", norm
    if "fused" in k:
        return "math", norm
    return "eager", norm


def sweep_runs(name: str, sweep: dict[str, Any]) -> list[ReferenceRun]:
    """Every run of a measured layout sweep as planner inputs."""
    base = {"source": sweep.get("about", name), "case_id": name, "model": sweep["model"],
            "cluster": sweep["cluster"], "global_batch": sweep["global_batch"]}
    runs = []
    for i, r in enumerate(sweep["runs"]):
        lay = {k: r[k] for k in ("tp", "pp", "dp", "micro_batch", "recompute", "sequence_parallel") if k in r}
        case = {**base, "layout": lay, "measured": {"iteration_time_s": r["step_time_s"]}}
        run = reference_run(case)
        attention, norm = kernels_of(str(r.get("kernel", "")))
        config = {**run.config, "rms_norm": norm} if run.model_ref == "llama" else run.config
        runs.append(ReferenceRun(
            case_id=f"{name} #{i}", source=run.source, model_ref=run.model_ref, config=config,
            cluster=run.cluster, framework=run.framework, framework_overrides=run.framework_overrides,
            attention=attention, global_batch=run.global_batch,
            fixed=run.fixed, measured_s=run.measured_s, searched=run.searched))
    return runs
