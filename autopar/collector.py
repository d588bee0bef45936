"""Python's cyclic garbage collector, paused while planning.

Tracing and searching allocate millions of small objects (fake tensors' metadata, partial layouts, bound terms)
beside a large heap that lives as long as they do (torch's modules, the operator graph, the search's caches).  The
collector's full passes walk all of that heap each time the young objects pile up, and cost GPT-3 175B's plan
about a third of its time (tracing 2.8 -> 2.1 s, search 3.6 -> 2.5 s, best of four on 2 cores).  What it would
have freed meanwhile (the cycles torch.export's graphs make) is freed when it resumes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (or the decorated function), then resume it if it ran before:
    nested pauses resume only at the outermost."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


__all__ = ["collector_paused"]
