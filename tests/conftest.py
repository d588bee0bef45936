from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from autopar.runtime.launch import run_killing_the_group

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXAMPLES = ROOT / "examples"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture
def examples() -> Path:
    return EXAMPLES


@contextlib.contextmanager
def imported(path: Path) -> Iterator[ModuleType]:
    """Import the Python file ``path`` under its own name, as a user's script imports its modules."""
    sys.path.insert(0, str(path.parent))
    try:
        yield importlib.import_module(path.stem)
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(path.stem, None)


def torchrun(script: Path | str, ranks: int, *args: str, timeout: float = 600, cwd: Path | None = None,
             env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=ranks [launcher...] script args`` with one thread per rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               *launcher, str(script), *args]
    return run_killing_the_group(command, timeout_s=timeout, cwd=cwd,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
