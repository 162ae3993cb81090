"""LoggerObserver: metric sets folded at the source, submitted on a schedule into a channel.

Step of the flow: **observer → channel** (source → observer → channel → logger),
read here as fold → schedule → submit. Resolved once, elsewhere: arguments
(:mod:`~.arguments`), sets, schedule and folds (:mod:`~.wiring`), namespaces
(:mod:`~.namespaces`), failure warnings (:mod:`~.failures`), checkpoints
(:mod:`~.state`), the copies' side (:mod:`~.copies`, :mod:`~.contributions`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from time import monotonic as _monotonic
from typing import Any, Literal

from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.logging import state as _state
from rl_observers.logging import wiring
from rl_observers.logging.arguments import check_arguments
from rl_observers.logging.defaults import DEFAULT_NAMES, as_metric_sets, as_sink, target_kind
from rl_observers.logging.failures import metric_set_warning
from rl_observers.logging.namespaces import Namespace
from rl_observers.metrics import MetricSet
from rl_observers.observer import FailureStreaks, Observer
from rl_observers.remote import MetricsChannel, copies
from rl_observers.remote.contributions import LIVE, Contribution, mode_at_end, resolve_mode
from rl_observers.schedule import ScheduleClock
from rl_observers.sources import observers_of

__all__ = ["LoggerObserver"]


def _fold_event(event: str) -> Callable[..., None]:
    """``LoggerObserver.on_<event>``: folds the payload into the sets, then checks the schedule.

    The check of a schedule inside its interval is inlined (one read, one comparison):
    this runs at every event, where each Python call costs ~0.5 us next to cold caches.
    """
    folds_of = f"_{event}_folds"
    where = f"on_{event}"

    def on_event(self: LoggerObserver, source: Any, *payload: Any) -> None:
        # the first event since attached, forked or loaded fixes the mode for this process
        before = None if self._mode is not None else self._first_event(source)
        folds = getattr(self, folds_of)
        self._fresh = True  # before folding: a window closed meanwhile is not skipped
        for position, fold in folds:
            try:
                fold(source, *payload)
            except Exception as err:
                self._set_failed(position, err, where)
        self._fresh = True  # again: an emission from another thread may have pulled meanwhile
        if self._streaks.failing:
            self._streaks.recover(position for position, _ in folds)
        if before is not None:  # a local observer's counters follow the source's (resume.py)
            _state.align(self, source, before)
        if self._mode == "local" and (self._emitted or not self.log_on_start):
            read = self._read_schedule_counter
            if read is not None:
                counter = read()
                clock = self._clock
                last = clock.last_counter
                if last is not None and last <= counter < clock.next_threshold:
                    clock.last_counter = counter  # one attribute store: no lock
                    return
            elif self._schedule_seconds is not None:  # a seconds schedule: one clock read
                if _monotonic() - self._clock.last_time < self._schedule_seconds:
                    return
        self._after()

    on_event.__name__ = where
    on_event.__qualname__ = f"LoggerObserver.{where}"
    return on_event


class LoggerObserver(Observer):
    """Folds what a source sees into metrics and logs them on a schedule.

    The metric sets fold each batch, write or sample into mergeable partials
    next to the data, with no host-device sync; when the schedule is due the
    window reaches the host in one transfer and goes to a
    :class:`~rl_observers.MetricsChannel`, which logs from its own thread.
    Rows are ``<name>/<metric>``, each namespace on its own step. Each metric
    set fails alone (``on_error``, once per failure streak). The long form is
    in the docs (concepts).

    Args:
        logger (Logger | MetricsChannel | MetricsHandle): where the metrics go
            (a logger instance gets :meth:`MetricsChannel.for_logger`).

    Keyword Args:
        schedule (Every | str, optional): ``Every.counter(key, n)`` over a
            counter of the sets, ``Every.seconds(s)``, or ``None`` (every data
            event). Defaults to ``"auto"`` (:func:`~.defaults.default_schedule`).
        metrics (MetricSet | Sequence[MetricSet], optional): instances.
            Defaults to :func:`~.defaults.default_metrics`.
        name (str, optional): the namespace, unique on its logger. Defaults
            to ``"collector"`` or ``"replay_buffer"``.
        scope (str, optional): ``"aggregate"`` (default), ``"per_worker"``
            (``<name>/worker_<i>/<metric>``) or ``"both"``.
        step (str | Callable[[], int] | collector, optional): a counter name,
            a collector (its frames) or a callable. Defaults to the schedule's counter.
        log_on_start (bool, optional): emit at the first data event. Defaults to ``False``.
        log_on_close (bool, optional): emit the last partial window. Defaults to ``True``.
        on_error (str, optional): ``"warn"``, ``"raise"`` or ``"ignore"``. Defaults to ``"warn"``.
        report_interval (float, optional): seconds between a copy's reports. Defaults to ``0.5``.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> import rl_observers
        >>> from rl_observers import Every, LoggerObserver, MetricsChannel
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl.record import CSVLogger
        >>> logger = CSVLogger(exp_name="demo", log_dir=tempfile.mkdtemp())
        >>> rb, channel = ReplayBuffer(storage=LazyTensorStorage(100)), MetricsChannel(logger)
        >>> handle = rb.add_observer(LoggerObserver(channel, schedule=Every.counter("sample_calls", 2)))
        >>> _ = rb.extend(torch.arange(10)); _ = rb.sample(4); _ = rb.sample(4)
        >>> channel.close()
        True
        >>> logger.experiment.scalars["replay_buffer/sample_calls"]
        [(2, 2.0)]
    """

    def __init__(
        self,
        logger: Any,
        *,
        schedule: Every | Literal["auto"] | None = "auto",
        metrics: MetricSet | Sequence[MetricSet] | None = None,
        name: str | None = None,
        scope: Literal["aggregate", "per_worker", "both"] = "aggregate",
        step: str | Callable[[], int] | BaseCollector | None = None,
        log_on_start: bool = False,
        log_on_close: bool = True,
        on_error: str = "warn",
        report_interval: float = 0.5,
    ) -> None:
        schedule, self._auto_schedule, self.step_key, self._step_fn = check_arguments(
            schedule, scope, on_error, name, step
        )
        self._sink, channel = as_sink(logger)
        self._channel_ref = weakref.ref(channel) if channel is not None else None
        self._sets = as_metric_sets(metrics)
        self.schedule, self.name, self.scope, self.on_error = schedule, name, scope, on_error
        self.log_on_start, self.log_on_close, self.report_interval = log_on_start, log_on_close, report_interval
        self._namespace = Namespace(self._channel_ref, given=name is not None)  # held while attached
        self._policy = on_error  # the policy in force once attached (add_observer may override it)
        self._streaks = FailureStreaks()  # metric sets (by position) in a failure streak
        self._clock, self._lock = ScheduleClock(schedule), threading.Lock()
        self._wire()  # the per-event folds (none before attaching) and the schedule's reader
        self._source: weakref.ref[Any] | None = None
        self._fresh = self._emitted = False  # data folded since the last emission; emitted once
        self._contribution = Contribution()  # the copies' side: where it runs, when it reported
        self._mode: str | None = None  # "local" or "contribute": fixed once per process
        self._align_pending = False  # line the counters up with the source's at the next event
        self._axis_base: dict[str, int] = {}  # what lining up added (a copy tells its aggregate)
        self._last_step: int | None = None  # the last step submitted: steps never go backwards
        self._pending_state: Mapping[str, Any] | None = None  # loaded before attaching
        self._has_copies = False  # copies run elsewhere: the aggregate at the owner is the state
        self._copies_elsewhere = False  # copies feed this namespace: this instance contributes too
        LIVE.add(self)

    # -- wiring, resolved once when attached ------------------------------------------------

    @property
    def observed_events(self) -> tuple[str, ...]:
        """The events this observer is wired to (those its metric sets fold, and shutdown)."""
        return wiring.observed_events(self._sets)

    @property
    def metrics(self) -> tuple[MetricSet, ...]:
        """The metric sets (chosen for the target once attached)."""
        return self._sets or ()

    def attached(self, source: Any) -> None:
        if self._source is not None and self._source() is not None and self._source() is not source:
            raise ValueError(
                "a LoggerObserver observes one source; create one LoggerObserver per collector "
                "or replay buffer."
            )
        self._bind(source)
        self._source = weakref.ref(source)
        self._align_pending = True
        self._mode = None  # resolved (and the counters lined up) at the next event
        entries = getattr(observers_of(source), "entries", ())  # add_observer(on_error=) wins
        self._policy = next((e.on_error for e in entries if e.observer is self), self._policy)
        channel = self._channel()
        if self.log_on_close and channel is not None:
            channel._logging.add_close_callback(self._close_window)
        self._load_pending_state()

    def detached(self, source: Any) -> None:
        try:
            self._last_window()
        finally:
            self._namespace.release(self.name, self)

    def prepare_copies(self, target: Any) -> None:
        """Called on the original before copies start where ``target``'s data is (see :mod:`~.copies`)."""
        copies.prepare(self, target)

    def copies_placed(self, target: Any, workers: tuple[int | None, ...]) -> None:
        """Called on the original once its copies are attached in ``workers`` of ``target``."""
        copies.placed(self, workers)

    def copies_removed(self, target: Any) -> None:
        """Called on the original once its copies are gone: logs the last aggregate windows."""
        copies.finish(self)

    def _bind(self, source: Any) -> None:
        """Resolves defaults, names and counters once, for ``source`` (a local one or a remote one)."""
        self._sets, schedule, self.step_key = wiring.bind_sets(
            source, self._sets, self.schedule, self.step_key, auto=self._auto_schedule
        )
        if self._auto_schedule:
            self.schedule, self._clock, self._auto_schedule = schedule, ScheduleClock(schedule), False
        if self._contribution.pristine is None:  # what a copy restarts from where it runs
            self._contribution.pristine = copies.pickled(self._sets)
        self._wire()
        key = wiring.counter_key(self.schedule)
        if key is not None:
            self._clock.due(self._counters()[key])  # primes the schedule at the counters' value now
        self.name = self._namespace.claim(DEFAULT_NAMES[target_kind(source)] if self.name is None else self.name, self)

    def _wire(self) -> None:
        """Resolves the per-event work once: each event's folds, and how to read the schedule's counter."""
        sets, schedule = self._sets or (), self.schedule
        folds = wiring.event_folds(sets)
        self._post_collect_folds, self._post_add_folds = folds["post_collect"], folds["post_add"]
        self._post_extend_folds, self._post_sample_folds = folds["post_extend"], folds["post_sample"]
        self._read_schedule_counter = wiring.schedule_counter_reader(schedule, sets)
        seconds = schedule is not None and schedule.kind == "seconds"
        self._schedule_seconds = float(schedule.interval) if seconds else None  # type: ignore[union-attr]

    def _load_pending_state(self) -> None:
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def _channel(self) -> MetricsChannel | None:
        return self._channel_ref() if self._channel_ref is not None else None

    def _counters(self) -> dict[str, float]:
        return wiring.merged_counters(self._sets or ())

    # -- fold ---------------------------------------------------------------------------------

    def _first_event(self, source: Any) -> dict[str, float] | None:
        """Fixes the mode for this process (:class:`Contribution`); returns the counters to
        line up with the source's after the fold (a local observer, once attached or loaded)."""
        resolve_mode(self, source)
        return self._counters() if _state.take_alignment(self, source) else None

    def _set_failed(self, index: int, error: Exception, where: str) -> None:
        """One metric set raised: the policy applies to it alone; the other sets go on."""
        metric_set = (self._sets or ())[index]
        warning = functools.partial(metric_set_warning, self.name, metric_set, where, error)
        self._streaks.fail(index, error, self._policy, warning)

    def on_empty(self, source: Any) -> None:
        """Tells the metric sets defining ``on_empty`` that the replay buffer was emptied."""
        for position, metric_set in enumerate(self._sets or ()):
            on_empty = getattr(metric_set, "on_empty", None)
            if on_empty is not None:
                try:
                    on_empty(source)
                except Exception as err:
                    self._set_failed(position, err, "on_empty")
                self._fresh = True  # what it folded is logged at removal or close

    on_post_collect = _fold_event("post_collect")
    on_post_add = _fold_event("post_add")
    on_post_extend = _fold_event("post_extend")
    on_post_sample = _fold_event("post_sample")

    # -- schedule -------------------------------------------------------------------------------

    def _after(self) -> None:
        """Emits, contributes or advances the schedule after an event (see :func:`_fold_event`)."""
        with self._lock:
            if self._mode == "contribute":
                if self._contribution.due(self.schedule, self.report_interval, self._counters):
                    copies.contribute(self)
                return
            key = wiring.counter_key(self.schedule)  # else counters are read only when emitting
            counters = None if key is None else self._counters()
            due = self._clock.due(None if counters is None else counters.get(key))
            if due or (self.log_on_start and not self._emitted):
                self._emit(self._counters() if counters is None else counters)

    def _close_window(self, final: bool = False) -> None:
        """Sends the open window; ``final``: a copy's last one, sent even if empty (the owner's account)."""
        with self._lock:
            if self._mode == "contribute" and (final or self._fresh):
                copies.contribute(self, final=final)
            elif self._fresh:
                self._emit(self._counters())

    def on_shutdown(self, source: Any) -> None:
        contributing = mode_at_end(self) == "contribute"
        try:
            self._last_window()
        finally:
            if not contributing:  # free for the next source; a contributor's copies may still send
                self._namespace.release(self.name, self)

    def _last_window(self) -> None:
        """The last window: a contributor's always (its final counters may make rows due at the
        owner, whose aggregate applies ``log_on_close``), acknowledged before the process may end."""
        if mode_at_end(self) == "contribute":
            self._close_window(final=True)
            self._sink.flush(timeout=copies.LAST_WINDOW_TIMEOUT)
        elif self.log_on_close:
            self._close_window()

    # -- submit ---------------------------------------------------------------------------------

    def _pull(self) -> dict[str, Any]:
        # Before pulling: an event folded meanwhile (from another thread) marks the next window.
        self._fresh = False
        payload: dict[str, Any] = {}
        failing = self._streaks.failing
        for index, metric_set in enumerate(self._sets or ()):
            if index in failing:  # its window waits for its recovery: no rows of zeros
                continue
            try:
                payload.update(metric_set.pull())
            except Exception as err:
                self._set_failed(index, err, "pull")
        self._streaks.failed_now.clear()
        return payload

    def _emit(self, counters: Mapping[str, float]) -> None:
        if not self._namespace.held:  # freed when the source shut down
            source = self._source() if self._source is not None else None
            what = "its source" if source is None else f"its {type(source).__name__}"
            self._namespace.claim_again(self.name or "", self, what)
        if self._step_fn is not None:
            step = self._step_fn()
        else:
            step = counters.get(self.step_key) if self.step_key else None
            if step is not None:  # a counter step: never below the namespace's last one
                step = int(step)
                if self._last_step is not None and step < self._last_step:
                    step = self._last_step
                self._last_step = step
        payload = self._pull()
        self._clock.fired()
        self._emitted = True
        self._sink.submit_metrics(payload, None if step is None else int(step), namespace=self.name or "")

    # -- pull interop and checkpoints ----------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Entries contributed to the target's ``stats()`` (e.g. ``sample_calls``)."""
        out: dict[str, float] = {}
        for metric_set in self._sets or ():
            out.update(metric_set.stats())
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on where this one stopped (see :mod:`~.state`).

        A :class:`~torchrl.checkpoint.Checkpoint` component: ``Checkpoint(..., observers=observer)``.
        """
        return _state.save(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict` (when attached, if called before).

        Raises:
            ValueError: the state does not fit (namespace, kind of source, scope or metric sets).
        """
        if self._sets is None:  # not attached yet: metric sets and name are resolved then
            self._pending_state = state_dict
        else:
            _state.load(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return copies.state_to_travel(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._mode = threading.Lock(), None  # a copy: its mode is resolved where it runs
        self._wire()
        LIVE.add(self)

    def __repr__(self) -> str:
        # Before attaching, show what was passed: never ``schedule=None`` ("every event").
        fields = [] if self.name is None else [f"name={self.name!r}"]
        fields.append("schedule='auto'" if self._auto_schedule else f"schedule={self.schedule!r}")
        if self._sets is not None:
            fields.append(f"metrics=[{', '.join(type(m).__name__ for m in self._sets)}]")
        return f"LoggerObserver({', '.join(fields)})"
