"""What a LoggerObserver is given: its defaults per target, and the checks of its arguments, run once at creation or attach."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.channel import MetricsChannel
from rl_observers.metrics import CollectorBatchMetrics, MetricSet, SampleMetrics, WriteMetrics
from rl_observers.metrics.oneliners import Metric
from rl_observers.observer import check_on_error
from rl_observers.signals import COLLECTOR_EVENTS, REPLAY_BUFFER_EVENTS

__all__ = [
    "DEFAULT_SCHEDULES",
    "SCOPES",
    "as_metric_sets",
    "as_sink",
    "check_arguments",
    "check_metric_names",
    "check_sets_fit",
    "default_metrics",
    "default_schedule",
    "target_kind",
]

#: What ``schedule="auto"`` (the default) means per kind of target, in order of preference:
#: the first whose counter the metric sets count. A collector emits every 1,000 frames; a
#: replay buffer every 100 ``sample()`` calls (every 1,000 items written if it is not sampled
#: by these sets). Sets counting none of these emit every 10 seconds.
DEFAULT_SCHEDULES: dict[str, tuple[Every, ...]] = {
    "collector": (Every.counter("frames", 1_000),),
    "replay_buffer": (Every.counter("sample_calls", 100), Every.counter("items_written", 1_000)),
}
_FALLBACK_SCHEDULE = Every.seconds(10.0)
_EMITS = {"collector": COLLECTOR_EVENTS, "replay_buffer": REPLAY_BUFFER_EVENTS}
_FITTING_SETS = {
    "collector": "CollectorBatchMetrics() (or a MetricSet with on_post_collect)",
    "replay_buffer": (
        "WriteMetrics() or SampleMetrics() (or a MetricSet with on_post_add, on_post_extend "
        "or on_post_sample)"
    ),
}


def target_kind(target: Any) -> str:
    """``"collector"`` or ``"replay_buffer"``: the kind of torchrl object ``target`` is, and its default namespace."""
    return "collector" if isinstance(target, BaseCollector) else "replay_buffer"


def default_schedule(target: Any, metrics: Sequence[MetricSet] | None = None) -> Every:
    """The schedule of a :class:`LoggerObserver` created with ``schedule="auto"`` (:data:`DEFAULT_SCHEDULES`).

    Args:
        target: a torchrl collector or replay buffer.
        metrics (Sequence[MetricSet], optional): the observer's metric sets.
            Defaults to :func:`default_metrics` of ``target``.

    Examples:
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from rl_observers import WriteMetrics, default_schedule
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(4))
        >>> default_schedule(rb)
        Every(kind='counter', interval=100, key='sample_calls')
        >>> default_schedule(rb, [WriteMetrics()])
        Every(kind='counter', interval=1000, key='items_written')
    """
    sets = default_metrics(target) if metrics is None else metrics
    counted = {name for m in sets for name in m.counters()}
    for schedule in DEFAULT_SCHEDULES[target_kind(target)]:
        if schedule.key in counted:
            return schedule
    return _FALLBACK_SCHEDULE


def default_metrics(target: Any) -> tuple[MetricSet, ...]:
    """The metric sets a :class:`LoggerObserver` uses when given none, bound to ``target``.

    :class:`~rl_observers.CollectorBatchMetrics` for a collector;
    :class:`~rl_observers.WriteMetrics` and :class:`~rl_observers.SampleMetrics`
    for a replay buffer.

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


def check_metric_names(sets: Sequence[MetricSet]) -> None:
    """Refuses metric sets of one observer that would log under the same name (a ``ValueError`` naming both).

    Examples:
        >>> from rl_observers import CollectorBatchMetrics
        >>> from rl_observers.logging.defaults import check_metric_names
        >>> try:
        ...     check_metric_names([CollectorBatchMetrics(), CollectorBatchMetrics()])
        ... except ValueError as err:
        ...     print(str(err).split(" both log")[0])
        LoggerObserver: metric sets CollectorBatchMetrics (#1) and CollectorBatchMetrics (#2)
    """
    seen: dict[str, int] = {}
    # a one-liner by its repr (it names the metric), a metric set by its class
    shown_as = [repr(m) if isinstance(m, Metric) else type(m).__name__ for m in sets]
    for index, metric_set in enumerate(sets):
        # the names it logs, as far as they are known before any data
        names = {*metric_set.metric_names(), *metric_set.counter_names, *metric_set.latest_gauges}
        clash = sorted(name for name in names if seen.setdefault(name, index) != index)
        if clash:  # named with the first set it clashes with
            other = seen[clash[0]]
            shown = ", ".join(repr(n) for n in clash if seen[n] == other)
            raise ValueError(
                f"LoggerObserver: metric sets {shown_as[other]} (#{other + 1}) and "
                f"{shown_as[index]} (#{index + 1}) both log {shown}; one would "
                "overwrite the other in every row. Keep one of them, or log the other "
                "from a second LoggerObserver with its own name=."
            )


def is_handle(value: Any) -> bool:
    """Whether ``value`` is a channel's handle (a :class:`~rl_observers.MetricsHandle`)."""
    return not isinstance(value, MetricsChannel) and callable(getattr(value, "submit_window", None))


def as_sink(logger_or_channel: Any) -> tuple[Any, MetricsChannel | None]:
    """The handle an observer submits to, and the channel made for a bare logger (else ``None``)."""
    if is_handle(logger_or_channel):
        return logger_or_channel, None
    if isinstance(logger_or_channel, type):
        cls = logger_or_channel.__name__
        raise TypeError(
            f"LoggerObserver expects a logger instance, got the class {cls}; create the logger "
            f"first, e.g. LoggerObserver({cls}(exp_name=..., log_dir=...)), and pass that."
        )
    if isinstance(logger_or_channel, MetricsChannel):
        channel = logger_or_channel
    elif any(callable(getattr(logger_or_channel, m, None)) for m in ("log_metrics", "log_scalar")):
        channel = MetricsChannel.for_logger(logger_or_channel)
    else:
        raise TypeError(
            "LoggerObserver expects a torchrl Logger (or logger service), a MetricsChannel or "
            f"a MetricsHandle, got {logger_or_channel!r} of type {type(logger_or_channel).__name__}."
        )
    return channel.handle(), channel


def as_metric_sets(metrics: Any) -> tuple[MetricSet, ...] | None:
    """``metrics=`` as a tuple of metric sets (``None``: the defaults, chosen at attach)."""
    if metrics is None:
        return None
    given = (metrics,) if isinstance(metrics, (MetricSet, type)) else metrics
    iterable = isinstance(given, Iterable) and not isinstance(given, (str, bytes, Mapping))
    sets = tuple(given) if iterable else ()
    for item in sets:
        if isinstance(item, type) and issubclass(item, MetricSet):
            raise TypeError(
                f"LoggerObserver: metrics= got the class {item.__name__}, not a metric set; "
                f"instantiate it: metrics={item.__name__}()."
            )
    if not sets or not all(isinstance(m, MetricSet) for m in sets):
        raise TypeError(
            "metrics must be a MetricSet (CollectorBatchMetrics, SampleMetrics, WriteMetrics, ...) "
            f"or a non-empty sequence of them, got {metrics!r}."
        )
    check_metric_names(sets)  # two sets logging one name: refused here, naming both
    return sets


def check_sets_fit(sets: Sequence[MetricSet], source: Any) -> None:
    """Refuses a metric set that folds none of the events ``source`` emits (it would log nothing)."""
    kind = target_kind(source)
    emits = _EMITS[kind]
    for metric_set in sets:
        if isinstance(metric_set, Metric):
            continue  # a one-liner refuses in its bind(), naming the on= to use
        if not set(metric_set.folded_events) & set(emits):
            folded = ", ".join(metric_set.folded_events) or "no event"
            raise TypeError(
                f"LoggerObserver: {type(metric_set).__name__} folds {folded}, which a "
                f"{type(source).__name__} never emits, so it would log nothing; on a "
                f"{kind.replace('_', ' ')} use {_FITTING_SETS[kind]}."
            )


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
    """``(schedule, auto, step_key, step_fn)`` from a LoggerObserver's arguments, or an error saying what to pass.

    Examples:
        >>> check_arguments("auto", "aggregate", "warn", None, "frames")
        (None, True, 'frames', None)
        >>> check_arguments("auto", "everywhere", "warn", None, None)
        Traceback (most recent call last):
        ...
        ValueError: scope must be one of 'aggregate', 'per_worker' or 'both', got 'everywhere'.
    """
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
