"""A LoggerObserver's checkpoint: what it saves, what it restores, and lining up with its source.

Step of the flow: **observer** (source → observer → channel → logger), when
a run is saved or resumed (torchrl's :class:`~torchrl.checkpoint.Checkpoint`
calls :meth:`~rl_observers.LoggerObserver.state_dict` /
:meth:`~rl_observers.LoggerObserver.load_state_dict`, which call
:func:`save` / :func:`load` here). The rule for counters (the source's own
axis) is :mod:`~rl_observers.logging.resume`'s; :func:`align` applies it at
the first event after attaching or loading. For a source whose copies run
elsewhere, the state is the aggregate kept by the channel's owner
(:mod:`~rl_observers.remote.aggregate`).

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

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_observers.logging.defaults import target_kind
from rl_observers.logging.resume import (
    AXIS_COUNTERS,
    STATE_VERSION,
    describe,
    misfit,
    owns_axis,
    shift_counters,
    source_axis,
)
from rl_observers.logging.wiring import counter_key
from rl_observers.remote.aggregate import aggregate_state, load_aggregate_state
from rl_observers.schedule import ScheduleClock
from rl_observers.sources.replay_buffers import writes_held

__all__ = ["align", "load", "prime_clock", "save"]


def _kind(observer: Any) -> str:
    source = observer._source() if observer._source is not None else None
    if source is not None:
        return target_kind(source)
    names = {n for m in observer.metrics for n in m.counters()}
    return "collector" if "frames" in names else "replay_buffer"


def _schedule_spec(observer: Any) -> list[Any] | None:
    schedule = observer.schedule
    return None if schedule is None else [schedule.kind, float(schedule.interval), schedule.key]


def prime_clock(observer: Any) -> None:
    """Starts a counter schedule's thresholds from the observer's counters now."""
    key = counter_key(observer.schedule)
    if key is not None:
        value = observer._counters().get(key)
        if value is not None:
            observer._clock.due(value)


def save(observer: Any) -> dict[str, Any]:
    """What :meth:`~rl_observers.LoggerObserver.state_dict` returns."""
    with observer._lock:
        sets = observer.metrics
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            **describe(observer.name, _kind(observer), observer.scope, sets),
            "schedule": _schedule_spec(observer),
            "metrics": [m.state_dict() for m in sets],
            "clock": observer._clock.state_dict(),
            "last_step": observer._last_step,
        }
    if observer._has_copies:
        state["aggregate"] = aggregate_state(observer._channel(), observer.name or "")
    return state


def load(observer: Any, state_dict: Mapping[str, Any]) -> None:
    """What :meth:`~rl_observers.LoggerObserver.load_state_dict` does once the observer is attached."""
    sets = observer.metrics
    problem = misfit(state_dict, describe(observer.name, _kind(observer), observer.scope, sets))
    if problem is not None:
        raise ValueError(
            f"LoggerObserver {observer.name!r}: cannot load this state: {problem}. Load it "
            "into an observer built like the one that saved it (same name=, scope= and "
            "metrics=)."
        )
    has_copies = observer._has_copies
    with observer._lock:
        # with copies elsewhere, the aggregate at the owner holds this instance's counts too
        for metric_set, state in zip(sets, () if has_copies else state_dict["metrics"]):
            metric_set.load_state_dict(state)
        if state_dict.get("schedule") == _schedule_spec(observer):
            observer._clock.load_state_dict(state_dict["clock"])
        else:  # another schedule: its thresholds start from the restored counters
            observer._clock = ScheduleClock(observer.schedule)
            prime_clock(observer)
        saved_step = state_dict.get("last_step")
        last = observer._last_step
        if saved_step is not None and (last is None or saved_step > last):
            observer._last_step = int(saved_step)
        observer._emitted = observer._emitted or saved_step is not None
        if not has_copies:  # resolved (and lined up) again at the next event
            observer._align_pending = True
            observer._mode = None
    if state_dict.get("aggregate") is not None:
        load_aggregate_state(observer._channel(), observer.name or "", state_dict["aggregate"])


def take_alignment(observer: Any, source: Any) -> bool:
    """Whether this first event lines the counters up with the source's (once attached or loaded).

    A local observer does; so does a copy whose source counts for it alone
    (:func:`~rl_observers.logging.resume.owns_axis`), which then tells its
    aggregate what lining up added.
    """
    align = observer._align_pending and (observer._mode == "local" or owns_axis(source))
    observer._align_pending = False
    observer._axis_base = {}
    return align


def align(observer: Any, source: Any, before: Mapping[str, float]) -> None:
    """Moves counters below the source's own (restored, or counted before attaching) up to it.

    ``before``: the observer's counters before the event that triggered this.

    Held under a replay buffer's own lock, which every observed write holds
    from torchrl's count to its event (:mod:`~rl_observers.sources.replay_buffers`):
    a write another thread made meanwhile is then either folded already or not
    counted by torchrl yet, never counted by torchrl and folded after the
    line-up, which would count it twice (a sampling thread's first event).
    """
    with writes_held(source):
        _align_now(observer, source, before)


def _align_now(observer: Any, source: Any, before: Mapping[str, float]) -> None:
    axis = source_axis(source)
    if axis is None:
        return
    key = counter_key(observer.schedule)
    with observer._lock:
        counters = observer._counters()
        for counter, value in axis.items():
            ours = counters.get(counter)
            if ours is None or value <= ours:
                continue  # the observer's own count is ahead (its saved state): steps go on
            names = AXIS_COUNTERS[counter]
            offset = int(value - ours)
            shift_counters(observer.metrics, names, offset)
            observer._axis_base.update(dict.fromkeys(names, offset))
            if key in names:  # the threshold the source's axis had before this event
                prior = before.get(key, 0) + offset
                clock = observer._clock
                if clock.last_counter is None or prior > clock.last_counter:
                    clock.rebase(prior)
