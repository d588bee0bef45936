"""Running a launcher (torchrun and its workers) as one process group, killed whole on timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_killing_the_group(command: Sequence[str], *, timeout_s: float, cwd: str | Path | None = None,
                          env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)``, with the command in a
    session of its own whose whole process group is killed on timeout (``TimeoutExpired`` is raised after) or
    when the caller is interrupted.

    Killing torchrun alone leaves its workers running: they would hold the cores and their ports after the
    caller gave up on them."""
    with subprocess.Popen(list(command), cwd=cwd, env=None if env is None else dict(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:  # the timeout, or Ctrl-C: the group has its own session and does not get the SIGINT
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(list(command), proc.returncode, out, err)


__all__ = ["run_killing_the_group"]
