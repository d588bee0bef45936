"""A launcher that runs past its limit is stopped with every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from autopar.runtime.launch import run_killing_the_group


def _alive(pid: int) -> bool:
    """Running, or stopped but not yet reaped by its parent (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(seconds: float, still_there) -> bool:
    """Whether ``still_there()`` turns false within ``seconds`` (a killed process takes a moment to go)."""
    deadline = time.monotonic() + seconds
    while still_there() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not still_there()


def _parent_and_child(pid_file) -> list[str]:
    """A parent that starts a child (as torchrun starts its workers), writes its pid and waits on it."""
    return ["bash", "-c", f"sleep 60 > /dev/null 2>&1 & echo $! > {pid_file}; wait"]


def test_a_timeout_kills_the_children_too(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_killing_the_group(_parent_and_child(tmp_path / "child.pid"), timeout_s=2)
    child = int((tmp_path / "child.pid").read_text())
    assert _gone_within(5, lambda: _alive(child))


def test_an_interrupted_caller_kills_the_children_too(tmp_path):
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)  # Ctrl-C reaches only the caller: the launcher runs in a session of its own
    try:
        with pytest.raises(KeyboardInterrupt):
            run_killing_the_group(_parent_and_child(tmp_path / "child.pid"), timeout_s=30)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    child = int((tmp_path / "child.pid").read_text())
    assert _gone_within(5, lambda: _alive(child))


def test_a_run_within_its_limit_returns_what_it_printed():
    done = run_killing_the_group(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout_s=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_verify_past_its_limit_is_one_error_and_leaves_no_rank_behind(tmp_path, capsys):
    from autopar.cli import main
    from autopar.errors import AutoparError
    from autopar.runtime.verify import run_plan

    assert main(["plan", "gpt", "--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu",
                 "--gpus", "2", "--global-batch", "4", "--fix", "dp=2", "-o", str(tmp_path), "-q"]) == 0
    capsys.readouterr()
    with pytest.raises(AutoparError, match=r"^the distributed run took more than 1 s: stopped its ranks$"):
        run_plan(tmp_path / "plan.json", 1, timeout_s=1)
    assert _gone_within(5, lambda: _ranks_of(str(tmp_path / "plan.json")))


def _ranks_of(plan: str) -> list[int]:
    """Live processes whose command line names ``plan`` (the launcher and its workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if plan.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_a_failed_launch_is_reported_by_the_exception_a_rank_raised():
    """torchrun relays each rank's traceback and closes with a rule of ``=`` signs: the report names the exception
    (with its module path, as torch's checkpointing raises its own), never the rule."""
    from autopar.runtime.verify import root_cause

    stderr = ("[rank0]: Traceback (most recent call last):\n"
              "[rank0]:   File \"train.py\", line 3, in <module>\n"
              "[rank0]: torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: A different number of "
              "tensors was saved during the original forward and recomputation.\n"
              "[rank0]: Number of tensors saved during forward: 51\n"
              "E1207 worker.py:1 failed (exitcode: 1) local_rank: 0\n"
              "============================================================\n")
    assert root_cause(stderr).startswith("torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: A different")
    assert root_cause("[rank1]: RuntimeError: boom\n") == "RuntimeError: boom"
    assert root_cause("autopar: error: bad plan\n[rank0]: ValueError: x\n") == "autopar: error: bad plan"
    assert root_cause("something went wrong\n=====\n") == "something went wrong"
    assert root_cause("") == "no output"
