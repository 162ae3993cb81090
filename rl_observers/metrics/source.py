"""What a source counts and reports itself: :class:`SourceCounters` for schedules, :class:`StatsProvider` for ``stats()``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from rl_observers.metrics.base import DATA_EVENTS, MetricSet
from rl_observers.metrics.storage import leading_size
from rl_observers.sources.placement import source_kind

__all__ = ["SourceCounters", "StatsProvider", "missing_source_counters"]


# Counters kept together, with the events that count them: a collector's, then a buffer's.
_COUNTER_GROUPS = {
    ("frames", "batches"): ("post_collect",),
    ("write_count", "writes", "items_written"): ("post_add", "post_extend"),
    ("sample_calls", "samples_returned"): ("post_sample",),
}
_COUNTER_EVENTS = {name: events for group, events in _COUNTER_GROUPS.items() for name in group}


class SourceCounters(MetricSet):
    """A source's own cumulative counters, for schedules and steps; logs nothing.

    ``frames`` (``numel()``) and ``batches`` on a collector; ``write_count``,
    ``writes``, ``items_written``, ``sample_calls`` and ``samples_returned``
    (leading sizes) on a replay buffer. A
    :class:`~rl_observers.LoggerObserver` adds those its sets do not keep, so
    ``Every.counter("frames", n)`` works with one-liners alone.

    Examples:
        >>> import torch
        >>> from rl_observers.metrics.source import SourceCounters
        >>> counters = SourceCounters(("sample_calls", "samples_returned"))
        >>> counters.on_post_sample(None, torch.zeros(4), {})
        >>> counters.counters()
        {'sample_calls': 1, 'samples_returned': 4}
    """

    _lock_folds = False

    def __init__(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in _COUNTER_EVENTS]
        if unknown:
            raise ValueError(f"SourceCounters: unknown counters {unknown}; known: {sorted(_COUNTER_EVENTS)}.")
        self.counter_names = tuple(names)
        super().__init__()
        self.folded_events = tuple(
            e for e in DATA_EVENTS if any(e in _COUNTER_EVENTS[n] for n in self.counter_names)
        )
        values = self._counters.values
        self._frames = "frames" in values
        self._samples = "sample_calls" in values
        # (name, whether it counts items, not calls) of the write counters kept
        self._writes = [(n, n != "writes") for n in ("writes", "items_written", "write_count") if n in values]

    def __repr__(self) -> str:
        return f"SourceCounters({self.counter_names!r})"

    def gauges(self, counters: dict[str, int]) -> dict[str, float]:
        return {}

    def on_post_collect(self, source: Any, batch: Any) -> None:
        with self._lock:
            values = self._counters.values
            if self._frames:
                values["frames"] += batch.numel()
                values["batches"] += 1

    def _write(self, items: int) -> None:
        with self._lock:
            values = self._counters.values
            for name, per_item in self._writes:
                values[name] += items if per_item else 1

    def on_post_add(self, source: Any, data: Any, index: Any) -> None:
        self._write(1)

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        self._write(leading_size(data))

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        with self._lock:
            values = self._counters.values
            if self._samples:
                values["sample_calls"] += 1
                values["samples_returned"] += leading_size(batch)


def missing_source_counters(source: Any, sets: Sequence[MetricSet]) -> SourceCounters | None:
    """The :class:`SourceCounters` of ``source``'s counters that none of ``sets`` keeps, or ``None``."""
    kind = source_kind(source)
    if kind is None:
        return None
    kept = {name for metric_set in sets for name in metric_set.counters()}
    groups = list(_COUNTER_GROUPS)[:1] if kind == "collector" else list(_COUNTER_GROUPS)[1:]
    missing = tuple(n for g in groups if not set(g) <= kept for n in g)
    return SourceCounters(missing) if missing else None


# -- statistics providers for ``stats()`` ----------------------------------------------------


class StatsProvider:
    """An observer that adds cheap, source-side entries to ``source.stats()``; it folds no event.

    It runs where the source runs (in a Ray buffer's actor, only the scalars
    cross), so torchrl's ``LoggerMonitor`` sees the same numbers.

    Args:
        providers (mapping or callable, optional): ``{name: fn}``, or one
            ``fn`` returning ``{name: number}``.
        **named: more ``name=fn`` providers.

    Each ``fn`` takes no argument or the source (decided from its signature).

    Examples:
        >>> import torch
        >>> import rl_observers
        >>> from rl_observers import StatsProvider
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100))
        >>> handle = rb.add_observer(StatsProvider(fill=lambda rb: len(rb) / 100))
        >>> _ = rb.extend(torch.arange(25))
        >>> rb.stats()["fill"]
        0.25
    """

    def __init__(self, providers: Any = None, **named: Callable[..., Any]) -> None:
        table: dict[str | None, Callable[..., Any]] = (
            {None: providers} if callable(providers) else dict(providers or {})
        )
        table.update(named)
        if not table:
            raise ValueError("StatsProvider needs at least one provider ({name: fn} or fn).")
        for name, fn in table.items():
            if not callable(fn):
                raise TypeError(f"StatsProvider: the provider of {name!r} must be callable, got {fn!r}.")
        self._providers = tuple((name, fn, _takes_source(fn)) for name, fn in table.items())
        self._source: Any = None

    def attached(self, source: Any) -> None:
        self._source = source

    def detached(self, source: Any) -> None:
        self._source = None

    def on_shutdown(self, source: Any) -> None:
        """Nothing: a provider only answers ``stats()``."""

    def stats(self) -> dict[str, float]:
        """Calls every provider and returns their entries."""
        out: dict[str, float] = {}
        source = self._source
        for name, fn, takes_source in self._providers:
            value = fn(source) if takes_source else fn()
            if name is None:
                out.update(value)
            else:
                out[name] = value
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"_providers": self._providers, "_source": None}

    def __repr__(self) -> str:
        return f"StatsProvider({[name for name, _, _ in self._providers]})"


def _takes_source(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind()
    except TypeError:  # a required argument: the source
        return True
    except ValueError:  # no signature to read: called with no argument
        return False
    return False
