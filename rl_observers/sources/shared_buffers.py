"""Replay buffers shared with the worker processes of multiprocessing collectors.

A buffer passed as ``replay_buffer=`` to a
multiprocessing collector is copied into every worker (inherited by
``fork``, pickled by ``spawn``) together with the observers it had then;
an observer that cannot be unpickled in a ``spawn`` worker is left behind
there with one warning, instead of killing the worker at start-up (see
:class:`rl_observers.observer.ObserverList`).
Observers attached to the buffer *later* are propagated to the copies of the
buffer in the workers of every running multiprocessing collector that
writes into it, and removals likewise, so a buffer's observers always see
the writes made in every process; see :func:`propagate_to_shared_copies`.

"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import threading
from typing import Any

import cloudpickle
from torchrl.collectors import MultiCollector

from rl_observers.observer import ObserverLeftBehind
from rl_observers.sources.multiprocess import (
    MULTIPROCESS_COLLECTOR,
    call_workers,
    raise_first_error,
    warn_dead_once,
)
from rl_observers.sources.remote import portable_error, ship
from rl_observers.sources.replay_buffers import ReplayBufferObservers

__all__ = ["propagate_to_shared_copies"]

_LOCAL = threading.local()


def _collectors_writing_into(buffer: Any) -> list[Any]:
    """The running multiprocessing collectors whose workers hold a copy of ``buffer``.

    Found through the garbage collector's referrers (a collector keeps its
    buffer as ``collector.replay_buffer``), as torchrl keeps no registry of
    collectors; this runs only when an observer of a shared buffer is
    attached or removed while this process has child processes.
    """
    found: list[Any] = []
    if not multiprocessing.active_children():
        return found  # no worker process, no copy
    for referrer in gc.get_referrers(buffer):
        if isinstance(referrer, MultiCollector):
            owners = [referrer]
        elif isinstance(referrer, dict) and referrer.get("replay_buffer") is buffer:
            owners = [
                o for o in gc.get_referrers(referrer)
                if isinstance(o, MultiCollector) and getattr(o, "__dict__", None) is referrer
            ]
        else:
            continue
        for owner in owners:
            if (
                owner.__dict__.get("replay_buffer") is buffer
                and MULTIPROCESS_COLLECTOR.is_running(owner)
                and owner not in found
            ):
                found.append(owner)
    return found


def _attach_to_worker_buffer(collector: Any, payload: bytes, on_error: str) -> None:
    try:
        _LOCAL.applying = True
        try:
            collector.replay_buffer.add_observer(cloudpickle.loads(payload), on_error=on_error)
        finally:
            _LOCAL.applying = False
    except Exception as error:
        raise portable_error(error, "attaching an observer to a worker's replay buffer") from None


def _detach_from_worker_buffer(collector: Any, position: int, type_name: str) -> None:
    try:
        observers = collector.replay_buffer.observers
        found = observers[position] if position < len(observers) else None
        # One left behind when the worker started (it could not be unpickled there) keeps its place.
        if not isinstance(found, ObserverLeftBehind) and type(found).__qualname__ != type_name:
            raise RuntimeError(
                f"the worker's copy of the replay buffer has observers {observers!r}, "
                f"expected a {type_name} at position {position}"
            )
        _LOCAL.applying = True
        try:
            collector.replay_buffer.remove_observer(observers[position])
        finally:
            _LOCAL.applying = False
    except Exception as error:
        raise portable_error(error, "detaching an observer from a worker's replay buffer") from None


def propagate_to_shared_copies(buffer: Any, action: str, observer: Any, on_error: str, position: int) -> None:
    """Mirrors one observer change of a shared ``buffer`` onto its copies in running workers.

    Called by the buffer's observer list after ``add`` (``action="add"``) or
    before ``remove`` (``action="remove"``, with the observer's ``position``).
    Worker copies hold the observers the buffer had when the worker started,
    in the same order, and every later change is mirrored in order, so a
    position on the driver is the same position in every copy.

    A dead worker writes nothing more into the buffer: it is skipped, with
    one warning. A change that a live worker fails to apply raises; an
    ``add`` is then undone in the workers that applied it.

    Raises:
        TypeError: if an observer to add cannot be pickled.
        RemoteAttachError: if a live worker could not apply the change.
    """
    if getattr(_LOCAL, "applying", False):
        return  # this is a worker applying a mirrored change
    collectors = _collectors_writing_into(buffer)
    if not collectors:
        return
    if action == "add":
        payload = ship(observer, buffer, "in every process that writes into it")
        call: tuple[Any, ...] = (_attach_to_worker_buffer, payload, on_error)
    else:
        call = (_detach_from_worker_buffer, position, type(observer).__qualname__)
    applied: list[tuple[Any, list[int]]] = []
    try:
        for collector in collectors:
            MULTIPROCESS_COLLECTOR.check(collector, f"{action} an observer of its replay buffer on")
            answers, dead = call_workers(collector, dict.fromkeys(range(collector.num_workers), call))
            applied.append((collector, [i for i, r in answers.items() if not isinstance(r, BaseException)]))
            if dead:
                warn_dead_once(collector, dead, f"replay buffer observers are mirrored ({action}) to")
            raise_first_error(collector, answers, f"mirroring {action} on")
    except BaseException:
        if action == "add":  # the driver does not keep it: neither may any worker
            undo = (_detach_from_worker_buffer, position, type(observer).__qualname__)
            for collector, workers in applied:
                with contextlib.suppress(Exception):
                    call_workers(collector, dict.fromkeys(workers, undo))
        raise


ReplayBufferObservers.mirror = staticmethod(propagate_to_shared_copies)
