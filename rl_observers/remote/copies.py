"""The original LoggerObserver's side of its copies: preparing them, sending windows, finishing.

Step of the flow: **observer → channel**, for sources whose data is in
other processes (source → observer → channel → logger). The driver's
original is told before its copies start (:func:`prepare`: multiprocessing
and Ray sources ship them, a shared replay buffer's copies start with a
collector's workers) and once they are gone (:func:`finish`). From
:func:`prepare` on, the original is one more contributor (worker
``"main"``) to the aggregate its copies feed at the channel's owner: its
mode is fixed then, never switched by a window. :func:`contribute` sends one
contributor's window (a copy's, or the original's) to that aggregate.
"""

from __future__ import annotations

from typing import Any

from rl_observers.observer import dumps
from rl_observers.remote.aggregate import finish_aggregate
from rl_observers.remote.contributions import copy_worker
from rl_observers.remote.lockstep import plan_for
from rl_observers.remote.window import AggregateSpec
from rl_observers.sources import observers_of

__all__ = [
    "LAST_WINDOW_TIMEOUT",
    "contribute",
    "finish",
    "pickled",
    "placed",
    "prepare",
    "state_to_travel",
]

#: Seconds a copy waits at its source's shutdown for its last window to be acknowledged by the
#: owner's ingest (a relay or ingest actor still starting on a busy node takes seconds); within
#: the source's own bound (30 s for the actors of a Ray source, see ``sources/ray.py``).
LAST_WINDOW_TIMEOUT = 20.0


def pickled(sets: Any) -> bytes:
    """The metric sets a copy restarts from where it runs, pickled; ``b""`` if they cannot travel.

    (Only a fork copies sets that cannot be pickled, and its copy then keeps
    what the original had folded.)
    """
    try:
        return dumps(sets)
    except Exception:
        return b""


def prepare(observer: Any, target: Any) -> None:
    """What :meth:`~rl_observers.LoggerObserver.prepare_copies` does (see the module docstring).

    For a source the observer is attached to here, or being attached to (a
    shared replay buffer), only the mode changes (``attached`` resolves it
    again, to the same); for a remote source, the metric sets, namespace
    and step counter every copy shares are resolved for ``target``, and the
    channel is told that copies send to it until :func:`finish`.

    Raises:
        ValueError: ``step=`` is a collector or a callable, which copies cannot read.
    """
    observer._copies_elsewhere = True
    if any(e.observer is observer for e in getattr(observers_of(target), "entries", ())):
        with observer._lock:  # attached here (or being attached): its next event keeps this mode
            observer._mode = observer._contribution.join_as_original()
        return
    if observer._step_fn is not None:
        raise ValueError(
            "LoggerObserver: step= a collector or a callable is read where the channel lives, "
            f"but this {type(target).__name__}'s observers run in other processes; pass a "
            'counter name instead, e.g. step="frames".'
        )
    observer._bind(target)
    observer._contribution.cut_where_the_driver_does(plan_for(target, observer.schedule), observer.schedule)
    observer._has_copies = True
    observer._mode = observer._contribution.join_as_original()
    channel = observer._channel()
    if channel is not None:  # closing the channel before the copies are gone loses their windows
        what = f"LoggerObserver {observer.name!r} on a {type(target).__name__}"
        channel._logging.copies_attached(observer, what)
    observer._load_pending_state()


def finish(observer: Any) -> None:
    """What :meth:`~rl_observers.LoggerObserver.copies_removed` does: the aggregate's last windows.

    Does nothing the second time: by then another observer may use the
    namespace, and finishing it again would cut that observer's window short.
    The namespace is free afterwards.
    """
    channel = observer._channel()
    if channel is not None:
        channel._logging.copies_gone(observer)
    if not observer._namespace.held:
        return
    try:
        if channel is not None and observer.name is not None and not channel.closed:
            finish_aggregate(channel, observer.name)
    finally:
        observer._namespace.release(observer.name, observer)


def placed(observer: Any, workers: Any) -> None:
    """The original's copies are attached in ``workers``: the owner expects each to report.

    A copy never heard from (its worker killed before its first window
    arrived) is then counted lost instead of being invisible.
    """
    channel = observer._channel()
    if channel is not None:
        channel._logging.copies_expected(observer, [copy_worker(w) for w in workers])


def contribute(observer: Any, final: bool = False) -> None:
    """Sends the observer's window to the channel's owner, which merges it (see ``aggregate``).

    ``final``: the contributor's last window, which the owner's account
    expects (:mod:`~rl_observers.remote.account`); with nothing new since
    the previous window it is only the marker, without counters.
    """
    sets = observer.metrics
    latest = tuple(g for m in sets for g in m.latest_gauges)
    spec = AggregateSpec(
        observer.schedule,
        observer.step_key,
        observer.scope,
        observer.log_on_close,
        latest,
        timeout=observer.worker_timeout,
    )
    contribution = observer._contribution
    if final and not observer._fresh:  # nothing new since the previous window: only the marker
        observer._sink.submit_window(contribution.window(observer.name, {}, None, spec, last=True))
        return
    counters = observer._counters()
    window = contribution.window(
        observer.name, observer._pull(), counters, spec, base=observer._axis_base, last=final
    )
    observer._sink.submit_window(window)


def state_to_travel(observer: Any) -> dict[str, Any]:
    """The observer's ``__getstate__``: what a copy takes to where it runs (not this process's links)."""
    state = observer.__dict__.copy()
    del state["_lock"]
    state["_channel_ref"] = state["_source"] = None
    state["_step_fn"] = None  # read where the channel lives (refused for copies elsewhere)
    state["_read_schedule_counter"] = None  # resolved again where the copy runs
    return state
