"""What a LoggerObserver resolves once per source: its metric sets, schedule, step and per-event folds.

Examples:
    >>> import torch
    >>> from rl_observers.logging.wiring import bind_sets, event_folds
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(10))
    >>> sets, schedule, step_key = bind_sets(rb, None, None, None)
    >>> [type(m).__name__ for m in sets], schedule, step_key
    (['WriteMetrics', 'SampleMetrics'], Every(kind='counter', interval=100, key='sample_calls'), 'sample_calls')
    >>> [position for position, _ in event_folds(sets)["post_sample"]]
    [1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchrl.record.loggers.monitoring import Every

from rl_observers.logging.defaults import check_sets_fit, default_metrics, default_schedule
from rl_observers.metrics import CollectorBatchMetrics, MetricSet, SampleMetrics, WriteMetrics
from rl_observers.metrics.base import DATA_EVENTS
from rl_observers.metrics.source import missing_source_counters

__all__ = [
    "DATA_EVENTS",
    "bind_sets",
    "counter_key",
    "event_folds",
    "merged_counters",
    "observed_events",
    "schedule_counter_reader",
]


def counter_key(schedule: Every | None) -> str | None:
    """The counter a counter schedule runs on, else ``None``."""
    return schedule.key if schedule is not None and schedule.kind == "counter" else None


def bind_sets(
    source: Any, sets: tuple[MetricSet, ...] | None, schedule: Every | None, step_key: str | None,
    *, auto: bool = True,
) -> tuple[tuple[MetricSet, ...], Every | None, str | None]:
    """``(sets, schedule, step_key)`` resolved for ``source``, the sets bound to it (``None``: the defaults).

    Raises:
        ValueError: a set the source refuses, or a schedule or ``step=`` naming a counter no set counts.
    """
    if sets is None:
        sets = default_metrics(source)
    else:
        check_sets_fit(sets, source)
    # A source whose batches cannot make some numbers exact refuses those sets (the
    # torch.distributed / RPC collectors: rl_observers.remote.distributed).
    check = getattr(type(source), "check_metric_sets", None)
    if check is not None:
        check(source, sets)
    for metric_set in sets:
        metric_set.bind(source)
        check_keys = getattr(metric_set, "check_keys", None)
        if callable(check_keys):
            check_keys(source)  # a key the source's specs prove absent: refused here
    extra = missing_source_counters(source, sets)
    if extra is not None:
        sets = (*sets, extra)
    if auto:
        schedule = default_schedule(source, sets)
    counters = merged_counters(sets)
    key = counter_key(schedule)
    for wanted, argument in ((key, "Every.counter(key, n)"), (step_key, "step=")):
        if wanted is not None and wanted not in counters:
            names = ", ".join(type(m).__name__ for m in sets)
            raise ValueError(
                f"LoggerObserver: {argument} names the counter {wanted!r}, which none of its "
                f"metric sets ({names}) counts; use one of {sorted(counters)}."
            )
    if step_key is None:
        step_key = key or next(iter(counters), None)
    return sets, schedule, step_key


def merged_counters(sets: Sequence[MetricSet]) -> dict[str, float]:
    """The counters of all ``sets`` in one mapping (a later set wins for a name kept twice)."""
    counters: dict[str, float] = {}
    for metric_set in sets:
        counters.update(metric_set.counters())
    return counters


def event_folds(sets: Sequence[MetricSet]) -> dict[str, tuple[tuple[int, Callable[..., Any]], ...]]:
    """Per data event, the ``(position, on_<event>)`` of each set folding it, in order."""
    return {
        event: tuple(
            (index, getattr(m, "on_" + event)) for index, m in enumerate(sets) if event in m.folded_events
        )
        for event in DATA_EVENTS
    }


def schedule_counter_reader(schedule: Every | None, sets: Sequence[MetricSet]) -> Callable[[], Any] | None:
    """A call reading the schedule's counter as the merged counters would (the last set counting it), or ``None``."""
    key = counter_key(schedule)
    if key is None:
        return None
    for metric_set in reversed(sets):
        if key in metric_set.counters():
            return metric_set._counter_reader(key)
    return None


def observed_events(sets: Sequence[MetricSet] | None) -> tuple[str, ...]:
    """The events an observer folding ``sets`` is wired to (``None``: any default set), and shutdown."""
    candidates = sets or (CollectorBatchMetrics, WriteMetrics, SampleMetrics)
    folded = {event for m in candidates for event in m.events}
    if any(callable(getattr(m, "on_empty", None)) for m in candidates):
        folded.add("empty")
    return (*sorted(folded), "shutdown")
