"""Benchmark (needs a GPU): the kernels the cost model prices, timed on the device at hand, with its clock and power.

What it times, each under a sustained load (kernels back to back, as a training step runs them, after a warm-up),
logging the SM clock and board power of every phase with ``nvidia-smi --query-gpu`` in a side loop (pynvml may be
missing):

- **products**: the bf16 (and, on Hopper and newer, FP8) local GEMM shapes of the published reference rows
  (``benchmarks/reference``: their q/k/v, output, MLP and head products at the rows' tensor-parallel split and a
  micro-batch of one sequence), and MAMF's best shapes; each also as a short burst (what kernel tables measure);
- **attention**: PyTorch's flash and cuDNN backends of ``scaled_dot_product_attention``, forward and backward apart,
  head dims 64 and 128, causal and not, 1k-16k tokens per sequence at 16k tokens per batch (the FlashAttention
  papers' setup);
- **collectives**: all-reduce and all-gather of 1 MiB-1 GiB over the GPUs of this host (NCCL), when there are two
  or more, and a product beside an all-gather (what the collective costs the compute: ``autopar.interference``).

One run takes under 5 minutes on one GPU (``--budget-s``), needs no network, and writes
``benchmarks/results/gpu_kernels_<device>.json``, which the cluster presets can cite.

    python benchmarks/gpu_kernels.py [--budget-s 280] [--output FILE]
    python benchmarks/gpu_kernels.py --list      # the shapes it would time (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_runs import REFERENCE_DIR, load_calibration

RESULTS = Path(__file__).resolve().parent / "results"
#: MAMF's best shapes (stas00/ml-engineering, the table the presets cite), timed here as well.
MAMF_SHAPES = ((2048, 2048, 13312), (1024, 10240, 5120), (1792, 16128, 3072), (4096, 9728, 2048))
ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384)
COLLECTIVE_BYTES = tuple(2 ** e for e in range(20, 31, 2))  # 1 MiB .. 1 GiB
MAX_SHAPES = 24
MAX_TOKENS = 8192


def reference_gemm_shapes(limit: int = MAX_SHAPES) -> list[tuple[int, int, int]]:
    """(m, n, k) of the forward products of the reference rows' layers and heads on one tp rank, for a micro-batch of
    one sequence of at most ``MAX_TOKENS`` tokens, deduplicated, the largest first.  Rows of decoder LMs only: a row
    that names a model file (``benchmarks/reference/beyond_decoders.json``) has no decoder's shapes to list, and a file
    that holds no runs (the sweeps, OpenXLA's GEMM table) none at all."""
    shapes: set[tuple[int, int, int]] = set()
    for path in sorted(REFERENCE_DIR.glob("*.json")):
        if "cases" not in json.loads(path.read_text()):
            continue
        for case in load_calibration(path):
            m, lay = case["model"], case.get("layout", {})
            if m.get("file"):
                continue
            tp, cp = lay.get("tp") or 1, lay.get("cp") or 1
            tokens = min(MAX_TOKENS, m["seq_len"] // cp)
            h, heads = m["hidden"], m["heads"]
            kv = m.get("kv_heads") or heads
            ffn = m.get("ffn") or 4 * h
            gated = "llama" in m["name"].lower()
            qkv = h + 2 * kv * (h // heads)
            for n_out, k_in in ((qkv // tp, h), (h, h // tp), ((2 if gated else 1) * ffn // tp, h), (h, ffn // tp),
                                (m["vocab"] // tp, h)):
                if n_out > 0 and k_in > 0:
                    shapes.add((tokens, n_out, k_in))
    return sorted(shapes, key=lambda s: -math.prod(s))[:limit]


class PowerLog:
    """``nvidia-smi --query-gpu`` sampled every ``period_ms`` in a side process: (time, SM MHz, W, C) rows."""

    def __init__(self, device: int, period_ms: int = 100) -> None:
        self.samples: list[tuple[float, float, float, float]] = []
        self._cmd = ["nvidia-smi", f"--id={device}", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                     "--format=csv,noheader,nounits", f"-lms={period_ms}"]
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PowerLog:
        try:
            self._proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self  # no nvidia-smi: phases carry no clock
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.perf_counter(), *(float(p) for p in parts[:3])))
            except ValueError:
                continue

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)

    def between(self, start: float, end: float) -> dict[str, float]:
        rows = [s for s in self.samples if start <= s[0] <= end]
        if not rows:
            return {}
        def mean(i: int) -> float:
            return sum(r[i] for r in rows) / len(rows)

        return {"sm_clock_mhz": mean(1), "power_w": mean(2), "temperature_c": mean(3), "samples": len(rows),
                "sm_clock_min_mhz": min(r[1] for r in rows), "power_max_w": max(r[2] for r in rows)}


def _timed(torch, fn, iters: int, warmup: int) -> float:
    """Seconds per call of ``fn`` run back to back (CUDA events around the whole loop)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def bench_products(torch, log: PowerLog, deadline: float, fp8: bool) -> list[dict[str, Any]]:
    out = []
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    for m, n, k in [*reference_gemm_shapes(), *MAMF_SHAPES]:
        if time.perf_counter() > deadline:
            break
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).to(dtype)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).to(dtype).t()
        if fp8:
            one = torch.ones((), device="cuda")
            fn = lambda a=a, b=b, one=one: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        else:
            fn = lambda a=a, b=b: torch.mm(a, b)
        flops = 2.0 * m * n * k
        burst = _timed(torch, fn, 5, 1)  # a kernel table's measurement: a few calls
        iters = max(10, min(2000, int(0.5 / max(burst, 1e-6))))  # ~0.5 s back to back: the power cap's regime
        t0 = time.perf_counter()
        sustained = _timed(torch, fn, iters, iters // 5)
        out.append({"m": m, "n": n, "k": k, "fp8": fp8, "burst_tflops": flops / burst / 1e12,
                    "sustained_tflops": flops / sustained / 1e12, **log.between(t0, time.perf_counter())})
        del a, b
    return out


def _attention_calls(f, q, k, v, causal: bool):
    """A forward of ``scaled_dot_product_attention`` and a forward with its backward, on these tensors."""
    def forward():
        return f.scaled_dot_product_attention(q, k, v, is_causal=causal)

    grad = forward().detach().clone().normal_()

    def forward_backward():
        import torch
        return torch.autograd.grad(forward(), (q, k, v), grad)

    return forward, forward_backward


def bench_attention(torch, log: PowerLog, deadline: float) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    f = torch.nn.functional
    out = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for d, causal, seq in ((d, c, s) for d in (64, 128) for c in (False, True) for s in ATTENTION_SEQS):
            if time.perf_counter() > deadline:
                return out
            heads, batch = 2048 // d, max(1, 16384 // seq)
            q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            nominal = 4.0 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
            forward, forward_backward = _attention_calls(f, q, k, v, causal)
            try:
                with sdpa_kernel([backend]):
                    t0 = time.perf_counter()
                    fwd = _timed(torch, forward, 20, 5)
                    both = _timed(torch, forward_backward, 20, 5)
            except RuntimeError as exc:  # the backend does not run this shape here
                out.append({"backend": backend.name, "head_dim": d, "causal": causal, "seq_len": seq,
                            "error": str(exc).splitlines()[0]})
                continue
            out.append({"backend": backend.name, "head_dim": d, "causal": causal, "seq_len": seq,
                        "fwd_tflops": nominal / fwd / 1e12, "bwd_tflops": 2.5 * nominal / max(both - fwd, 1e-9) / 1e12,
                        **log.between(t0, time.perf_counter())})
    return out


def _collective_worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    for nbytes in COLLECTIVE_BYTES:
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(world * x.numel(), device="cuda", dtype=torch.bfloat16)
        ar = _timed(torch, lambda x=x: dist.all_reduce(x), 10, 3)
        ag = _timed(torch, lambda x=x, g=gathered: dist.all_gather_into_tensor(g, x), 10, 3)
        rows.append({"bytes": nbytes, "all_reduce_bus_gbps": 2 * (world - 1) / world * nbytes / ar / 1e9,
                     "all_gather_bus_gbps": (world - 1) * nbytes / ag / 1e9})
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    alone = _timed(torch, lambda: torch.mm(a, a), 20, 5)
    x = torch.empty(2 ** 26, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty(world * x.numel(), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(gathered, x)
        torch.mm(a, a)
        torch.cuda.current_stream().wait_stream(side)
    overlapped = _timed(torch, both, 20, 5)
    gather = _timed(torch, lambda: dist.all_gather_into_tensor(gathered, x), 20, 5)
    if rank == 0:
        queue.put({"world": world, "sizes": rows, "gemm_alone_s": alone, "all_gather_alone_s": gather,
                   "gemm_beside_all_gather_s": overlapped})
    dist.destroy_process_group()


def bench_collectives(torch) -> dict[str, Any]:
    world = torch.cuda.device_count()
    if world < 2:
        return {"skipped": f"{world} GPU on this host: collectives need two or more"}
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(_collective_worker, args=(world, port, queue), nprocs=world, join=True, start_method="spawn")
    return queue.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=280.0, help="stop starting new measurements after this")
    ap.add_argument("--output", type=Path, help="JSON to write (default results/gpu_kernels_<device>.json)")
    ap.add_argument("--list", action="store_true", help="print the product shapes and exit (no GPU needed)")
    args = ap.parse_args()
    if args.list:
        for shape in reference_gemm_shapes():
            print(*shape)
        return
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py: no CUDA device on this machine")
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {"device": props.name, "sm_count": props.multi_processor_count,
                              "memory_bytes": props.total_memory, "torch": torch.__version__,
                              "cuda": torch.version.cuda, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with PowerLog(0) as log:
        torch.randn(8192, 8192, device="cuda") @ torch.randn(8192, 8192, device="cuda")  # wake the device
        fp8 = props.major >= 9 and hasattr(torch, "_scaled_mm")
        share = (deadline - time.perf_counter()) / (4 if fp8 else 3)
        result["products"] = bench_products(torch, log, time.perf_counter() + share, False)
        if fp8:
            result["products_fp8"] = bench_products(torch, log, time.perf_counter() + share, True)
        result["attention"] = bench_attention(torch, log, time.perf_counter() + share)
        result["idle"] = {}
        t0 = time.perf_counter()
        time.sleep(2)
        result["idle"] = log.between(t0, time.perf_counter())
    result["collectives"] = bench_collectives(torch)
    result["wall_s"] = time.perf_counter() - t_start
    name = re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-")
    out = args.output or RESULTS / f"gpu_kernels_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
