"""Unit constants. Everything inside autopar is SI: seconds, bytes, FLOPs, bytes per second."""

from __future__ import annotations

KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
GiB = 2**30
MiB = 2**20

US = 1e-6  # one microsecond in seconds
MS = 1e-3  # one millisecond in seconds

TFLOPS = 1e12  # FLOP/s


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    """Network line rates are quoted in Gb/s; internally we use bytes/s."""
    return gbit_per_s * 1e9 / 8


def gb_per_s_to_bytes_per_s(gb_per_s: float) -> float:
    return gb_per_s * GB
