"""MetricSet: the base class of what a LoggerObserver folds and logs."""

from __future__ import annotations

import threading
from typing import Any

from rl_observers.stats import Partial

__all__ = ["MetricSet"]


class MetricSet:
    """Base class of metric sets.

    A metric set defines the ``on_<event>`` methods of the events it folds
    (listed in :attr:`events`) and the non-event methods below. Event methods
    and :meth:`pull` hold one lock, so events from a prefetch thread and a
    pull from another thread do not interleave. A metric set pickles (for
    workers and actors) with its state.

    Examples:
        >>> from rl_observers.metrics import MetricSet, WriteMetrics
        >>> isinstance(WriteMetrics(), MetricSet)
        True
        >>> WriteMetrics.events
        ('post_add', 'post_extend')
    """

    #: Events this set folds; the observer subscribes to these only.
    events: tuple[str, ...] = ()
    #: Gauges of :meth:`pull` that are not cumulative counters (across workers, the newest
    #: value is kept instead of the sum).
    latest_gauges: tuple[str, ...] = ()
    #: Attributes rebuilt on demand (scratch buffers), not pickled.
    _transient: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def counters(self) -> dict[str, float]:
        """Cumulative host counters, read without a device sync."""
        raise NotImplementedError

    def pull(self) -> dict[str, float | Partial]:
        """Closes the window: window partials and cumulative gauges, one transfer."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Entries this set contributes to its target's ``stats()``. Defaults to none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counters and in-flight accumulators."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""
        raise NotImplementedError

    def _drain(self) -> None:
        counters = getattr(self, "_counters", None)
        if counters is not None:
            counters.drain()

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            self._drain()  # CUDA events do not pickle; pending amounts are applied first
            state = self.__dict__.copy()
        del state["_lock"]
        for name in self._transient:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
