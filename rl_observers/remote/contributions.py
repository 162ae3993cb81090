"""Worker-side contributions: copies of a LoggerObserver running away from the channel.

Step of the flow: **observer → channel**, away from the owner (source →
observer → channel → logger). A :class:`~rl_observers.LoggerObserver` copy
in a multiprocessing worker, a Ray actor or a process writing into a shared
buffer does not decide when to log: it *contributes* its window (mergeable
partials and its cumulative counters, with its schedule: a
:class:`~rl_observers.remote.window.Window`) at least
every ``report_interval`` seconds and whenever its own schedule counter
advanced by an interval. The owner merges contributions
(:mod:`rl_observers.remote.aggregate`). Worker processes exit without
shutdown events, so the last windows are sent at exit.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import pickle
import time
import weakref
from typing import Any

from torchrl.record.loggers.monitoring import Every

from rl_observers.remote.lockstep import Lockstep
from rl_observers.remote.window import AggregateSpec, Window
from rl_observers.schedule import ScheduleClock
from rl_observers.sources.placement import process_token, source_info

__all__ = ["LIVE", "Contribution", "copy_worker", "mode_at_end", "resolve_mode"]

# Every LoggerObserver of this process: a forked child resolves their mode again.
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_modes_after_fork() -> None:
    global _EXIT_REPORT
    _EXIT_REPORT = False
    for observer in list(LIVE):
        observer._mode = None


os.register_at_fork(after_in_child=_forget_modes_after_fork)

# Whether this process sends the contributors' last windows when it exits.
_EXIT_REPORT = False


def _report_at_exit() -> None:
    """Sends every contributing copy's last window: worker processes exit without shutdown events.

    Sent whatever ``log_on_close`` says: the owner's aggregate applies it
    (a trailing partial window is dropped there), but rows that the final
    counters make due must be logged.

    An original whose channel lives in this process and is closed already
    (its source shut down, then ``close()``) is skipped when it holds
    nothing new: its last window would only be the end marker, which the
    closed channel would drop with a warning, and at exit that warning may
    meet a closed ``stderr``. One that folded something since its last
    report still submits it, so the closed channel counts it in
    ``health()["dropped"]``. A copy always sends: its sender counts what
    it cannot deliver.
    """
    for observer in list(LIVE):
        if mode_at_end(observer) == "contribute":
            if not observer._fresh and _closed_here(observer):
                continue
            try:
                # always: the owner needs the final counters to log the rows they made due;
                # its aggregate drops a trailing partial window itself unless log_on_close
                observer._close_window(final=True)
                observer._sink.flush(timeout=2.0)
            except Exception:  # the process is going away; never fail its exit
                pass


def resolve_mode(observer: Any, source: Any) -> None:
    """Fixes the observer's mode for this process: local, or contributing (see ``Contribution``)."""
    observer._mode, sets = observer._contribution.resolve(source, has_copies=observer._copies_elsewhere)
    if sets is not None:
        observer._sets = sets
        observer._wire()


def mode_at_end(observer: Any) -> str | None:
    """The observer's mode when its source ends; a copy that never saw an event resolves it now.

    The owner expects every copy attached (:func:`~rl_observers.remote.copies.placed`) to report its
    end, so an idle copy still sends its final window instead of being
    counted lost.
    """
    if observer._mode is None and observer._contribution.moved():
        source = observer._source() if observer._source is not None else None
        if source is not None:
            resolve_mode(observer, source)
    return observer._mode


def _closed_here(observer: Any) -> bool:
    """Whether ``observer`` submits to a channel of this process that is closed."""
    channel = observer._channel()
    return channel is not None and channel.closed and observer._sink.transport == "local"


def _report_contributors_at_exit() -> None:
    global _EXIT_REPORT
    if not _EXIT_REPORT:
        _EXIT_REPORT = True
        # multiprocessing children run these finalizers but not ``atexit``; other processes the reverse
        multiprocessing.util.Finalize(None, _report_at_exit, exitpriority=100)
        atexit.register(_report_at_exit)



def copy_worker(worker: int | None) -> Any:
    """The ``Window.worker`` a copy placed as ``worker`` sends under (``None``, not a worker: 0)."""
    return worker if worker is not None else 0


class Contribution:
    """The copies' side of a :class:`~rl_observers.LoggerObserver`, held by the observer.

    Where the observer was created (``home_pid``), the metric sets a copy
    restarts from where it runs (``pristine``, pickled), which worker it is
    once resolved, how many workers its source has, and when it last
    reported. The observer decides its mode once per process with
    :meth:`resolve`, asks :meth:`due` after each event when contributing,
    and sends the :meth:`window` it makes.

    For a lockstep source (:mod:`~rl_observers.remote.lockstep`), the
    original is given the source's :class:`~rl_observers.remote.lockstep.Lockstep`
    before its copies are made (:meth:`cut_where_the_driver_does`): a copy then
    reports only where the driver's row falls, marked with the driver's counter.
    """

    __slots__ = (
        "clock",
        "cut",
        "home_pid",
        "last_report",
        "last_report_counter",
        "lockstep",
        "pristine",
        "worker",
        "workers",
    )

    def __init__(self) -> None:
        self.home_pid = os.getpid()
        self.pristine: bytes | None = None
        self.worker: Any = None
        self.workers = 0  # the source's workers, where the copy runs (0: not known)
        self.last_report = 0.0
        self.last_report_counter = 0.0
        self.lockstep: Lockstep | None = None
        self.clock: ScheduleClock | None = None  # the schedule, on the driver's counter
        self.cut: int | None = None  # the driver's counter where a row fell due, until sent

    def cut_where_the_driver_does(self, lockstep: Lockstep | None, schedule: Every | None) -> None:
        """Makes the copies report where the driver's rows fall (``None``: as observed).

        The schedule's thresholds start from the driver's counter at zero.
        """
        self.lockstep = lockstep
        self.clock = None
        if lockstep is not None:
            self.clock = ScheduleClock(schedule)
            self.clock.due(0)

    def moved(self) -> bool:
        """Whether this runs in another process than the observer was created in (it is a copy)."""
        return os.getpid() != self.home_pid

    def resolve(self, source: Any, *, has_copies: bool) -> tuple[str, tuple[Any, ...] | None]:
        """``("local" | "contribute", fresh metric sets or None)`` for the process this runs in.

        Local where the channel lives, contributing anywhere else (a worker,
        an actor, a fork), and also where the channel lives when copies
        elsewhere feed the same namespace (``has_copies``: the original is
        one more contributor, ``worker="main"``). A copy in another process
        gets fresh metric sets: it counts what its own process sees, not
        what the original had seen.
        """
        info = source_info(source)
        moved = os.getpid() != self.home_pid
        if not (moved or info.remote or has_copies):
            return "local", None
        sets = None
        if moved and self.pristine:
            sets = tuple(pickle.loads(self.pristine))
            for metric_set in sets:
                metric_set.bind(source)
            self.home_pid = os.getpid()
        if moved or info.remote:
            self.worker = copy_worker(info.worker)
        else:
            self.worker = "main"
        self.workers = info.num_workers or 0
        self.last_report = time.monotonic()
        _report_contributors_at_exit()
        return "contribute", sets

    def join_as_original(self) -> str:
        """The mode of the original once it has copies elsewhere: contributing, as worker ``"main"``."""
        self.worker = "main"
        self.last_report = time.monotonic()
        _report_contributors_at_exit()
        return "contribute"

    def due(self, schedule: Any, report_interval: float, counters: Any) -> bool:
        """Whether to report now: at least every ``report_interval`` s, and per schedule interval.

        A copy of a lockstep source reports only where the driver's row is due.
        """
        clock = self.clock
        if clock is not None and self.worker != "main":
            value = self.lockstep.driver_value(self.worker, counters())  # type: ignore[union-attr]
            if value is not None:
                if clock.due(value):
                    self.cut = value
                    return True
                return False
        if schedule is None:
            return True
        if time.monotonic() - self.last_report >= report_interval:
            return True
        if schedule.kind == "counter":
            return counters().get(schedule.key, 0) - self.last_report_counter >= schedule.interval
        return False

    def window(
        self,
        name: str,
        metrics: dict[str, Any],
        counters: dict[str, float] | None,
        spec: AggregateSpec,
        *,
        base: dict[str, float] | None = None,
        last: bool = False,
    ) -> Window:
        """One window of the observer ``name`` (and the report's time and counter are recorded).

        ``counters=None``: a last window that only marks the end. A copy of a
        lockstep source marks the window with the driver's counter (``cut``)
        and whether the driver's row is due there.
        """
        self.last_report = time.monotonic()
        schedule = spec.schedule
        if counters is not None and schedule is not None and schedule.kind == "counter":
            self.last_report_counter = counters.get(schedule.key, 0)
        spec.workers = self.lockstep.workers if self.lockstep is not None else self.workers
        spec.lockstep = self.lockstep is not None
        cut, due = None, False
        if self.lockstep is not None and counters is not None:
            cut, due = self.cut, self.cut is not None
            if cut is None:  # not where a row is due: the last window, where the driver's counter ends
                cut = self.lockstep.driver_value(self.worker, counters)
            self.cut = None
        return Window(
            f"{name}/worker_{self.worker}",
            metrics,
            observer=name,
            worker=self.worker,
            process=process_token(),
            counters=counters,
            base=base or None,
            spec=spec,
            last=last,
            cut=cut,
            due=due,
        )
