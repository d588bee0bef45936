"""Every shell command of the README and of ``docs/`` runs as written.

The fenced ``bash`` blocks of each page are run in order, in a scratch directory that sees the repository's
``models/``, ``examples/`` and ``benchmarks/`` (a page's later commands read what its earlier ones wrote).  The
commands that take more than a minute on 2 cores, that install, or that a test of their own runs as written are
listed in ``NOT_RUN`` with their reason; the test fails on a command that is neither run nor listed, and on a
listed one no page has any more.  A command that writes nothing (``autopar plan`` without ``-o``) and that an
earlier page ran as it is is not run again.  An ``autopar`` command with nothing for the shell to do runs through
``autopar.cli.main`` in this process; the rest run under ``bash``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from autopar.runtime.launch import run_killing_the_group

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Command prefix -> why it is not run here.
NOT_RUN = {
    "python3 -m venv .venv": "creates a virtual environment and installs autopar into it (what .ci/run does)",
    "autopar sweep models/llama.py": "plans 15 points of Llama 3 70B, minutes on 2 cores (benchmarks/sweep_time.py "
                                     "times sweeps like it; docs/sweep.md's small sweep runs here)",
    "torchrun --nproc-per-node 4 examples/decorated.py --steps 2": "tests/test_decorator.py runs it as written, "
                                                                   "then again to reuse the plan it saved",
}
FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def commands(page: Path) -> list[str]:
    """The shell commands of ``page``'s ``bash`` blocks: continuation lines joined, comments dropped."""
    out = []
    for block in FENCE.findall(page.read_text()):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _skipped(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


#: Commands that ran on an earlier page and write nothing: they would only print the same again.
_RAN_READ_ONLY: set[str] = set()


def _writes_nothing(command: str) -> bool:
    return (command.startswith("autopar plan ") and not any(o in command.split() for o in ("-o", "--output"))
            and not any(c in command for c in "|>"))


def test_every_listed_command_is_still_in_a_page():
    every = [c for page in PAGES for c in commands(page)]
    for prefix in NOT_RUN:
        assert any(c.startswith(prefix) for c in every), f"NOT_RUN lists a command no page has: {prefix}"


def _in_process(command: str) -> bool:
    """An ``autopar`` command the shell adds nothing to: ``autopar.cli.main`` runs it in this process, without
    the ~3 s of a new interpreter importing torch (.ci/run runs the console script itself)."""
    return command.startswith("autopar ") and not any(c in command for c in "|&;<>()$`'\"")


def _run_in_process(command: str, capsys) -> tuple[int, str]:
    """``command``'s exit code and what it wrote to stderr."""
    from autopar.cli import main

    capsys.readouterr()
    try:
        code = main(shlex.split(command, comments=True)[1:])
    except SystemExit as exc:  # argparse's refusal of the arguments
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=lambda p: p.name)
def test_the_commands_of_a_page_run(page, tmp_path, monkeypatch, capsys):
    for name in ("models", "examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    ran = 0
    for command in commands(page):
        if _skipped(command) or command in _RAN_READ_ONLY:
            continue
        if _in_process(command):
            code, err = _run_in_process(command, capsys)
        else:
            done = run_killing_the_group(["bash", "-c", command], cwd=tmp_path, env=env, timeout_s=300)
            code, err = done.returncode, done.stderr
        assert code == 0, f"{page.name}: `{command}` exited {code}:\n{err[-2000:]}"
        ran += 1
        if _writes_nothing(command):
            _RAN_READ_ONLY.add(command)
    assert ran > 0
