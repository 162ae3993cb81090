"""The checks of a LoggerObserver's constructor arguments, run once when it is created.

Examples:
    >>> from rl_observers.logging.arguments import check_arguments
    >>> check_arguments("auto", "aggregate", "warn", None, "frames")
    (None, True, 'frames', None)
    >>> check_arguments("auto", "everywhere", "warn", None, None)
    Traceback (most recent call last):
    ...
    ValueError: scope must be one of 'aggregate', 'per_worker' or 'both', got 'everywhere'.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.observer import check_on_error

__all__ = ["SCOPES", "check_arguments"]

#: The accepted values of ``scope``.
SCOPES: tuple[str, ...] = ("aggregate", "per_worker", "both")


def _frames_of(collector: BaseCollector) -> Callable[[], Any]:
    """``collector.stats()["frames"]``, holding the collector weakly."""
    ref = weakref.ref(collector)

    def frames() -> Any:
        target = ref()
        return None if target is None else target.stats().get("frames")

    return frames


def check_arguments(
    schedule: Any, scope: Any, on_error: Any, name: Any, step: Any
) -> tuple[Every | None, bool, str | None, Callable[[], Any] | None]:
    """``(schedule, auto, step_key, step_fn)`` from the arguments, or an error saying what to pass."""
    auto = isinstance(schedule, str) and schedule == "auto"
    if auto:
        schedule = None
    elif schedule is not None and not isinstance(schedule, Every):
        raise TypeError(
            "schedule must be an Every (Every.counter(key, n) or Every.seconds(s)), \"auto\" "
            f"or None, got {schedule!r}."
        )
    if schedule is not None and not schedule.interval == schedule.interval:
        # torchrl's Every refuses intervals <= 0 but lets NaN through: it would never fire.
        raise ValueError(f"schedule interval must be a number > 0, got {schedule!r}.")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of 'aggregate', 'per_worker' or 'both', got {scope!r}.")
    check_on_error(on_error)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}.")
    step_fn: Callable[[], Any] | None = None
    if isinstance(step, BaseCollector):
        step_fn, step = _frames_of(step), None
    elif step is not None and not isinstance(step, str):
        if not callable(step):
            raise TypeError(
                "step must be a counter name (\"frames\", \"sample_calls\", ...), a torchrl "
                f"collector or a callable returning the step, got {step!r}."
            )
        step_fn, step = step, None
    return schedule, auto, step, step_fn
