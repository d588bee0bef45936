"""Planned against measured: loss, grad norm, tokens/s, MFU and peak memory next to the plan's estimate, every
logged step, printed and written as JSON lines (and to TensorBoard when asked)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError

#: glibc ``mallopt`` parameter ``M_MMAP_THRESHOLD`` and the value autopar pins it to on CPU runs.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1024 * 1024


def return_freed_tensors_to_the_os() -> bool:
    """Pin glibc's mmap threshold (1 MiB) so that every tensor above it is its own mapping, unmapped when
    freed.  glibc otherwise raises the threshold after each large free (up to 32 MiB), serves later
    tensors from its heap and keeps the freed pages: peak RSS then grew to twice the live tensors on a
    sharded 355M-parameter model.  Returns whether it applied (glibc only)."""
    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


@dataclass
class StepReport:
    """Measured steps of a run against the plan's ``estimate`` (its ``iteration_time_s``,
    ``peak_memory_bytes`` and ``model_flops_per_iter``).

    MFU is the plan's convention: the model FLOPs of one iteration over the step time and the peak FLOP/s
    of every device (``peak_flops`` of the plan's cluster).
    """

    estimate: dict[str, Any]
    tokens_per_step: int
    devices: int
    peak_flops: float
    device: torch.device
    steps: int = 0  # steps timed
    first_time_s: float = 0.0  # the first step's (warm-up) time
    total_time_s: float = 0.0  # of every step timed
    last_record: dict[str, Any] | None = None  # the latest logged step, as ``MetricsLog`` writes it
    baseline_bytes: int = 0
    """Peak memory before the model was built (torch, the process group): what the run adds is above it."""

    def __post_init__(self) -> None:
        self.baseline_bytes = self.peak_memory_all_ranks()

    def step(self, index: int, loss: float, time_s: float, steps: int = 1, grad_norm: float | None = None,
             bad_steps: int = 0) -> str:
        """Record a logged step: its loss (and grad norm), and the mean time of the ``steps`` steps since the
        last logged one (``time_s``), and the steps skipped so far for a non-finite loss or gradient norm
        (``bad_steps``); returns the line rank 0 prints."""
        if self.steps == 0:
            self.first_time_s = time_s
        self.steps += steps
        self.total_time_s += time_s * steps
        mem = self.peak_memory_all_ranks()
        self.last_record = {"step": index, "loss": loss, "grad_norm": grad_norm, "time_s": time_s,
                            "tokens_per_s": self.tokens_per_step / time_s, "mfu": self.mfu(time_s),
                            "peak_memory_bytes": mem, "skipped_steps": bad_steps}
        norm = f" grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        norm += f" ({bad_steps} non-finite steps skipped so far)" if bad_steps else ""
        return (f"step {index} loss {loss:.6f}{norm} | {self.tokens_per_step / time_s:,.0f} tokens/s, "
                f"MFU {100 * self.mfu(time_s):.3g}%, {time_s:.4g} s (plan {self.estimate['iteration_time_s']:.4g} s), "
                f"peak memory {mem / 2**30:.3f} GiB (plan {self.estimate['peak_memory_bytes'] / 2**30:.3f} GiB)")

    def mfu(self, time_s: float) -> float:
        return self.estimate["model_flops_per_iter"] / (time_s * self.devices * self.peak_flops)

    def peak_memory_all_ranks(self) -> int:
        """The largest peak memory of any rank (a max all-reduce)."""
        peak = torch.tensor(peak_memory_bytes(self.device), dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak)

    def summary(self) -> dict[str, Any]:
        """The run's closing JSON object; steady state leaves out the first step (warm-up) when there are more.
        (Running sums, not a list per step: a run of a million steps keeps no more than one.)"""
        if self.steps > 1:
            time_s = (self.total_time_s - self.first_time_s) / (self.steps - 1)
        else:
            time_s = self.first_time_s
        return {"steps": self.steps, "loss": self.last_record["loss"], "iteration_time_s": time_s,
                "tokens_per_s": self.tokens_per_step / time_s, "mfu": self.mfu(time_s),
                "peak_memory_bytes": self.peak_memory_all_ranks(), "baseline_memory_bytes": self.baseline_bytes,
                "estimate": {k: self.estimate[k] for k in ("iteration_time_s", "tokens_per_s", "mfu",
                                                           "peak_memory_bytes")}}

    def summary_line(self) -> str:
        return json.dumps(self.summary(), sort_keys=True)


class MetricsLog:
    """The logged steps as JSON lines in ``path`` (appended: a resumed run goes on in the same file), and as
    TensorBoard scalars under ``tensorboard`` (``torch.utils.tensorboard``: the ``tensorboard`` extra)."""

    def __init__(self, path: str | Path | None, tensorboard: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise AutoparError("--tensorboard needs the tensorboard package: pip install 'autopar[tensorboard]'") \
                    from None
            self.writer = SummaryWriter(str(tensorboard))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.writer.add_scalar(f"train/{key}", value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


__all__ = ["MetricsLog", "StepReport", "peak_memory_bytes", "return_freed_tensors_to_the_os"]
