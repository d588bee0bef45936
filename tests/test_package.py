"""Packaging: passes/, solvers/ and models/ install inside the autopar namespace only."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)


def test_namespaced_imports_work(tmp_path):
    r = _run("import autopar.passes, autopar.solvers, autopar.models.gpt; print('ok')", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_top_level_names_are_not_importable(tmp_path):
    for name in ("passes", "solvers", "models"):
        r = _run(f"import {name}", tmp_path)
        assert r.returncode != 0, f"`import {name}` must fail outside the repository"
        assert "ModuleNotFoundError" in r.stderr


def test_console_script_is_installed(tmp_path):
    r = subprocess.run([sys.executable, "-m", "autopar.cli", "--version"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0
    assert r.stdout.startswith("autopar ")
