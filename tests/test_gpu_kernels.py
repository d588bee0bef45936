"""``benchmarks/gpu_kernels.py --list``: the shapes the GPU benchmark would time, listed on a machine without one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"


def test_the_shape_list_needs_no_gpu_and_holds_the_reference_rows_products():
    """Every reference table is read (model-file rows, which have no decoder shapes, skipped), the largest products
    first, among them the Megatron-Core 1.7B row's head: 4096 tokens, a 131072-word vocabulary, hidden 2048."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shapes = [tuple(int(x) for x in line.split()) for line in done.stdout.splitlines()]
    assert 0 < len(shapes) <= 24 and all(len(s) == 3 for s in shapes)
    assert shapes == sorted(shapes, key=lambda s: -s[0] * s[1] * s[2])  # the largest first
    assert (4096, 131072, 2048) in shapes
