"""When torchrl's ``Every`` is due, with ``LoggerMonitor``'s logic: once per crossed threshold, re-baselined when the counter goes down.

Examples:
    >>> from rl_observers.schedule import ScheduleClock
    >>> from torchrl.record.loggers.monitoring import Every
    >>> clock = ScheduleClock(Every.counter("frames", 100))
    >>> clock.due(0)  # primes at the current value
    False
    >>> [clock.due(frames) for frames in (50, 120, 150, 390)]
    [False, True, False, True]
    >>> clock.due(10)  # the counter went down: re-baseline, no emission
    False
    >>> clock.due(100)
    True
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from torchrl.record.loggers.monitoring import Every

__all__ = ["ScheduleClock"]


class ScheduleClock:
    """When an :class:`Every` schedule is due, with ``LoggerMonitor``'s semantics."""

    __slots__ = ("last_counter", "last_time", "next_threshold", "schedule")

    def __init__(self, schedule: Every | None) -> None:
        self.schedule = schedule
        self.next_threshold: float | None = None
        self.last_counter: float | None = None
        self.last_time = time.monotonic()

    def due(self, counter: float | None) -> bool:
        schedule = self.schedule
        if schedule is None:
            return True
        if schedule.kind == "seconds":
            return time.monotonic() - self.last_time >= schedule.interval
        if counter is None:
            return False
        if self.next_threshold is None or (
            self.last_counter is not None and counter < self.last_counter
        ):
            self.rebase(counter)
            return False
        self.last_counter = counter
        if counter >= self.next_threshold:
            self.rebase(counter)
            return True
        return False

    def rebase(self, counter: float) -> None:
        """The next threshold is the first multiple of the interval above ``counter``."""
        interval = self.schedule.interval  # type: ignore[union-attr]
        self.next_threshold = (counter // interval + 1) * interval
        self.last_counter = counter

    def fired(self) -> None:
        self.last_time = time.monotonic()

    def state_dict(self) -> dict[str, Any]:
        return {"next_threshold": self.next_threshold, "last_counter": self.last_counter}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_threshold = state.get("next_threshold")
        self.last_counter = state.get("last_counter")
