"""Timing helpers for the benchmark suites: alternating blocks, medians, ratios in one run."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def per_call_seconds(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare(
    candidates: dict[str, Callable[[], object]],
    *,
    calls: int,
    blocks: int = 15,
    warmup: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in alternating blocks.

    Alternating the candidates block by block spreads machine noise evenly
    over them, so the ratios of the medians are meaningful within one run.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for block in range(warmup + blocks):
            for name, fn in candidates.items():
                seconds = per_call_seconds(fn, calls)
                if block >= warmup:
                    samples[name].append(seconds)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(values) for name, values in samples.items()}
