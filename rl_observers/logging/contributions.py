"""Worker-side contributions: copies of a LoggerObserver running away from the channel.

Step of the flow: **observer → channel**, away from the owner (source →
observer → channel → logger). A :class:`~rl_observers.LoggerObserver` copy
in a multiprocessing worker, a Ray actor or a process writing into a shared
buffer does not decide when to log: it *contributes* its window (mergeable
partials and its cumulative counters, with its schedule in ``meta``) at least
every ``report_interval`` seconds and whenever its own schedule counter
advanced by an interval. The owner merges contributions
(:mod:`rl_observers.logging.aggregate`). Worker processes exit without
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

from rl_observers.channel.meta import AGGREGATE, COUNTERS, LAST, PROCESS, WORKER
from rl_observers.logging.aggregate import AggregateSpec
from rl_observers.sources.placement import process_token, source_info

__all__ = ["LIVE", "Contributor"]

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
    """
    for observer in list(LIVE):
        if observer._mode == "contribute":
            try:
                # always: the owner needs the final counters to log the rows they made due;
                # its aggregate drops a trailing partial window itself unless log_on_close
                observer._close_window(final=True)
                observer._sink.flush(timeout=2.0)
            except Exception:  # the process is going away; never fail its exit
                pass


def _report_contributors_at_exit() -> None:
    global _EXIT_REPORT
    if not _EXIT_REPORT:
        _EXIT_REPORT = True
        # multiprocessing children run these finalizers but not ``atexit``; other processes the reverse
        multiprocessing.util.Finalize(None, _report_at_exit, exitpriority=100)
        atexit.register(_report_at_exit)



class Contributor:
    """The contributing half of :class:`~rl_observers.LoggerObserver` (a mixin).

    Uses the observer's ``schedule``, ``step_key``, ``scope``,
    ``log_on_close``, ``report_interval``, metric sets and sink.
    """

    def _resolve_mode(self, source: Any) -> None:
        """Local where the channel lives, contributor anywhere else (a worker, an actor, a fork)."""
        info = source_info(source)
        away = os.getpid() != self._home_pid or info.remote
        self._mode = "contribute" if away else "local"
        if away:
            if os.getpid() != self._home_pid and self._pristine:
                # a copy counts what its own process sees, not what the original had seen
                self._sets = pickle.loads(self._pristine)
                for metric_set in self._sets:
                    metric_set.bind(source)
                self._wire()
                self._home_pid = os.getpid()
            self._worker = info.worker if info.worker is not None else 0
            self._last_report = time.monotonic()
            _report_contributors_at_exit()

    def _report_due(self) -> bool:
        schedule = self.schedule
        if schedule is None:
            return True
        if time.monotonic() - self._last_report >= self.report_interval:
            return True
        if schedule.kind == "counter":
            counter = self._counters().get(schedule.key, 0)
            return counter - self._last_report_counter >= schedule.interval
        return False

    def _contribute(self, final: bool = False) -> None:
        counters = self._counters()
        latest = tuple(g for m in self._sets or () for g in m.latest_gauges)
        meta = {
            AGGREGATE: self.name,
            WORKER: self._worker,
            PROCESS: process_token(),
            COUNTERS: counters,
            **AggregateSpec(self.schedule, self.step_key, self.scope, self.log_on_close, latest).as_meta(),
        }
        if final:  # the copy's last window: the owner's account expects it (channel.account)
            meta[LAST] = True
            if not self._fresh:  # nothing new since the last window: only the marker, no counters
                del meta[COUNTERS]
                self._sink.submit_metrics({}, namespace=f"{self.name}/worker_{self._worker}", meta=meta)
                return
        payload = self._pull()
        self._last_report = time.monotonic()
        if self.schedule is not None and self.schedule.kind == "counter":
            self._last_report_counter = counters.get(self.schedule.key, 0)
        self._sink.submit_metrics(payload, namespace=f"{self.name}/worker_{self._worker}", meta=meta)

