"""LoggerObserver: metric sets folded at the source, submitted on a schedule into a channel.

Step of the flow: **observer → channel** (source → observer → channel →
logger). The observer's metric sets fold events next to the data; when its
schedule (:mod:`~rl_observers.logging.schedule`) is due, it pulls their
partials and submits them to a :class:`~rl_observers.MetricsChannel`. Copies
running away from the channel contribute windows instead
(:mod:`~rl_observers.logging.contributions`), which the owner merges
(:mod:`~rl_observers.logging.aggregate`).
"""

from __future__ import annotations

import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import cloudpickle
from torchrl._utils import logger as torchrl_logger
from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.channel import MetricsChannel
from rl_observers.logging.aggregate import finish_aggregate, has_aggregate
from rl_observers.logging.contributions import LIVE, Contributor
from rl_observers.logging.defaults import (
    DEFAULT_NAMES,
    as_metric_sets,
    as_sink,
    check_sets_fit,
    default_metrics,
    default_schedule,
    target_kind,
)
from rl_observers.logging.schedule import ScheduleClock
from rl_observers.metrics import CollectorBatchMetrics, MetricSet, SampleMetrics, WriteMetrics
from rl_observers.metrics.keys import MissingKeyError
from rl_observers.metrics.source import missing_source_counters
from rl_observers.observer import ON_ERROR_POLICIES, Observer
from rl_observers.sources import observers_of

__all__ = ["LoggerObserver", "attach_logger", "install_attach_logger"]

#: Seconds a copy waits at its source's shutdown for its last window to be acknowledged by the
#: owner's ingest (a relay or ingest actor still starting on a busy node takes seconds); within
#: the source's own bound (30 s for the actors of a Ray source, see ``sources/ray.py``).
LAST_WINDOW_TIMEOUT = 20.0

Scope = Literal["aggregate", "per_worker", "both"]
SCOPES: tuple[str, ...] = ("aggregate", "per_worker", "both")
_DATA_EVENTS = ("post_collect", "post_add", "post_extend", "post_sample")
# Namespaces taken per logger (name -> the observer using it), so two observers on one
# logger never write into one namespace without being told, even through two channels.
_NAMES: weakref.WeakKeyDictionary[Any, weakref.WeakValueDictionary[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_NAMES_LOCK = threading.Lock()


def _names_on(channel: MetricsChannel) -> Any:
    """What namespaces are unique on: the channel's logger, or the channel if it cannot be a key."""
    logger = channel.logger
    try:
        weakref.ref(logger)
        hash(logger)
    except TypeError:
        return channel
    return logger


def _pickled_sets(sets: tuple[MetricSet, ...]) -> bytes:
    """``sets`` pickled, by value where they hold a lambda; ``b""`` when they cannot be pickled.

    (Sets that cannot be pickled cannot travel either: only a fork copies them, and its
    copy then keeps what the original had folded.)
    """
    try:
        return pickle.dumps(sets)
    except Exception:
        pass
    try:
        return cloudpickle.dumps(sets)
    except Exception:
        return b""


def _public_error_name(error: BaseException) -> str:
    """The name a message shows for ``error``: the builtin it stands for when its class is private."""
    cls = type(error)
    if isinstance(error, MissingKeyError) or cls.__name__.startswith("_"):
        cls = next(c for c in cls.__mro__ if c.__module__ == "builtins")
    return cls.__name__


def _frames_of(collector: BaseCollector) -> Callable[[], Any]:
    """``collector.stats()["frames"]``, holding the collector weakly."""
    ref = weakref.ref(collector)

    def frames() -> Any:
        target = ref()
        return None if target is None else target.stats().get("frames")

    return frames


def _fold_event(event: str) -> Callable[..., None]:
    """``LoggerObserver.on_<event>``: folds the payload into the sets, then checks the schedule.

    The check of a counter schedule inside its interval is inlined (one read,
    one comparison): this runs at every event, where each Python call costs
    ~0.5 us next to the source's cold caches.
    """
    folds_of = f"_{event}_folds"
    where = f"on_{event}"

    def on_event(self: LoggerObserver, source: Any, *payload: Any) -> None:
        if self._mode is None:
            self._resolve_mode(source)
        self._fresh = True  # before folding: a window closed meanwhile is not skipped
        for position, fold in getattr(self, folds_of):
            try:
                fold(source, *payload)
            except Exception as err:
                self._set_failed(position, err, where)
        self._fresh = True  # again: an emission from another thread may have pulled meanwhile
        if self._failing_sets:
            self._recovered(event)
        read = self._read_schedule_counter
        if read is not None and self._mode == "local" and (self._emitted or not self.log_on_start):
            counter = read()
            clock = self._clock
            last = clock.last_counter
            if last is not None and last <= counter < clock.next_threshold:
                clock.last_counter = counter  # one attribute store: no lock
                return
        self._after()

    on_event.__name__ = where
    on_event.__qualname__ = f"LoggerObserver.{where}"
    return on_event


class LoggerObserver(Contributor, Observer):
    """Folds what a source sees into metrics and logs them on a schedule.

    The metric sets fold every batch, write or sample into mergeable partial
    statistics next to the data, on the data's device and without a
    host-device sync. When the schedule is due, the window's partials reach
    the host in one transfer and are submitted to a
    :class:`~rl_observers.MetricsChannel`, which returns at once and logs
    from its own thread: a slow, hung or failing logger never slows the
    source down. Every event is folded; the schedule only decides when a
    window is emitted.

    Metrics are logged as ``<name>/<metric>``, each namespace with its own
    step (the schedule's counter by default), so collector frames, buffer
    writes and buffer samples never fight over one step. To overlay them
    instead, give every observer one step source: ``step=collector`` (its
    frames) or ``step=callable`` (say, the optimizer step you own).

    Each metric set fails alone: a set that raises (a key missing from the
    data, a bug in a custom set) is reported once per failure streak, with a
    WARNING naming the set, the error and the fix, and the observer's other
    sets keep logging. With ``on_error="raise"`` (here or in
    ``add_observer``) the error reaches the caller instead.

    Misconfigurations fail when the observer is constructed or attached, with
    a message saying what to do instead: a logger class instead of an
    instance, a metric-set class instead of an instance, a metric set that
    folds none of the events the target emits (``SampleMetrics`` on a
    collector), two sets logging the same name, a namespace already used on
    the same logger by another observer.

    Args:
        logger (Logger | MetricsChannel | MetricsHandle): where the metrics go.
            A torchrl logger *instance* (direct or a logger service) gets the
            channel shared by everything logging to it
            (:meth:`MetricsChannel.for_logger`).

    Keyword Args:
        schedule (Every | str, optional): when to emit: ``Every.counter(key, n)``
            over a counter the metrics see (``frames``, ``batches``,
            ``episodes``, ``write_count``, ``items_written``,
            ``sample_calls``, ``samples_returned``) or ``Every.seconds(s)``.
            Defaults to ``"auto"``: ``Every.counter("frames", 1_000)`` on a
            collector, ``Every.counter("sample_calls", 100)`` on a replay
            buffer (``Every.counter("items_written", 1_000)`` if its sets
            count no samples; see :func:`default_schedule`). ``None`` emits after every
            data event (each batch, write or sample). ``Every`` refuses
            intervals ``<= 0``; a NaN interval is refused here; an infinite
            one never fires (only ``log_on_start`` / ``log_on_close`` emit).
        metrics (MetricSet | Sequence[MetricSet], optional): what to fold
            (instances, not classes). Defaults to :func:`default_metrics`
            for the target: batch metrics on a collector, write and sample
            metrics on a buffer.
        name (str, optional): the namespace. Defaults to ``"collector"`` on
            any torchrl collector and ``"replay_buffer"`` on any replay
            buffer. A name another attached observer already uses on the
            same logger (or channel) is refused: pass ``name=`` to tell
            them apart. The name is freed when the observer is removed or
            its source shuts down.
        scope (str, optional): for sources with several workers:
            ``"aggregate"`` (default) merges all workers' partials,
            ``"per_worker"`` logs ``<name>/worker_<i>/<metric>``, ``"both"``
            does both.
        step (str | Callable[[], int] | collector, optional): the logged
            step. A counter name of the metric sets (``"frames"``,
            ``"sample_calls"``, ...); a torchrl collector, to log against
            its frames (``collector.stats()["frames"]``), so that buffer
            metrics line up with collector metrics; or a callable returning
            the step (the optimizer step you own), read when a window is
            emitted. Defaults to the schedule's counter, else the first
            counter of the first metric set (``frames`` for a collector).
            A collector or callable step is read in the channel's process:
            observers whose copies run elsewhere (multiprocessing or Ray
            collectors, shared buffers) take a counter name.
        log_on_start (bool, optional): emit at the first data event whatever
            the schedule. Defaults to ``False``.
        log_on_close (bool, optional): emit the last partial window when the
            observer is removed, the target shuts down, or the channel
            closes. With ``False``, rows the schedule made due are still
            logged: copies away from the channel always send their last
            window, and the owner drops only the trailing partial window
            (below the next threshold). Defaults to ``True``.
        on_error (str, optional): the default error policy when attached
            (``"warn"``, ``"raise"`` or ``"ignore"``). Defaults to ``"warn"``.
        report_interval (float, optional): copies running away from the
            channel (workers, actors) send their window to the channel's
            owner at least this often in seconds, and whenever their own
            schedule counter advanced by an interval; the owner applies the
            schedule and the scope (see :mod:`rl_observers.logging.aggregate`).
            Defaults to ``0.5``.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> import rl_observers
        >>> from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.record import CSVLogger
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> logger = CSVLogger(exp_name="demo", log_dir=tempfile.mkdtemp())
        >>> env = CountingEnv(max_steps=5)
        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=40)
        >>> channel = MetricsChannel(logger)
        >>> handle = collector.add_observer(
        ...     LoggerObserver(channel, schedule=Every.counter("frames", 20), metrics=CollectorBatchMetrics())
        ... )
        >>> for _ in collector:
        ...     pass
        >>> collector.shutdown()
        >>> channel.close()
        True
        >>> [step for step, _ in logger.experiment.scalars["collector/frames"]]
        [20, 40]

        Buffer metrics logged against the collector's frames:

        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100))
        >>> channel = MetricsChannel(logger, background=False)
        >>> handle = rb.add_observer(
        ...     LoggerObserver(channel, schedule=Every.counter("sample_calls", 1), step=collector)
        ... )
        >>> _ = rb.extend(torch.arange(10)); _ = rb.sample(4)
        >>> channel.close()
        True
        >>> [step for step, _ in logger.experiment.scalars["replay_buffer/sample_calls"]]
        [40]
        >>> sorted(name for name in logger.experiment.scalars if "episode" in name)[:3]
        ['collector/episode_length_max', 'collector/episode_length_mean', 'collector/episode_length_min']
    """

    def __init__(
        self,
        logger: Any,
        *,
        schedule: Every | Literal["auto"] | None = "auto",
        metrics: MetricSet | Sequence[MetricSet] | None = None,
        name: str | None = None,
        scope: Scope = "aggregate",
        step: str | Callable[[], int] | BaseCollector | None = None,
        log_on_start: bool = False,
        log_on_close: bool = True,
        on_error: str = "warn",
        report_interval: float = 0.5,
    ) -> None:
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
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of 'warn', 'raise' or 'ignore', got {on_error!r}.")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty string, got {name!r}.")
        step_fn: Callable[[], Any] | None = None
        if isinstance(step, BaseCollector):
            step_fn = _frames_of(step)
            step = None
        elif step is not None and not isinstance(step, str):
            if not callable(step):
                raise TypeError(
                    "step must be a counter name (\"frames\", \"sample_calls\", ...), a torchrl "
                    f"collector or a callable returning the step, got {step!r}."
                )
            step_fn, step = step, None
        self._sink, channel = as_sink(logger)
        self._channel_ref = weakref.ref(channel) if channel is not None else None
        self._sets = as_metric_sets(metrics)
        self.schedule = schedule
        self._auto_schedule = auto
        self.name = name
        self._name_given = name is not None
        self.scope = scope
        self.step_key = step
        self._step_fn = step_fn
        self._failing_sets: set[int] = set()  # metric sets in a failure streak (by position)
        self._failed_now: set[int] = set()  # those that failed during the current event
        self.log_on_start = log_on_start
        self.log_on_close = log_on_close
        self.on_error = on_error
        self._policy = on_error  # the policy in force once attached (add_observer may override it)
        self._clock = ScheduleClock(schedule)
        self._lock = threading.Lock()
        self._folds: dict[str, tuple[Any, ...]] = {}
        self._post_collect_folds: tuple[Any, ...] = ()
        self._post_add_folds: tuple[Any, ...] = ()
        self._post_extend_folds: tuple[Any, ...] = ()
        self._post_sample_folds: tuple[Any, ...] = ()
        self._read_schedule_counter: Callable[[], Any] | None = None
        self._source: weakref.ref[Any] | None = None
        self._fresh = False  # data folded since the last emission
        self._emitted = False
        self._pristine: bytes | None = None
        self.report_interval = report_interval
        self._home_pid = os.getpid()
        self._mode: str | None = None  # "local" or "contribute", resolved at the first event
        self._holds_name = False  # whether ``name`` is taken on the logger for this observer
        self._worker: Any = None
        self._last_report = 0.0
        self._last_report_counter = 0.0
        LIVE.add(self)

    # -- wiring, resolved once when attached ------------------------------------------------

    @property
    def observed_events(self) -> tuple[str, ...]:
        """The events this observer is wired to (those its metric sets fold, and shutdown)."""
        sets = self._sets or (CollectorBatchMetrics, WriteMetrics, SampleMetrics)
        folded = {event for m in sets for event in m.events}
        if any(callable(getattr(m, "on_empty", None)) for m in sets):
            folded.add("empty")
        return (*sorted(folded), "shutdown")

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
        observers = observers_of(source)
        for entry in observers.entries if observers is not None else ():
            if entry.observer is self:  # add_observer(..., on_error=) overrides the observer's own
                self._policy = entry.on_error
        if self.log_on_close:
            channel = self._channel()
            if channel is not None:
                channel.add_close_callback(self._close_window)

    def detached(self, source: Any) -> None:
        try:
            # A copy always sends what it holds: the owner's aggregate applies log_on_close.
            if self.log_on_close or self._mode == "contribute":
                self._close_window(final=self._mode == "contribute")
            if self._mode == "contribute":
                self._sink.flush(timeout=LAST_WINDOW_TIMEOUT)  # acknowledged before detach returns
        finally:
            self._release_name()

    def prepare_copies(self, target: Any) -> None:
        """Called on the original, in the driver, before copies go where ``target``'s data is.

        Fixes what every copy must share: the metric sets (chosen for
        ``target``), the namespace and the step counter.
        """
        if self._step_fn is not None:
            raise ValueError(
                "LoggerObserver: step= a collector or a callable is read where the channel lives, "
                f"but this {type(target).__name__}'s observers run in other processes; pass a "
                'counter name instead, e.g. step="frames".'
            )
        self._bind(target)
        channel = self._channel()
        if channel is not None:  # closing the channel before the copies are gone loses their windows
            channel.copies_attached(self, f"LoggerObserver {self.name!r} on a {type(target).__name__}")

    def copies_removed(self, target: Any) -> None:
        """Called on the original once its copies are gone: logs the last aggregate windows.

        That is when the last copy was detached, or when ``target`` shut
        down (its workers or actors, and the copies in them, are gone). The
        namespace is free afterwards. Does nothing the second time: by then
        another observer may use the namespace, and finishing it again would
        cut that observer's window short.
        """
        channel = self._channel()
        if channel is not None:
            channel.copies_gone(self)
        if not self._holds_name:
            return
        try:
            if channel is not None and self.name is not None and not channel.closed:
                finish_aggregate(channel, self.name)
        finally:
            self._release_name()

    def _bind(self, source: Any) -> None:
        """Resolves defaults, names and counters once, for ``source`` (a local one or a remote one)."""
        kind = target_kind(source)
        if self._sets is None:
            self._sets = default_metrics(source)
        else:
            check_sets_fit(self._sets, source)
        for metric_set in self._sets:
            metric_set.bind(source)
        counters = missing_source_counters(source, self._sets)  # the source's own, for schedules
        if counters is not None:
            self._sets = (*self._sets, counters)
        if self._auto_schedule:
            self.schedule = default_schedule(source, self._sets)
            self._clock = ScheduleClock(self.schedule)
            self._auto_schedule = False
        if self._pristine is None:  # what a copy restarts from where it runs (see _resolve_mode)
            self._pristine = _pickled_sets(self._sets)
        self._wire()
        counters = self._counters()
        key = self.schedule.key if self.schedule is not None and self.schedule.kind == "counter" else None
        for wanted, argument in ((key, "Every.counter(key, n)"), (self.step_key, "step=")):
            if wanted is not None and wanted not in counters:
                sets = ", ".join(type(m).__name__ for m in self._sets)
                raise ValueError(
                    f"LoggerObserver: {argument} names the counter {wanted!r}, which none of its "
                    f"metric sets ({sets}) counts; use one of {sorted(counters)}."
                )
        if self.step_key is None:
            self.step_key = key or next(iter(counters), None)
        if key is not None:
            self._clock.due(counters[key])  # primes the schedule at the counters' current value
        self._claim_name(DEFAULT_NAMES[kind] if self.name is None else self.name)

    def _wire(self) -> None:
        """Resolves the per-event work once: each event's folds, and how to read the schedule's counter."""
        self._folds = {
            event: tuple(
                (index, getattr(m, "on_" + event))
                for index, m in enumerate(self._sets or ())
                if event in m.folded_events
            )
            for event in _DATA_EVENTS
        }
        folds = self._folds
        self._post_collect_folds = folds["post_collect"]
        self._post_add_folds = folds["post_add"]
        self._post_extend_folds = folds["post_extend"]
        self._post_sample_folds = folds["post_sample"]
        self._read_schedule_counter = self._schedule_counter_reader()

    def _schedule_counter_reader(self) -> Callable[[], Any] | None:
        """A call reading the counter schedule's counter as ``_counters()`` would, or ``None``.

        The sets later in the list win in ``_counters()``: the last set counting the key is read.
        """
        schedule = self.schedule
        if schedule is None or schedule.kind != "counter":
            return None
        for metric_set in reversed(self._sets or ()):
            if schedule.key in metric_set.counters():
                return metric_set._counter_reader(schedule.key)
        return None

    def _set_failed(self, index: int, error: Exception, where: str) -> None:
        """One metric set raised: the policy applies to it alone; the other sets go on."""
        if self._policy == "raise":
            raise error
        if self._policy == "warn" and index not in self._failing_sets:
            metric_set = (self._sets or ())[index]
            torchrl_logger.warning(
                f"rl_observers: LoggerObserver {self.name!r}: metric set {metric_set!r} raised in "
                f"{where} ({_public_error_name(error)}: {error}). Its metrics are skipped (no rows) until "
                "it succeeds again (reported once per failure streak); the observer's other metric "
                "sets keep logging. Fix the set's configuration, or attach with "
                'on_error="raise" to stop at the error.'
            )
        self._failing_sets.add(index)
        self._failed_now.add(index)

    def _recovered(self, event: str) -> None:
        """Ends the failure streak of the sets that folded ``event`` without raising this time."""
        for position, _ in self._folds[event]:
            if position not in self._failed_now:
                self._failing_sets.discard(position)
        self._failed_now.clear()

    def _channel(self) -> MetricsChannel | None:
        return self._channel_ref() if self._channel_ref is not None else None

    def _claim_name(self, name: str) -> None:
        """Takes ``name`` on the channel; refuses a name another attached observer uses there."""
        channel = self._channel()
        if channel is not None:
            with _NAMES_LOCK:
                taken = _NAMES.setdefault(_names_on(channel), weakref.WeakValueDictionary())
                other = taken.get(name)
                if other is not None and other is not self:
                    hint = "" if self._name_given else " (the default for this kind of target)"
                    raise ValueError(
                        f"LoggerObserver: the namespace {name!r}{hint} is already used on this "
                        f"logger by {other!r}; pass name= to tell them apart, e.g. "
                        f"name={name + '_2'!r}."
                    )
                taken[name] = self
        self.name = name
        self._holds_name = True

    def _release_name(self) -> None:
        self._holds_name = False
        channel = self._channel()
        if channel is None or self.name is None:
            return
        with _NAMES_LOCK:
            taken = _NAMES.get(_names_on(channel))
            if taken is not None and taken.get(self.name) is self:
                del taken[self.name]

    def _claim_name_again(self) -> None:
        """Takes the namespace back for a source used again after its shutdown freed it.

        A torchrl replay buffer still takes writes after ``shutdown()``.
        If another observer took the namespace meanwhile, this window is not
        logged: the error goes through the observer's ``on_error`` policy
        (one warning per failure streak by default) rather than mixing two
        sources' rows in one namespace.
        """
        name = self.name or ""
        try:
            self._claim_name(name)
        except ValueError:
            source = self._source() if self._source is not None else None
            what = "its source" if source is None else f"its {type(source).__name__}"
            raise ValueError(
                f"LoggerObserver {name!r}: {what} is used again after shutdown(), which freed "
                f"the namespace {name!r}, and another observer now uses it on this logger; "
                "this window is not logged. Remove this observer, or attach one of them "
                "with another name=."
            ) from None

    def _counters(self) -> dict[str, float]:
        counters: dict[str, float] = {}
        for metric_set in self._sets or ():
            counters.update(metric_set.counters())
        return counters

    # -- events -----------------------------------------------------------------------------

    def _after(self) -> None:
        """Emits, contributes or advances the schedule after an event (see :func:`_fold_event`)."""
        with self._lock:
            if self._mode == "contribute":
                if self._report_due():
                    self._contribute()
                return
            schedule = self.schedule
            counters = None
            if schedule is not None and schedule.kind == "counter":
                counters = self._counters()
                due = self._clock.due(counters.get(schedule.key))
            else:  # no schedule or a time one: counters are read only when a window is emitted
                due = self._clock.due(None)
            if not due and self.log_on_start and not self._emitted:
                due = True
            if due:
                self._emit(self._counters() if counters is None else counters)

    def _pull(self) -> dict[str, Any]:
        # Before pulling: an event folded meanwhile (from another thread) marks the next window.
        self._fresh = False
        payload: dict[str, Any] = {}
        for index, metric_set in enumerate(self._sets or ()):
            if index in self._failing_sets:  # its window waits for its recovery: no rows of zeros
                continue
            try:
                payload.update(metric_set.pull())
            except Exception as err:
                self._set_failed(index, err, "pull")
        self._failed_now.clear()
        return payload

    def _emit(self, counters: Mapping[str, float]) -> None:
        if not self._holds_name and self._channel_ref is not None:
            self._claim_name_again()  # the namespace was freed when the source shut down
        channel = self._channel()
        if channel is not None and has_aggregate(channel, self.name or ""):
            # copies elsewhere contribute to this name: this instance becomes one more contributor
            self._mode = "contribute"
            self._worker = "main"
            self._contribute()
            return
        if self._step_fn is not None:
            step = self._step_fn()
        else:
            step = counters.get(self.step_key) if self.step_key else None
        payload = self._pull()
        self._clock.fired()
        self._emitted = True
        self._sink.submit_metrics(
            payload, None if step is None else int(step), namespace=self.name or ""
        )

    def _close_window(self, final: bool = False) -> None:
        """Sends the open window; ``final``: a copy's last one, sent even if empty (the owner's account)."""
        with self._lock:
            if final and self._mode == "contribute":
                self._contribute(final=True)
                return
            if not self._fresh:
                return
            if self._mode == "contribute":
                self._contribute()
            else:
                self._emit(self._counters())

    on_post_collect = _fold_event("post_collect")
    on_post_add = _fold_event("post_add")
    on_post_extend = _fold_event("post_extend")
    on_post_sample = _fold_event("post_sample")

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

    def on_shutdown(self, source: Any) -> None:
        if self._mode == "contribute":
            # Always sent: the final counters may make rows due at the owner, whose aggregate
            # drops the trailing partial window itself when log_on_close is False.
            self._close_window(final=True)
            self._sink.flush(timeout=LAST_WINDOW_TIMEOUT)  # acknowledged before the process may end
            return
        try:
            if self.log_on_close:
                self._close_window()
        finally:
            # The source's last window is logged: its namespace is free for the next source
            # (a collector rebuilt in a loop), without waiting for this observer to be
            # garbage-collected. A contributing observer keeps it: its copies elsewhere may
            # still send windows under that name.
            self._release_name()

    # -- pull interop and checkpoints ----------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Entries contributed to the target's ``stats()`` (e.g. ``sample_calls``)."""
        out: dict[str, float] = {}
        for metric_set in self._sets or ():
            out.update(metric_set.stats())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Metric-set state (in-flight episodes, counters) and the schedule's baseline."""
        with self._lock:
            return {
                "metrics": [m.state_dict() for m in self._sets or ()],
                "schedule": self._clock.state_dict(),
            }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`; call after attaching (metric sets exist then)."""
        states = state_dict["metrics"]
        sets = self._sets or ()
        if len(states) != len(sets):
            raise ValueError(
                f"state_dict holds {len(states)} metric sets, this observer has {len(sets)}."
            )
        with self._lock:
            for metric_set, state in zip(sets, states):
                metric_set.load_state_dict(state)
            self._clock.load_state_dict(state_dict["schedule"])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_channel_ref"] = None
        state["_source"] = None
        state["_step_fn"] = None  # read where the channel lives (refused for copies elsewhere)
        state["_read_schedule_counter"] = None  # resolved again where the copy runs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._mode = None  # a copy: resolved again where it runs
        if self._sets is not None:
            self._wire()
        LIVE.add(self)

    def __repr__(self) -> str:
        # Before attaching, defaults are not resolved yet: show what was passed, never a
        # placeholder such as ``schedule=None`` (which would mean "every event").
        fields = []
        if self.name is not None:
            fields.append(f"name={self.name!r}")
        fields.append("schedule='auto'" if self._auto_schedule else f"schedule={self.schedule!r}")
        if self._sets is not None:
            fields.append(f"metrics=[{', '.join(type(m).__name__ for m in self._sets)}]")
        return f"LoggerObserver({', '.join(fields)})"


def attach_logger(
    self: Any,
    logger: Any,
    *,
    schedule: Every | Literal["auto"] | None = "auto",
    metrics: MetricSet | Iterable[MetricSet] | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Logs this source's metrics: ``add_observer(LoggerObserver(logger, ...))`` in one line.

    Metrics default to those fitting the source (:func:`default_metrics`),
    the schedule to one that does not flood (``"auto"``: every 1,000 frames
    on a collector, every 100 ``sample()`` calls on a replay buffer, see
    :func:`default_schedule`), the namespace to ``"collector"`` or
    ``"replay_buffer"``. Returns the same handle as :meth:`add_observer`.

    Args:
        logger (Logger | MetricsChannel | MetricsHandle): where the metrics go.

    Keyword Args:
        schedule (Every | str, optional): see :class:`LoggerObserver`.
            Defaults to ``"auto"``.
        metrics (MetricSet | Sequence[MetricSet], optional): see :class:`LoggerObserver`.
        name (str, optional): see :class:`LoggerObserver`.
        **kwargs: the other keyword arguments of :class:`LoggerObserver`.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> import rl_observers
        >>> from rl_observers import Every
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl.record import CSVLogger
        >>> logger = CSVLogger(exp_name="sugar", log_dir=tempfile.mkdtemp())
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100))
        >>> handle = rb.attach_logger(logger, schedule=Every.counter("sample_calls", 2))
        >>> _ = rb.extend(torch.arange(10))
        >>> for _ in range(4):
        ...     _ = rb.sample(5)
        >>> handle.remove()
        >>> rl_observers.MetricsChannel.for_logger(logger).flush(timeout=10)
        True
        >>> [step for step, _ in logger.experiment.scalars["replay_buffer/samples_returned"]]
        [2, 4]
    """
    observer = LoggerObserver(logger, schedule=schedule, metrics=metrics, name=name, **kwargs)
    return self.add_observer(observer)


def install_attach_logger() -> None:
    """Adds :func:`attach_logger` to torchrl's collectors and replay buffers (idempotent)."""
    from torchrl.data import ReplayBuffer

    for cls in (BaseCollector, ReplayBuffer):
        cls.attach_logger = attach_logger  # type: ignore[attr-defined]
