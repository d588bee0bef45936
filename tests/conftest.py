from __future__ import annotations

import contextlib
import importlib
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
