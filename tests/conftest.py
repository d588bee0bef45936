from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

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


def run_killing_the_group(command: list[str], *, timeout: float, cwd: Path | None = None,
                          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` in a session of its own, whose whole process
    group is killed on timeout: killing torchrun alone leaves its workers running, and they would slow every
    later test on a 2-core machine."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def torchrun(script: Path | str, ranks: int, *args: str, timeout: float = 600, cwd: Path | None = None,
             env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=ranks [launcher...] script args`` with one thread per rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               *launcher, str(script), *args]
    return run_killing_the_group(command, timeout=timeout, cwd=cwd,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
