"""Worker-side contributions: copies of a LoggerObserver running away from the channel.

A copy does not decide when to log: it *contributes* its
:class:`~rl_observers.remote.window.Window` every ``report_interval`` seconds
and per schedule interval (or where the driver's rows fall), and once more at
exit; the owner merges them (:mod:`~rl_observers.remote.aggregate`).

Examples:
    >>> from torchrl.record.loggers.monitoring import Every
    >>> from rl_observers.remote.contributions import Contribution
    >>> from rl_observers.remote.window import AggregateSpec
    >>> contribution = Contribution()
    >>> contribution.join_as_original(at_exit=lambda: None)  # the original, once its copies run elsewhere
    'contribute'
    >>> contribution.namespace("collector")
    'collector/worker_main'
    >>> spec = AggregateSpec(Every.counter("frames", 100), "frames")
    >>> window = contribution.window("collector", {}, {"frames": 120}, spec, final=True)
    >>> window.observer, window.worker, window.counters, window.last
    ('collector', 'main', {'frames': 120}, True)
    >>> contribution.window("collector", {}, {"frames": 120}, spec, final=True, fresh=False).counters is None
    True
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrl.record.loggers.monitoring import Every

from rl_observers import lifecycle
from rl_observers.observer import dumps
from rl_observers.remote import aggregate
from rl_observers.remote.lockstep import Lockstep, plan_for
from rl_observers.remote.window import AggregateSpec, Window
from rl_observers.schedule import ScheduleClock
from rl_observers.sources.placement import process_token, source_info

__all__ = ["Contribution"]


@dataclass(slots=True, eq=False, repr=False)
class Contribution:
    """The copies' side of a :class:`~rl_observers.LoggerObserver`, held by the observer.

    The observer picks its mode once per process (:meth:`resolve` or
    :meth:`join_as_original`, with what to run at exit), asks :meth:`due`
    after each event and sends the :meth:`window` it makes.
    """

    home_pid: int = field(default_factory=os.getpid)
    pristine: bytes | None = None
    worker: Any = None
    workers: int = 0  # the source's workers, where the copy runs (0: not known)
    last_report: float = 0.0
    last_report_counter: float = 0.0
    lockstep: Lockstep | None = None
    clock: ScheduleClock | None = None  # the schedule, on the driver's counter
    cut: int | None = None  # the driver's counter where a row fell due, until sent

    #: Seconds a copy waits at its source's shutdown for its last window to be acknowledged by the
    #: owner's ingest; within the source's own bound (30 s for the actors of a Ray source).
    last_window_timeout = 20.0

    @staticmethod
    def worker_of(worker: int | None) -> Any:
        """The ``Window.worker`` a copy placed as ``worker`` sends under (``None``, not a worker: 0)."""
        return worker if worker is not None else 0

    def cut_where_the_driver_does(self, target: Any, schedule: Every | None) -> None:
        """Makes the copies on ``target`` report where the driver's rows fall, if it has such rows.

        For a lockstep source, given to the original before its copies are made.
        """
        self.lockstep = lockstep = plan_for(target, schedule)
        self.clock = None
        if lockstep is not None:
            self.clock = ScheduleClock(schedule)
            self.clock.due(0)

    def start_at(self, counter: float) -> None:
        """The schedule's counter of a copy starts at ``counter`` (its source's restored count)."""
        clock, lockstep = self.clock, self.lockstep
        if clock is None or lockstep is None or self.worker == "main":
            return
        value = lockstep.driver_value(self.worker, {lockstep.key: counter})
        if value is not None and (clock.last_counter is None or value > clock.last_counter):
            clock.rebase(value)

    def keep_pristine(self, sets: Any) -> None:
        """Keeps ``sets`` pickled, once: what a copy restarts from (``b""`` if they cannot travel)."""
        if self.pristine is None:
            try:
                self.pristine = dumps(sets)
            except Exception:
                self.pristine = b""

    def moved(self) -> bool:
        """Whether this runs in another process than the observer was created in (it is a copy)."""
        return os.getpid() != self.home_pid

    def resolve(
        self, source: Any, *, has_copies: bool, at_exit: Callable[[], None]
    ) -> tuple[str, tuple[Any, ...] | None]:
        """``("local" | "contribute", fresh metric sets or None)`` for the process this runs in.

        Contributing away from the channel, and where it lives when copies
        elsewhere feed the same namespace (``has_copies``: ``worker="main"``).
        """
        info = source_info(source)
        moved = self.moved()
        if not (moved or info.remote or has_copies):
            return "local", None
        sets = None
        if moved and self.pristine:
            sets = tuple(pickle.loads(self.pristine))
            for metric_set in sets:
                metric_set.bind(source)
            self.home_pid = os.getpid()
        self.workers = info.num_workers or 0
        mode = self.join_as_original(at_exit)  # as worker "main", unless this is a copy
        if moved or info.remote:
            self.worker = self.worker_of(info.worker)
        return mode, sets

    def join_as_original(self, at_exit: Callable[[], None]) -> str:
        """The mode of the original once it has copies elsewhere: contributing, as worker ``"main"``."""
        self.worker = "main"
        self.last_report = time.monotonic()
        lifecycle.at_exit(at_exit, lifecycle.COPIES)
        return "contribute"

    def due(self, schedule: Any, report_interval: float, counters: Any) -> bool:
        """Whether to report now: every ``report_interval`` s and per schedule interval.

        A lockstep copy reports only where the driver's row is due.
        """
        clock = self.clock
        if clock is not None and self.worker != "main":
            value = self.lockstep.driver_value(self.worker, counters())  # type: ignore[union-attr]
            if value is not None:
                if clock.due(value):
                    self.cut = value
                    return True
                return False
        if schedule is None or time.monotonic() - self.last_report >= report_interval:
            return True
        if schedule.kind == "counter":
            return counters().get(schedule.key, 0) - self.last_report_counter >= schedule.interval
        return False

    def window_of(self, observer: Any, metrics: dict[str, Any], counters: dict[str, float], **how: Any) -> Window:
        """:meth:`window` of ``observer`` (a ``LoggerObserver``), with what its owner needs to know."""
        latest = tuple(g for m in observer.metrics for g in m.latest_gauges)
        spec = AggregateSpec(
            observer.schedule,
            observer.step_key,
            observer.scope,
            observer.log_on_close,
            latest,
            timeout=observer.worker_timeout,
        )
        return self.window(observer.name or "", metrics, counters, spec, **how)

    aggregate_state = staticmethod(aggregate.aggregate_state)
    load_aggregate_state = staticmethod(aggregate.load_aggregate_state)
    finish = staticmethod(aggregate.finish_aggregate)

    def namespace(self, name: str | None) -> str:
        """The namespace a contribution of the observer ``name`` is sent under."""
        return f"{name}/worker_{self.worker}"

    def window(
        self,
        name: str,
        metrics: dict[str, Any],
        counters: dict[str, float],
        spec: AggregateSpec,
        *,
        final: bool = False,
        fresh: bool = True,
        base: Mapping[str, int] | None = None,
    ) -> Window:
        """One window of a contribution, the one place it is built.

        ``spec`` is the observer's (``workers`` and ``lockstep`` are filled in
        here); ``final``: the last window, only a marker if not ``fresh``
        (nothing folded since the previous one); ``base``: what lining up with
        a restored source added to the cumulative ``counters``.
        """
        self.last_report = time.monotonic()
        schedule = spec.schedule
        if schedule is not None and schedule.kind == "counter":
            self.last_report_counter = counters.get(schedule.key, 0)
        lockstep = self.lockstep
        spec.workers = lockstep.workers if lockstep is not None else self.workers
        spec.lockstep = lockstep is not None
        marker = final and not fresh  # only the end: no counters, nothing to cut
        cut, due = None, False
        if lockstep is not None and not marker:
            cut, due = self.cut, self.cut is not None
            if cut is None:  # the last window, where the driver's count ends
                cut = lockstep.driver_value(self.worker, counters)
        self.cut = None
        return Window(
            self.namespace(name),
            {} if marker else metrics,
            observer=name or "",
            worker=self.worker,
            process=process_token(),
            counters=None if marker else counters,
            base=None if marker else (base or None),
            spec=spec,
            last=final,
            cut=cut,
            due=due,
        )
