"""Parsing the quantities a sweep is asked in: token counts (``15T``, ``4Mi``), durations (``60d``), money
(``2M``) and lists of GPU counts (``64,128,...,8192``).  Each bad value is a one-line ``AutoparError``."""

from __future__ import annotations

import math
import re

from autopar.errors import AutoparError

#: Decimal suffixes (``15T`` tokens, a ``2M`` budget) and binary ones (``4Mi`` tokens: 4 x 2^20).
SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15,
         "KI": 2.0**10, "MI": 2.0**20, "GI": 2.0**30, "TI": 2.0**40}
SECONDS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 365.0 * 86400.0}
_NUMBER = re.compile(r"^\s*\$?\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_amount(text: str, what: str) -> float:
    """``text`` as a positive number with an optional suffix of ``SCALE`` (``15T``, ``4Mi``, ``2.5e6``,
    ``$2M``); ``what`` names the option in the error."""
    match = _NUMBER.match(str(text))
    suffix = match.group(2).upper() if match else ""
    if not match or suffix not in SCALE:
        raise AutoparError(f"{what}: {text!r} is not a number with an optional K, M, B, T (or Ki, Mi, Gi) suffix")
    value = float(match.group(1)) * SCALE[suffix]
    if not math.isfinite(value) or value <= 0:
        raise AutoparError(f"{what} must be positive, not {text!r}")
    return value


def parse_duration_s(text: str, what: str) -> float:
    """``text`` (``60d``, ``12h``, ``90m``, ``3600`` seconds, ``2w``) in seconds, positive."""
    match = _NUMBER.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in {**SECONDS, "": 1.0}:
        raise AutoparError(f"{what}: {text!r} is not a duration such as 60d, 12h, 90m or 30s")
    value = float(match.group(1)) * SECONDS.get(unit, 1.0)
    if not math.isfinite(value) or value <= 0:
        raise AutoparError(f"{what} must be positive, not {text!r}")
    return value


def parse_gpu_counts(text: str) -> list[int]:
    """``--gpus``: counts separated by commas, in any order, where ``a,b,...,c`` fills in the progression
    ``a, b`` starts: geometric when ``b`` is a whole multiple of ``a`` and ``c`` lies on it (``64,128,...,8192``),
    else arithmetic (``72,144,...,720``).  Sorted, without repeats."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise AutoparError("--gpus: give GPU counts such as 64,128,256 or 64,128,...,8192")
    counts: list[int] = []
    i = 0
    while i < len(parts):
        if parts[i] == "...":
            if len(counts) < 2 or i + 1 >= len(parts) or parts[i + 1] == "...":
                raise AutoparError("--gpus: '...' needs two counts before it and one after (64,128,...,8192)")
            a, b, end = counts[-2], counts[-1], _count(parts[i + 1])
            counts.extend(_progression(a, b, end))
            i += 2
            continue
        counts.append(_count(parts[i]))
        i += 1
    return sorted(set(counts))


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise AutoparError(f"--gpus: {text!r} is not a positive whole number of GPUs")
    return int(text)


def _progression(a: int, b: int, end: int) -> list[int]:
    """The terms after ``b`` up to ``end`` of the progression ``a, b, ...``."""
    if b <= a or end < b:
        raise AutoparError(f"--gpus: {a},{b},...,{end} must grow (a < b <= end)")
    if b % a == 0:
        ratio, out, x = b // a, [], b
        while x < end:
            x *= ratio
            out.append(x)
        if x == end:
            return out
    step = b - a
    if (end - b) % step:
        raise AutoparError(f"--gpus: {end} lies on neither progression {a},{b},... (x{b // a if b % a == 0 else '?'} "
                           f"or +{step})")
    return list(range(b + step, end + 1, step))


def human_duration(seconds: float) -> str:
    """``seconds`` as a short duration: ``3.2 h``, ``41 d``, ``2.1 y``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    if seconds < 2 * SECONDS["y"]:
        return f"{seconds / 86400:.1f} d"
    return f"{seconds / SECONDS['y']:.1f} y"


def human_amount(value: float) -> str:
    """``value`` with a decimal suffix: ``15T``, ``2.4M``, ``812``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


__all__ = ["SCALE", "SECONDS", "human_amount", "human_duration", "parse_amount", "parse_duration_s",
           "parse_gpu_counts"]
