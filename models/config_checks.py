"""Checks the zoo's model configs share: a clear ``ValueError`` (autopar's one-line error) for a value of the
wrong type or range, before anything is built."""

from __future__ import annotations

from typing import Any


def require_positive_ints(config: Any, *names: str) -> None:
    """Each of ``names`` is an ``int`` of at least 1 (``layers=-1`` or ``hidden=0`` builds nothing useful)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_fraction(config: Any, name: str) -> None:
    """``name`` is a number in [0, 1)."""
    value = getattr(config, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


__all__ = ["require_fraction", "require_positive_ints"]
