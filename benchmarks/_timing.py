"""Timing helpers for the benchmark suites: alternating blocks, medians, ratios in one run."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def per_call_seconds(
    fn: Callable[[], object],
    calls: int,
    clock: Callable[[], float] = time.perf_counter,
    end: Callable[[], object] | None = None,
) -> float:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls, by ``clock``.

    ``clock`` is the wall clock by default; ``time.process_time`` (the CPU time of
    every thread of this process, background threads included) is what other
    processes' load moves least. ``end``, when given, runs once after the calls,
    inside the timing (its time is spread over the ``calls``).
    """
    start = clock()
    for _ in range(calls):
        fn()
    if end is not None:
        end()
    return (clock() - start) / calls


def alternating_samples(
    candidates: dict[str, Callable[[], object]],
    *,
    calls: int,
    blocks: int = 15,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    block_end: dict[str, Callable[[], object]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one sample per block, blocks alternating.

    Alternating the candidates block by block spreads machine noise evenly
    over them; the ``i``-th samples of two candidates were measured side by
    side. The garbage collector is off while measuring. ``block_end[name]``,
    when given, runs at the end of each of that candidate's blocks, inside
    the timing (e.g. a channel's ``flush``: what a block submitted is
    delivered, and charged, in that block, not in the next candidate's).
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for block in range(warmup + blocks):
            for name, fn in candidates.items():
                seconds = per_call_seconds(fn, calls, clock, (block_end or {}).get(name))
                if block >= warmup:
                    samples[name].append(seconds)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def compare(
    candidates: dict[str, Callable[[], object]],
    *,
    calls: int,
    blocks: int = 15,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in alternating blocks.

    The ratios of the medians are meaningful within one run (see
    :func:`alternating_samples`).
    """
    samples = alternating_samples(
        candidates, calls=calls, blocks=blocks, warmup=warmup, clock=clock
    )
    return {name: statistics.median(values) for name, values in samples.items()}


def paired_slowdowns(
    candidates: dict[str, Callable[[], object]],
    reference: str,
    *,
    calls: int,
    blocks: int = 15,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    block_end: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Per candidate, the median over blocks of its time divided by ``reference``'s time in that block.

    Neighbouring blocks share the machine's load, so this ratio shrugs off load
    that comes and goes during the run (other processes, leftover threads).
    ``block_end``: as for :func:`alternating_samples`.
    """
    samples = alternating_samples(
        candidates, calls=calls, blocks=blocks, warmup=warmup, clock=clock, block_end=block_end
    )
    base = samples[reference]
    return {
        name: statistics.median(v / b for v, b in zip(values, base)) for name, values in samples.items()
    }
