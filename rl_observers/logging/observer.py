"""LoggerObserver: metric sets folded at the source, submitted on a schedule into a channel.

Read as fold → schedule → submit, then the original's side of its copies and the checkpoint.
"""

from __future__ import annotations

import pickle
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from time import monotonic as _monotonic
from time import time as _time
from typing import Any, ClassVar, Literal

from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers import lifecycle
from rl_observers.channel import MetricsChannel
from rl_observers.logging import wiring
from rl_observers.logging.copies import new_copies
from rl_observers.logging.defaults import as_metric_sets, as_sink, check_arguments, target_kind
from rl_observers.logging.namespaces import Namespace
from rl_observers.logging.resume import (
    AXIS_COUNTERS,
    STATE_VERSION,
    describe,
    misfit,
    owns_axis,
    shift_counters,
    source_axis,
)
from rl_observers.metrics import MetricSet
from rl_observers.metrics.keys import public_error_name
from rl_observers.observer import FailureStreaks, Observer, dumps
from rl_observers.schedule import ScheduleClock
from rl_observers.sources import observers_of
from rl_observers.sources.replay_buffers import writes_held
from rl_observers.stats import LastEvent

__all__ = ["LoggerObserver"]


_NO_ARGUMENT = object()  # post_collect's payload is one argument, the others' two


def _fold_event(event: str) -> Callable[..., None]:
    """``LoggerObserver.on_<event>``: folds, then checks the schedule (inlined: each Python call costs ~0.5 us here)."""
    which = wiring.DATA_EVENTS.index(event)
    where = f"on_{event}"

    def on_event(self: LoggerObserver, source: Any, data: Any, info: Any = _NO_ARGUMENT) -> None:
        # the first event since attached, forked or loaded fixes the mode for this process
        before = None if self._mode is not None else self._first_event(source)
        folds = self._folds[which]
        self._fresh = True  # before folding: a window closed meanwhile is not skipped
        for position, fold in folds:
            try:
                if info is _NO_ARGUMENT:
                    fold(source, data)
                else:
                    fold(source, data, info)
            except Exception as err:
                self._set_failed(position, err, where)
        self._fresh = True  # again: an emission from another thread may have pulled meanwhile
        self._last_event = _time()
        if self._streaks.failing:
            self._streaks.recover(position for position, _ in folds)
        if before is not None:  # a local observer's counters follow the source's (resume.py)
            self._align(source, before)
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

    The metric sets fold each event into mergeable partials next to the data;
    when the schedule is due the window reaches the host in one transfer and goes
    to a :class:`~rl_observers.MetricsChannel` as ``<name>/<metric>`` rows, each
    namespace on its own step. Each metric set fails alone (``on_error``).

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
        worker_timeout (float, optional): seconds an aggregate row waits for a
            worker that has not reported before it is logged without it (and a
            warning names the worker). Defaults to ``10.0``.

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

    #: Every LoggerObserver of this process (fork and exit hooks).
    _live: ClassVar[weakref.WeakSet[LoggerObserver]] = weakref.WeakSet()
    #: time.time() of the last event: the window's LastEvent (rates off rows).
    _last_event = float("-inf")

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
        worker_timeout: float = 10.0,
    ) -> None:
        schedule, self._auto_schedule, self.step_key, self._step_fn = check_arguments(
            schedule, scope, on_error, name, step
        )
        self._sink, channel = as_sink(logger)
        self._channel_ref = weakref.ref(channel) if channel is not None else None
        self._sets = as_metric_sets(metrics)
        self.schedule, self.name, self.scope, self.on_error = schedule, name, scope, on_error
        self.log_on_start, self.log_on_close = log_on_start, log_on_close
        self.report_interval = report_interval
        if not (isinstance(worker_timeout, (int, float)) and worker_timeout > 0):
            raise ValueError(f"LoggerObserver: worker_timeout must be a number of seconds > 0, got {worker_timeout!r}.")
        self.worker_timeout = float(worker_timeout)
        self._namespace = Namespace(self._channel_ref, given=name is not None)  # held when attached
        self._policy = on_error  # the policy in force once attached (add_observer may override it)
        self._streaks = FailureStreaks()  # metric sets (by position) in a failure streak
        self._clock, self._lock = ScheduleClock(schedule), threading.Lock()
        self._wire()  # the per-event folds (none before attaching) and the schedule's reader
        self._source: weakref.ref[Any] | None = None
        self._fresh = self._emitted = False  # data folded since the last emission; emitted once
        self._contribution = new_copies()  # where a copy runs, when it reports, what it sends
        self._mode: str | None = None  # "local" or "contribute": fixed once per process
        self._align_pending = False  # line the counters up with the source's at the next event
        self._axis_base: dict[str, int] = {}  # what lining up added (a copy tells its aggregate)
        self._last_step: int | None = None  # the last step submitted: steps never go backwards
        self._pending_state: Mapping[str, Any] | None = None  # loaded before attaching
        self._has_copies = False  # copies run elsewhere: the aggregate at the owner is the state
        self._copies_elsewhere = False  # copies feed this namespace: this instance contributes too
        self._live.add(self)

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

    def _bind(self, source: Any) -> None:
        """Resolves defaults, names and counters once, for ``source`` (a local one or a remote one)."""
        self._sets, schedule, self.step_key = wiring.bind_sets(
            source, self._sets, self.schedule, self.step_key, auto=self._auto_schedule
        )
        if self._auto_schedule:
            self.schedule, self._auto_schedule = schedule, False
            self._clock = ScheduleClock(schedule)
        self._contribution.keep_pristine(self._sets)  # what a copy restarts from where it runs
        self._wire()
        self._prime_clock()
        self.name = self._namespace.claim(self.name or target_kind(source), self)

    def _prime_clock(self) -> None:
        """Primes a counter schedule at the counters' value now."""
        key = wiring.counter_key(self.schedule)
        value = None if key is None else self._counters().get(key)
        if value is not None:
            self._clock.due(value)

    def _wire(self) -> None:
        """Resolves the per-event work once: each event's folds, and how to read the schedule's counter."""
        sets, schedule = self._sets or (), self.schedule
        folds = wiring.event_folds(sets)
        self._folds = tuple(folds[event] for event in wiring.DATA_EVENTS)  # by position
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

    def _first_event(self, source: Any) -> dict[str, float] | None:
        """Fixes this process's mode; the counters to line up with the source's after the fold, if any.

        A local observer lines up, and so does a copy that owns its source's axis.
        """
        self._resolve_mode(source)
        align = self._align_pending and (self._mode == "local" or owns_axis(source))
        self._align_pending, self._axis_base = False, {}
        return self._counters() if align else None

    def _align(self, source: Any, before: Mapping[str, float]) -> None:
        """Moves counters below the source's own up to it, given ``before`` the event (:mod:`~.resume`).

        Under a replay buffer's own lock, so a concurrent write is never counted twice.
        """
        with writes_held(source):
            axis = source_axis(source)
            key = wiring.counter_key(self.schedule)
            with self._lock:
                counters = self._counters()
                for counter, value in axis.items():
                    ours = counters.get(counter)
                    if ours is None or value <= ours:
                        continue  # the observer's own count is ahead (its saved state): steps go on
                    names = AXIS_COUNTERS[counter]
                    offset = int(value - ours)
                    shift_counters(self.metrics, names, offset)
                    self._axis_base.update(dict.fromkeys(names, offset))
                    if key in names:  # the threshold the source's axis had before this event
                        prior = before.get(key, 0) + offset
                        clock = self._clock
                        if clock.last_counter is None or prior > clock.last_counter:
                            clock.rebase(prior)
                        # a lockstep copy's thresholds on the driver's axis
                        self._contribution.start_at(prior)

    def _set_failed(self, index: int, error: Exception, where: str) -> None:
        """One metric set raised: the policy applies to it alone; the other sets go on."""
        metric_set = (self._sets or ())[index]

        def warning() -> str:
            return (
                f"rl_observers: LoggerObserver {self.name!r}: metric set {metric_set!r} raised in "
                f"{where} ({public_error_name(error)}: {error}). Its metrics are skipped (no rows) "
                "until it succeeds again (reported once per failure streak); the observer's other "
                "metric sets keep logging. Fix the set's configuration, or attach with "
                'on_error="raise" to stop at the error.'
            )

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

    def _after(self) -> None:
        """Emits, contributes or advances the schedule after an event (see :func:`_fold_event`)."""
        with self._lock:
            if self._mode == "contribute":
                if self._contribution.due(self.schedule, self.report_interval, self._counters):
                    self._contribute()
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
                self._contribute(final=final)
            elif self._fresh:
                self._emit(self._counters())

    def on_shutdown(self, source: Any) -> None:
        contributing = self._mode_at_end() == "contribute"
        try:
            self._last_window()
        finally:
            if not contributing:  # free for the next source; a contributor's copies may still send
                self._namespace.release(self.name, self)

    def _last_window(self) -> None:
        """The last window, acknowledged before the process may end (always for a contributor)."""
        if any(metric_set.changed_since_pull() for metric_set in self._sets or ()):
            self._fresh = True  # a count made at shutdown (dropped rollouts) is sent
        if self._mode_at_end() == "contribute":
            self._close_window(final=True)
            self._sink.flush(timeout=self._contribution.last_window_timeout)
        elif self.log_on_close:
            self._close_window()

    def _pull(self) -> dict[str, Any]:
        # Before pulling: an event folded meanwhile (from another thread) marks the next window.
        self._fresh = False
        payload: dict[str, Any] = {LastEvent.KEY: LastEvent(self._last_event)}
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
            if step is not None:  # a count (>= 0): never below the namespace's last step
                step = self._last_step = max(int(step), self._last_step or 0)
        payload = self._pull()
        self._clock.fired()
        self._emitted = True
        self._sink.submit_metrics(payload, None if step is None else int(step), namespace=self.name or "")

    def _contribute(self, final: bool = False) -> None:
        """Sends this contributor's window to the owner (holding the lock); ``final``: the last one, maybe empty."""
        counters = self._counters()
        fresh = self._fresh  # after the counters: what was folded meanwhile goes with this window
        metrics = self._pull() if fresh or not final else {}  # final, nothing new: the end marker
        window = self._contribution.window_of(
            self, metrics, counters, final=final, fresh=fresh, base=self._axis_base
        )
        self._sink.submit_window(window)

    def worker_view(self, source: Any, worker: int) -> LoggerObserver:
        """A ``LoggerObserver`` of worker ``worker``'s share of ``source``'s batches, attached to it.

        For the synchronous torch.distributed collectors' ``scope="per_worker"``:
        fresh copies of the metric sets, counters from zero; not in ``state_dict()``.

        Raises:
            TypeError: the metric sets cannot be copied (pickled).
        """
        try:
            sets = pickle.loads(dumps(self.metrics))
        except Exception as error:
            raise TypeError(
                f"LoggerObserver {self.name!r}: scope={self.scope!r} folds each worker's rows "
                "into copies of its metric sets, and these cannot be pickled; use scope='aggregate', "
                "or metric sets (and one-liner functions) that pickle."
            ) from error
        same = ("schedule", "log_on_start", "log_on_close", "on_error", "report_interval")
        options = {key: getattr(self, key) for key in same}
        name = f"{self.name}/worker_{worker}"
        view = LoggerObserver(self._sink, metrics=sets, name=name, step=self.step_key, **options)
        view.attached(source)
        view._align_pending = False  # its counters are the worker's, not the source's
        return view

    def prepare_copies(self, target: Any) -> None:
        """Called on the original before copies start where ``target``'s data is.

        The original becomes one more contributor (worker ``"main"``); for a remote
        source, the sets, namespace and step the copies share are resolved here.

        Raises:
            ValueError: ``step=`` is a collector or a callable, which copies cannot read.
        """
        self._copies_elsewhere = True
        if any(e.observer is self for e in getattr(observers_of(target), "entries", ())):
            with self._lock:  # attached here (or being attached): its next event keeps this mode
                self._mode = self._contribution.join_as_original(self._report_live_at_exit)
            return
        if self._step_fn is not None:
            raise ValueError(
                "LoggerObserver: step= a collector or a callable is read where the channel lives, "
                f"but this {type(target).__name__}'s observers run in other processes; pass a "
                'counter name instead, e.g. step="frames".'
            )
        self._bind(target)
        self._contribution.cut_where_the_driver_does(target, self.schedule)
        self._has_copies = True
        self._mode = self._contribution.join_as_original(self._report_live_at_exit)
        channel = self._channel()
        if channel is not None:  # a channel closed before the copies are gone loses their windows
            what = f"LoggerObserver {self.name!r} on a {type(target).__name__}"
            channel._logging.copies_attached(self, what)
        self._load_pending_state()

    def copies_placed(self, target: Any, workers: tuple[int | None, ...]) -> None:
        """Called once its copies are attached in ``workers``: each must report, or counts lost."""
        channel = self._channel()
        if channel is not None:
            expected = [self._contribution.worker_of(w) for w in workers]
            channel._logging.copies_expected(self, expected)

    def copies_removed(self, target: Any) -> None:
        """Called once its copies are gone: logs the aggregate's last windows (once) and frees the namespace."""
        channel = self._channel()
        if channel is not None:
            channel._logging.copies_gone(self)
        if not self._namespace.held:
            return
        try:
            if channel is not None and self.name is not None and not channel.closed:
                self._contribution.finish(channel, self.name)
        finally:
            self._namespace.release(self.name, self)

    def _resolve_mode(self, source: Any) -> None:
        """Fixes the mode for this process: local, or contributing (see :class:`Contribution`)."""
        self._mode, sets = self._contribution.resolve(
            source, has_copies=self._copies_elsewhere, at_exit=self._report_live_at_exit
        )
        if sets is not None:
            self._sets = sets
            self._wire()

    def _mode_at_end(self) -> str | None:
        """The mode when the source ends; an idle copy resolves it now, so it still reports its end."""
        if self._mode is None and self._contribution.moved():
            source = self._source() if self._source is not None else None
            if source is not None:
                self._resolve_mode(source)
        return self._mode

    def _report_at_exit(self) -> None:
        """A contributor's last window as its process exits (worker processes get no shutdown event)."""
        if self._mode_at_end() != "contribute":
            return
        if not self._fresh:
            channel = self._channel()
            if channel is not None and channel.closed and self._sink.transport == "local":
                return  # a channel of this process, closed: it would only drop the end marker
        try:  # whatever log_on_close says: the owner needs the final counters
            self._close_window(final=True)
            self._sink.flush(timeout=2.0)
        except Exception:  # the process is going away; never fail its exit
            pass

    @staticmethod
    def _report_live_at_exit() -> None:
        """Every contributing observer's last window: the one ``at_exit`` hook of :class:`Contribution`."""
        for observer in list(LoggerObserver._live):
            observer._report_at_exit()

    @staticmethod
    def _forget_modes_after_fork() -> None:
        """In a forked child every observer is a copy: its mode is resolved there again."""
        for observer in list(LoggerObserver._live):
            observer._mode = None

    def __getstate__(self) -> dict[str, Any]:
        """What a copy takes to where it runs (not this process's links)."""
        state = self.__dict__.copy()
        del state["_lock"]
        state["_channel_ref"] = state["_source"] = None
        state["_step_fn"] = None  # read where the channel lives (refused for copies elsewhere)
        state["_read_schedule_counter"] = None  # resolved again where the copy runs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._mode = threading.Lock(), None  # a copy's mode is resolved where it runs
        self._wire()
        self._live.add(self)

    def stats(self) -> dict[str, float]:
        """Entries contributed to the target's ``stats()`` (e.g. ``sample_calls``)."""
        return {key: value for m in self.metrics for key, value in m.stats().items()}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on where this one stopped.

        A :class:`~torchrl.checkpoint.Checkpoint` component: ``Checkpoint(..., observers=observer)``;
        the rules are :mod:`~rl_observers.logging.resume`'s. With copies elsewhere,
        the state is the aggregate kept by the channel's owner.

        Examples:
            >>> import torch
            >>> import rl_observers
            >>> import tempfile
            >>> from rl_observers import LoggerObserver, MetricsChannel
            >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
            >>> from torchrl.record import CSVLogger
            >>> logger = CSVLogger(exp_name="resume", log_dir=tempfile.mkdtemp())
            >>> rb = ReplayBuffer(storage=LazyTensorStorage(100))
            >>> observer = LoggerObserver(MetricsChannel(logger, background=False))
            >>> handle = rb.add_observer(observer)
            >>> _ = rb.extend(torch.arange(10)); _ = rb.sample(4)
            >>> state = observer.state_dict()
            >>> again = ReplayBuffer(storage=LazyTensorStorage(100))
            >>> other = CSVLogger(exp_name="resumed", log_dir=tempfile.mkdtemp())
            >>> resumed = LoggerObserver(MetricsChannel(other, background=False))
            >>> handle = again.add_observer(resumed)
            >>> resumed.load_state_dict(state)
            >>> resumed.stats()["sample_calls"], resumed.stats()["items_written"]
            (1, 10)
        """
        with self._lock:
            sets = self.metrics
            state: dict[str, Any] = {
                "version": STATE_VERSION,
                **describe(self.name, self._source_kind(), self.scope, sets),
                "schedule": self._schedule_spec(),
                "metrics": [m.state_dict() for m in sets],
                "clock": self._clock.state_dict(),
                "last_step": self._last_step,
            }
        if self._has_copies:
            state["aggregate"] = self._contribution.aggregate_state(self._channel(), self.name or "")
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict` (when attached, if called before).

        Raises:
            ValueError: the state does not fit (namespace, kind of source, scope or metric sets).
        """
        if self._sets is None:  # not attached yet: metric sets and name are resolved then
            self._pending_state = state_dict
            return
        sets = self.metrics
        problem = misfit(state_dict, describe(self.name, self._source_kind(), self.scope, sets))
        if problem is not None:
            raise ValueError(
                f"LoggerObserver {self.name!r}: cannot load this state: {problem}. Load it "
                "into an observer built like the one that saved it (same name=, scope= and "
                "metrics=)."
            )
        has_copies = self._has_copies
        with self._lock:
            # with copies elsewhere, the aggregate at the owner holds this instance's counts too
            for metric_set, state in zip(sets, () if has_copies else state_dict["metrics"]):
                metric_set.load_state_dict(state)
            if state_dict.get("schedule") == self._schedule_spec():
                self._clock.load_state_dict(state_dict["clock"])
            else:  # another schedule: its thresholds start from the restored counters
                self._clock = ScheduleClock(self.schedule)
                self._prime_clock()
            saved_step = state_dict.get("last_step")
            if saved_step is not None:
                self._last_step = max(int(saved_step), self._last_step or 0)
                self._emitted = True
            if not has_copies:  # resolved (and lined up) again at the next event
                self._align_pending = True
                self._mode = None
        if state_dict.get("aggregate") is not None:
            self._contribution.load_aggregate_state(self._channel(), self.name or "", state_dict["aggregate"])

    def _source_kind(self) -> str:
        """``"collector"`` or ``"replay_buffer"``: the source's, or what the metric sets count."""
        source = self._source() if self._source is not None else None
        if source is not None:
            return target_kind(source)
        names = {n for m in self.metrics for n in m.counters()}
        return "collector" if "frames" in names else "replay_buffer"

    def _schedule_spec(self) -> list[Any] | None:
        schedule = self.schedule
        return None if schedule is None else [schedule.kind, float(schedule.interval), schedule.key]

    def __repr__(self) -> str:
        fields = [] if self.name is None else [f"name={self.name!r}"]
        fields.append("schedule='auto'" if self._auto_schedule else f"schedule={self.schedule!r}")
        if self._sets is not None:
            fields.append(f"metrics=[{', '.join(type(m).__name__ for m in self._sets)}]")
        return f"LoggerObserver({', '.join(fields)})"


lifecycle.after_fork_in_child(LoggerObserver._forget_modes_after_fork)

