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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.channel import MetricsChannel, MetricsHandle
from rl_observers.logging.aggregate import finish_aggregate, has_aggregate
from rl_observers.logging.contributions import LIVE, Contributor
from rl_observers.logging.schedule import ScheduleClock
from rl_observers.metrics import CollectorBatchMetrics, MetricSet, SampleMetrics, WriteMetrics
from rl_observers.metrics.oneliners import check_metric_names, missing_source_counters
from rl_observers.observer import ON_ERROR_POLICIES, Observer

__all__ = ["LoggerObserver", "attach_logger", "default_metrics", "install_attach_logger"]

Scope = Literal["aggregate", "per_worker", "both"]
SCOPES: tuple[str, ...] = ("aggregate", "per_worker", "both")
_DATA_EVENTS = ("post_collect", "post_add", "post_extend", "post_sample")
# Names already given per channel, so two observers on one logger never share a namespace.
_NAMES: weakref.WeakKeyDictionary[MetricsChannel, set[str]] = weakref.WeakKeyDictionary()
_NAMES_LOCK = threading.Lock()
def default_metrics(target: Any) -> tuple[MetricSet, ...]:
    """The metric sets a :class:`LoggerObserver` uses when given none.

    Collectors get :class:`~rl_observers.CollectorBatchMetrics`; replay
    buffers get :class:`~rl_observers.WriteMetrics` and
    :class:`~rl_observers.SampleMetrics`. The sets are bound to ``target``
    (:meth:`MetricSet.bind <rl_observers.MetricSet.bind>`): a collector's
    reward and done keys come from its env's specs.

    Examples:
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from rl_observers import default_metrics
        >>> [type(m).__name__ for m in default_metrics(ReplayBuffer(storage=LazyTensorStorage(4)))]
        ['WriteMetrics', 'SampleMetrics']
    """
    if isinstance(target, BaseCollector):
        sets: tuple[MetricSet, ...] = (CollectorBatchMetrics(),)
    else:
        sets = (WriteMetrics(), SampleMetrics())
    for metric_set in sets:
        metric_set.bind(target)  # keys from the target's specs (the env's reward and done keys)
    return sets


def _as_sink(logger_or_channel: Any) -> tuple[MetricsHandle, MetricsChannel | None]:
    if isinstance(logger_or_channel, MetricsHandle):
        return logger_or_channel, None
    if isinstance(logger_or_channel, MetricsChannel):
        channel = logger_or_channel
    elif callable(getattr(logger_or_channel, "log_metrics", None)) or callable(
        getattr(logger_or_channel, "log_scalar", None)
    ):
        channel = MetricsChannel.for_logger(logger_or_channel)
    else:
        raise TypeError(
            "LoggerObserver expects a torchrl Logger (or logger service), a MetricsChannel or "
            f"a MetricsHandle, got {logger_or_channel!r} of type {type(logger_or_channel).__name__}."
        )
    return channel.handle(), channel


def _as_metric_sets(metrics: Any) -> tuple[MetricSet, ...] | None:
    if metrics is None:
        return None
    sets = (metrics,) if isinstance(metrics, MetricSet) else tuple(metrics)
    if not sets or not all(isinstance(m, MetricSet) for m in sets):
        raise TypeError(
            "metrics must be a MetricSet (CollectorBatchMetrics, SampleMetrics, WriteMetrics, ...) "
            f"or a non-empty sequence of them, got {metrics!r}."
        )
    check_metric_names(sets)  # two sets logging one name: refused here, naming both
    return sets


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
    writes and buffer samples never fight over one step.

    Args:
        logger (Logger | MetricsChannel | MetricsHandle): where the metrics go.
            A torchrl logger (direct or a logger service) gets the channel
            shared by everything logging to it
            (:meth:`MetricsChannel.for_logger`).

    Keyword Args:
        schedule (Every, optional): when to emit: ``Every.counter(key, n)``
            over a counter the metrics see (``frames``, ``batches``,
            ``episodes``, ``write_count``, ``items_written``,
            ``sample_calls``, ``samples_returned``) or ``Every.seconds(s)``.
            ``None`` (default) emits after every data event (each batch,
            write or sample). ``Every`` refuses intervals ``<= 0``; a NaN
            interval is refused here; an infinite one never fires (only
            ``log_on_start`` / ``log_on_close`` emit).
        metrics (MetricSet | Sequence[MetricSet], optional): what to fold.
            Defaults to :func:`default_metrics` for the target: batch
            metrics on a collector, write and sample metrics on a buffer.
        name (str, optional): the namespace. Defaults to the target's class
            name in lower case, made unique per channel (``replaybuffer``,
            ``replaybuffer_1``, ...).
        scope (str, optional): for sources with several workers:
            ``"aggregate"`` (default) merges all workers' partials,
            ``"per_worker"`` logs ``<name>/worker_<i>/<metric>``, ``"both"``
            does both.
        step (str, optional): the counter used as the logged step.
            Defaults to the schedule's counter, else the first counter of
            the first metric set (``frames`` for a collector).
        log_on_start (bool, optional): emit at the first data event whatever
            the schedule. Defaults to ``False``.
        log_on_close (bool, optional): emit the last partial window when the
            observer is removed, the target shuts down, or the channel
            closes. Defaults to ``True``.
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
        >>> sorted(name for name in logger.experiment.scalars if "episode" in name)[:3]
        ['collector/episode_length_max', 'collector/episode_length_mean', 'collector/episode_length_min']
    """

    def __init__(
        self,
        logger: Any,
        *,
        schedule: Every | None = None,
        metrics: MetricSet | Sequence[MetricSet] | None = None,
        name: str | None = None,
        scope: Scope = "aggregate",
        step: str | None = None,
        log_on_start: bool = False,
        log_on_close: bool = True,
        on_error: str = "warn",
        report_interval: float = 0.5,
    ) -> None:
        if schedule is not None and not isinstance(schedule, Every):
            raise TypeError(
                "schedule must be an Every (Every.counter(key, n) or Every.seconds(s)) or None, "
                f"got {schedule!r}."
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
        self._sink, channel = _as_sink(logger)
        self._channel_ref = weakref.ref(channel) if channel is not None else None
        self._sets = _as_metric_sets(metrics)
        self.schedule = schedule
        self.name = name
        self.scope = scope
        self.step_key = step
        self.log_on_start = log_on_start
        self.log_on_close = log_on_close
        self.on_error = on_error
        self._clock = ScheduleClock(schedule)
        self._lock = threading.Lock()
        self._folds: dict[str, tuple[Any, ...]] = {}
        self._source: weakref.ref[Any] | None = None
        self._fresh = False  # data folded since the last emission
        self._emitted = False
        self._pristine: bytes | None = None
        self.report_interval = report_interval
        self._home_pid = os.getpid()
        self._mode: str | None = None  # "local" or "contribute", resolved at the first event
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
        self._source = weakref.ref(source)
        self._bind(source)
        if self.log_on_close:
            channel = self._channel()
            if channel is not None:
                channel.add_close_callback(self._close_window)

    def detached(self, source: Any) -> None:
        if self.log_on_close:
            self._close_window()
        if self._mode == "contribute":
            self._sink.flush(timeout=5.0)

    def prepare_copies(self, target: Any) -> None:
        """Called on the original, in the driver, before copies go where ``target``'s data is.

        Fixes what every copy must share: the metric sets (chosen for
        ``target``), the namespace and the step counter.
        """
        self._bind(target)

    def copies_removed(self, target: Any) -> None:
        """Called on the original once every copy was detached: logs the last aggregate windows."""
        channel = self._channel()
        if channel is not None and self.name is not None:
            finish_aggregate(channel, self.name)

    def _bind(self, source: Any) -> None:
        """Resolves defaults, names and counters once, for ``source`` (a local one or a remote one)."""
        if self._sets is None:
            self._sets = default_metrics(source)
        for metric_set in self._sets:
            metric_set.bind(source)
        counters = missing_source_counters(source, self._sets)  # the source's own, for schedules
        if counters is not None:
            self._sets = (*self._sets, counters)
        if self._pristine is None:  # what a copy restarts from where it runs (see _resolve_mode)
            try:
                self._pristine = pickle.dumps(self._sets)
            except Exception:  # sets that cannot pickle cannot travel either: only forks copy them
                self._pristine = b""
        self._wire()
        counters = self._counters()
        key = self.schedule.key if self.schedule is not None and self.schedule.kind == "counter" else None
        for wanted in (key, self.step_key):
            if wanted is not None and wanted not in counters:
                raise ValueError(
                    f"LoggerObserver counter {wanted!r} is not one its metrics see; "
                    f"they see {sorted(counters)}."
                )
        if self.step_key is None:
            self.step_key = key or next(iter(counters), None)
        if key is not None:
            self._clock.due(counters[key])  # primes the schedule at the counters' current value
        if self.name is None:
            self.name = self._unique_name(type(source).__name__.lower())

    def _wire(self) -> None:
        self._folds = {
            event: tuple(getattr(m, "on_" + event) for m in self._sets or () if event in m.events)
            for event in _DATA_EVENTS
        }

    def _channel(self) -> MetricsChannel | None:
        return self._channel_ref() if self._channel_ref is not None else None

    def _unique_name(self, base: str) -> str:
        channel = self._channel_ref() if self._channel_ref is not None else None
        if channel is None:
            return base
        with _NAMES_LOCK:
            taken = _NAMES.setdefault(channel, set())
            name, suffix = base, 0
            while name in taken:
                suffix += 1
                name = f"{base}_{suffix}"
            taken.add(name)
        return name

    def _counters(self) -> dict[str, float]:
        counters: dict[str, float] = {}
        for metric_set in self._sets or ():
            counters.update(metric_set.counters())
        return counters

    # -- events -----------------------------------------------------------------------------

    def _after(self) -> None:
        with self._lock:
            self._fresh = True
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
        payload: dict[str, Any] = {}
        for metric_set in self._sets or ():
            payload.update(metric_set.pull())
        self._fresh = False
        return payload

    def _emit(self, counters: Mapping[str, float]) -> None:
        channel = self._channel()
        if channel is not None and has_aggregate(channel, self.name or ""):
            # copies elsewhere contribute to this name: this instance becomes one more contributor
            self._mode = "contribute"
            self._worker = "main"
            self._contribute()
            return
        step = counters.get(self.step_key) if self.step_key else None
        payload = self._pull()
        self._clock.fired()
        self._emitted = True
        self._sink.submit_metrics(
            payload, None if step is None else int(step), namespace=self.name or ""
        )

    def _close_window(self) -> None:
        with self._lock:
            if not self._fresh:
                return
            if self._mode == "contribute":
                self._contribute()
            else:
                self._emit(self._counters())

    def on_post_collect(self, source: Any, batch: Any) -> None:
        if self._mode is None:
            self._resolve_mode(source)
        for fold in self._folds["post_collect"]:
            fold(source, batch)
        self._after()

    def on_post_add(self, source: Any, data: Any, index: Any) -> None:
        if self._mode is None:
            self._resolve_mode(source)
        for fold in self._folds["post_add"]:
            fold(source, data, index)
        self._after()

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        if self._mode is None:
            self._resolve_mode(source)
        for fold in self._folds["post_extend"]:
            fold(source, data, index)
        self._after()

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        if self._mode is None:
            self._resolve_mode(source)
        for fold in self._folds["post_sample"]:
            fold(source, batch, info)
        self._after()

    def on_shutdown(self, source: Any) -> None:
        if self.log_on_close:
            self._close_window()
        if self._mode == "contribute":  # the process may end right after
            self._sink.flush(timeout=5.0)

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
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._mode = None  # a copy: resolved again where it runs
        LIVE.add(self)

    def __repr__(self) -> str:
        sets = ", ".join(type(m).__name__ for m in self._sets or ())
        return f"LoggerObserver(name={self.name!r}, schedule={self.schedule!r}, metrics=[{sets}])"


def attach_logger(
    self: Any,
    logger: Any,
    *,
    schedule: Every | None = None,
    metrics: MetricSet | Iterable[MetricSet] | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Logs this source's metrics: ``add_observer(LoggerObserver(logger, ...))`` in one line.

    Metrics default to those fitting the source (:func:`default_metrics`).
    Returns the same handle as :meth:`add_observer`.

    Args:
        logger (Logger | MetricsChannel | MetricsHandle): where the metrics go.

    Keyword Args:
        schedule (Every, optional): see :class:`LoggerObserver`.
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
        >>> [step for step, _ in logger.experiment.scalars["replaybuffer/samples_returned"]]
        [2, 4]
    """
    observer = LoggerObserver(logger, schedule=schedule, metrics=metrics, name=name, **kwargs)
    return self.add_observer(observer)


def install_attach_logger() -> None:
    """Adds :func:`attach_logger` to torchrl's collectors and replay buffers (idempotent)."""
    from torchrl.data import ReplayBuffer

    for cls in (BaseCollector, ReplayBuffer):
        cls.attach_logger = attach_logger  # type: ignore[attr-defined]
