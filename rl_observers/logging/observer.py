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

import pickle
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from time import monotonic as _monotonic
from typing import Any, Literal

import cloudpickle
from torchrl._utils import logger as torchrl_logger
from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.channel import MetricsChannel
from rl_observers.channel.meta import COUNTERS, LAST
from rl_observers.logging.aggregate import (
    AggregateSpec,
    aggregate_state,
    finish_aggregate,
    has_aggregate,
    load_aggregate_state,
)
from rl_observers.logging.contributions import LIVE, Contribution, copy_worker
from rl_observers.logging.defaults import (
    DEFAULT_NAMES,
    as_metric_sets,
    as_sink,
    check_sets_fit,
    default_metrics,
    default_schedule,
    target_kind,
)
from rl_observers.logging.namespaces import claim, release
from rl_observers.logging.resume import (
    AXIS_COUNTERS,
    STATE_VERSION,
    describe,
    misfit,
    shift_counters,
    source_axis,
)
from rl_observers.logging.schedule import ScheduleClock
from rl_observers.metrics import CollectorBatchMetrics, MetricSet, SampleMetrics, WriteMetrics
from rl_observers.metrics.keys import MissingKeyError
from rl_observers.metrics.source import missing_source_counters
from rl_observers.observer import Observer, check_on_error
from rl_observers.sources import observers_of

__all__ = ["LoggerObserver"]

#: Seconds a copy waits at its source's shutdown for its last window to be acknowledged by the
#: owner's ingest (a relay or ingest actor still starting on a busy node takes seconds); within
#: the source's own bound (30 s for the actors of a Ray source, see ``sources/ray.py``).
LAST_WINDOW_TIMEOUT = 20.0

Scope = Literal["aggregate", "per_worker", "both"]
SCOPES: tuple[str, ...] = ("aggregate", "per_worker", "both")
_DATA_EVENTS = ("post_collect", "post_add", "post_extend", "post_sample")


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
        if self._mode is None:  # the first event since attached, forked or loaded
            self._first_event(event, source, payload)
            return
        self._fresh = True  # before folding: a window closed meanwhile is not skipped
        for position, fold in getattr(self, folds_of):
            try:
                fold(source, *payload)
            except Exception as err:
                self._set_failed(position, err, where)
        self._fresh = True  # again: an emission from another thread may have pulled meanwhile
        if self._failing_sets:
            self._recovered(event)
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
        check_on_error(on_error)
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
        self._schedule_seconds: float | None = None  # a seconds schedule's interval
        self._source: weakref.ref[Any] | None = None
        self._fresh = False  # data folded since the last emission
        self._emitted = False
        self.report_interval = report_interval
        self._contribution = Contribution()  # the copies' side: where it runs, when it reported
        # "local" or "contribute": fixed at the first event in each process (see Contribution.resolve)
        self._mode: str | None = None
        self._holds_name = False  # whether ``name`` is taken on the logger for this observer
        self._align_pending = False  # line the counters up with the source's at the next event
        self._last_step: int | None = None  # the last step submitted: steps never go backwards
        self._pending_state: Mapping[str, Any] | None = None  # loaded before attaching
        self._has_copies = False  # copies run elsewhere: the aggregate at the owner is the state
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
        self._align_pending = True
        self._mode = None  # resolved (and the counters lined up) at the next event
        if self._contribution.moved():
            # a copy, where its data is: it reports its end even if no event comes (the owner
            # expects to hear from every copy attached)
            self._resolve_mode(source)
        observers = observers_of(source)
        for entry in observers.entries if observers is not None else ():
            if entry.observer is self:  # add_observer(..., on_error=) overrides the observer's own
                self._policy = entry.on_error
        if self.log_on_close:
            channel = self._channel()
            if channel is not None:
                channel.add_close_callback(self._close_window)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

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
        self._has_copies = True
        # from now on this instance is one more contributor to its copies' aggregate (worker
        # "main"): the driver may write into a shared buffer too
        self._mode = self._contribution.join_as_original()
        channel = self._channel()
        if channel is not None:  # closing the channel before the copies are gone loses their windows
            channel.copies_attached(self, f"LoggerObserver {self.name!r} on a {type(target).__name__}")
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def copies_placed(self, target: Any, workers: tuple[int | None, ...]) -> None:
        """Called on the original once its copies are attached in ``workers`` of ``target``.

        The channel's owner then expects each of them to report: a copy
        never heard from (its worker killed before its first window arrived)
        is counted lost instead of being invisible.
        """
        channel = self._channel()
        if channel is not None:
            channel.copies_expected(self, [copy_worker(w) for w in workers])

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
        if self._contribution.pristine is None:  # what a copy restarts from where it runs
            self._contribution.pristine = _pickled_sets(self._sets)
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
        schedule = self.schedule
        self._schedule_seconds = (
            float(schedule.interval) if schedule is not None and schedule.kind == "seconds" else None
        )

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

    def _resolve_mode(self, source: Any) -> None:
        """Fixes the mode for this process: local, or contributing (see :class:`Contribution`)."""
        self._mode, sets = self._contribution.resolve(source, has_copies=self._has_copies)
        if sets is not None:
            self._sets = sets
            self._wire()

    def _contribute(self, final: bool = False) -> None:
        """Sends this copy's window to the channel's owner, which merges it (see ``aggregate``).

        ``final``: the copy's last window, which the owner's account expects
        (:mod:`~rl_observers.channel.account`); with nothing new since the
        previous window it is only the marker, without counters.
        """
        namespace = f"{self.name}/worker_{self._contribution.worker}"
        counters = self._counters()
        latest = tuple(g for m in self._sets or () for g in m.latest_gauges)
        spec = AggregateSpec(self.schedule, self.step_key, self.scope, self.log_on_close, latest)
        if final and not self._fresh:
            meta = self._contribution.meta(self.name, counters, spec)
            del meta[COUNTERS]
            meta[LAST] = True
            self._sink.submit_metrics({}, namespace=namespace, meta=meta)
            return
        meta = self._contribution.meta(self.name, counters, spec)
        if final:
            meta[LAST] = True
        self._sink.submit_metrics(self._pull(), namespace=namespace, meta=meta)

    def _first_event(self, event: str, source: Any, payload: tuple[Any, ...]) -> None:
        """The first event since attached, forked or loaded: the mode, then the source's axis.

        Folds like :func:`_fold_event`; a local observer then lines its
        counters up with the source's (:mod:`~rl_observers.logging.resume`).
        """
        self._resolve_mode(source)
        align = self._align_pending and self._mode == "local"
        self._align_pending = False
        before = self._counters() if align else None
        self._fresh = True
        for position, fold in getattr(self, f"_{event}_folds"):
            try:
                fold(source, *payload)
            except Exception as err:
                self._set_failed(position, err, f"on_{event}")
        self._fresh = True
        if self._failing_sets:
            self._recovered(event)
        if before is not None:
            self._align(source, before)
        self._after()

    def _align(self, source: Any, before: Mapping[str, float]) -> None:
        """Moves counters below the source's own (restored, or counted before attaching) up to it."""
        axis = source_axis(source)
        if axis is None:
            return
        schedule = self.schedule
        key = schedule.key if schedule is not None and schedule.kind == "counter" else None
        with self._lock:
            counters = self._counters()
            for counter, value in axis.items():
                ours = counters.get(counter)
                if ours is None or value <= ours:
                    continue  # the observer's own count is ahead (its saved state): steps go on
                names = AXIS_COUNTERS[counter]
                offset = int(value - ours)
                shift_counters(self._sets or (), names, offset)
                if key in names:  # the threshold the source's axis had before this event
                    prior = before.get(key, 0) + offset
                    if self._clock.last_counter is None or prior > self._clock.last_counter:
                        self._clock.rebase(prior)

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
            hint = "" if self._name_given else " (the default for this kind of target)"
            claim(channel, name, self, hint=hint)
        self.name = name
        self._holds_name = True

    def _release_name(self) -> None:
        self._holds_name = False
        channel = self._channel()
        if channel is not None and self.name is not None:
            release(channel, self.name, self)

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
                if self._contribution.due(self.schedule, self.report_interval, self._counters):
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
            # copies of a shared buffer, pickled with it, contribute to this name: this instance
            # becomes one more contributor (the original is not told when such copies start)
            self._mode = self._contribution.join_as_original()
            self._contribute()
            return
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
        """What a resumed run needs to go on where this one stopped.

        The metric sets' state (lifetime counters such as ``episodes``,
        ``items_written``, ``sample_calls``, ``samples_returned``; rolling
        episode windows; the running sums of episodes in flight), the
        schedule's baseline and the last step logged. For a source whose
        copies run elsewhere (multiprocessing workers, Ray actors), the
        aggregate kept by the channel's owner. A
        :class:`~torchrl.checkpoint.Checkpoint` component in one line:
        ``Checkpoint(..., observers=observer)``.

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
            sets = self._sets or ()
            state: dict[str, Any] = {
                "version": STATE_VERSION,
                **describe(self.name, self._kind(), self.scope, sets),
                "schedule": self._schedule_spec(),
                "metrics": [m.state_dict() for m in sets],
                "clock": self._clock.state_dict(),
                "last_step": self._last_step,
            }
        if self._has_copies:
            state["aggregate"] = aggregate_state(self._channel(), self.name or "")
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`: counters, windows and steps go on from there.

        Call it before or after attaching (before, it applies when
        attached). A state that does not fit this observer (another
        namespace, kind of source, scope or list of metric sets) is refused
        with a message naming the difference. Counters follow the source's
        own at the next event (see :mod:`~rl_observers.logging.resume`); a
        state saved further than what it replaces never makes steps go
        backwards.

        Raises:
            ValueError: the state does not fit this observer.
        """
        if self._sets is None:  # not attached yet: metric sets and name are resolved then
            self._pending_state = state_dict
            return
        sets = self._sets
        problem = misfit(state_dict, describe(self.name, self._kind(), self.scope, sets))
        if problem is not None:
            raise ValueError(
                f"LoggerObserver {self.name!r}: cannot load this state: {problem}. Load it "
                "into an observer built like the one that saved it (same name=, scope= and "
                "metrics=)."
            )
        with self._lock:
            # with copies elsewhere, the aggregate at the owner holds this instance's counts too
            for metric_set, state in zip(sets, () if self._has_copies else state_dict["metrics"]):
                metric_set.load_state_dict(state)
            if state_dict.get("schedule") == self._schedule_spec():
                self._clock.load_state_dict(state_dict["clock"])
            else:  # another schedule: its thresholds start from the restored counters
                self._clock = ScheduleClock(self.schedule)
                self._prime_clock()
            saved_step = state_dict.get("last_step")
            if saved_step is not None and (self._last_step is None or saved_step > self._last_step):
                self._last_step = int(saved_step)
            self._emitted = self._emitted or saved_step is not None
            if not self._has_copies:  # resolved (and lined up) again at the next event
                self._align_pending = True
                self._mode = None
        if state_dict.get("aggregate") is not None:
            load_aggregate_state(self._channel(), self.name or "", state_dict["aggregate"])

    def _kind(self) -> str:
        source = self._source() if self._source is not None else None
        if source is not None:
            return target_kind(source)
        names = {n for m in self._sets or () for n in m.counters()}
        return "collector" if "frames" in names else "replay_buffer"

    def _schedule_spec(self) -> list[Any] | None:
        schedule = self.schedule
        return None if schedule is None else [schedule.kind, float(schedule.interval), schedule.key]

    def _prime_clock(self) -> None:
        schedule = self.schedule
        if schedule is not None and schedule.kind == "counter":
            value = self._counters().get(schedule.key)
            if value is not None:
                self._clock.due(value)

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
