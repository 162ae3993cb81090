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
Either way each observer's ``prepare_copies`` hook runs on the driver first,
before its copies start (see :func:`_prepare_copies`).

"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import threading
import weakref
from typing import Any

import cloudpickle
from torchrl.collectors import MultiCollector

from rl_observers.observer import ObserverLeftBehind, ObserverList, refused_raise
from rl_observers.remote.multiprocess import (
    MULTIPROCESS_COLLECTOR,
    call_workers,
    raise_first_error,
    warn_dead_once,
)
from rl_observers.remote.shipping import portable_error, ship
from rl_observers.sources.observed import observers_of
from rl_observers.sources.replay_buffers import SHARED_COPIES_RUN, ReplayBufferObservers

__all__ = ["SharedBufferObservers", "propagate_to_shared_copies", "track_shared_buffer_writers"]

_LOCAL = threading.local()


# The multiprocessing collectors built with a ``replay_buffer`` since ``import rl_observers``
# (weak references): those whose workers may hold a copy of a shared buffer.
_WRITERS: list[weakref.ref[Any]] = []
_WRITERS_LOCK = threading.Lock()
# Whether worker processes existed before the collectors were tracked (``import rl_observers``
# after building a collector): the garbage collector is then asked for the untracked ones.
_UNTRACKED_WORKERS = False


def track_shared_buffer_writers() -> None:
    """Records every multiprocessing collector built with a ``replay_buffer`` (weakly).

    ``MultiCollector._run_processes``, which torchrl calls once when it starts a
    collector's workers, is wrapped to record the collector; nothing on a
    collection path changes. Called when this module is imported; calling it
    again is harmless.
    """
    global _UNTRACKED_WORKERS
    with _WRITERS_LOCK:
        original = MultiCollector.__dict__["_run_processes"]
        if getattr(original, "_rl_observers_tracked", False):
            return
        _UNTRACKED_WORKERS = bool(multiprocessing.active_children())

        @functools.wraps(original)
        def _run_processes(self: Any, *args: Any, **kwargs: Any) -> Any:
            buffer = self.__dict__.get("replay_buffer")
            observers = None if buffer is None else observers_of(buffer)
            for entry in observers.entries if observers is not None else ():
                if entry.on_error == "raise":  # before any worker starts with a copy of it
                    raise ValueError(
                        refused_raise(entry.observer, "shared replay buffer", SHARED_COPIES_RUN)
                    )
            if buffer is not None:
                with _WRITERS_LOCK:
                    _WRITERS[:] = [ref for ref in _WRITERS if ref() is not None]
                    _WRITERS.append(weakref.ref(self))
            for entry in observers.entries if observers is not None else ():
                _prepare_copies(entry.observer, buffer)  # before any worker starts with a copy
            return original(self, *args, **kwargs)

        _run_processes._rl_observers_tracked = True  # type: ignore[attr-defined]
        MultiCollector._run_processes = _run_processes  # type: ignore[method-assign]


def _prepare_copies(observer: Any, buffer: Any) -> None:
    """Tells the driver's ``observer`` that copies of it start in workers writing into ``buffer``.

    Its optional ``prepare_copies`` hook runs on the driver before the first
    copy can emit anything: the workers of a collector about to start, or a
    running collector's workers about to receive a new observer. A
    ``LoggerObserver`` fixes its mode then (one more contributor to its
    copies' aggregate), once, never in the middle of a window.
    """
    prepare = getattr(observer, "prepare_copies", None)
    if callable(prepare):
        prepare(buffer)


def _collectors_writing_into(buffer: Any) -> list[Any]:
    """The running multiprocessing collectors whose workers hold a copy of ``buffer``.

    torchrl keeps no registry of collectors: the collectors built since
    ``import rl_observers`` are recorded when their workers start (see
    :func:`track_shared_buffer_writers`), so finding them costs a walk over
    a short list. Collectors built before that are found through the
    garbage collector's referrers (a heap scan, ~0.1 s with torch loaded),
    and only when worker processes already existed at import.
    """
    found: list[Any] = []
    if not multiprocessing.active_children():
        return found  # no worker process, no copy
    with _WRITERS_LOCK:
        candidates = [ref() for ref in _WRITERS]
    if _UNTRACKED_WORKERS:
        candidates.extend(_referring_collectors(buffer))
    for owner in candidates:
        if (
            owner is not None
            and owner.__dict__.get("replay_buffer") is buffer
            and MULTIPROCESS_COLLECTOR.is_running(owner)
            and not any(owner is f for f in found)
        ):
            found.append(owner)
    return found


def _referring_collectors(buffer: Any) -> list[Any]:
    """The multiprocessing collectors holding ``buffer`` as ``replay_buffer``, from a heap scan."""
    owners: list[Any] = []
    for referrer in gc.get_referrers(buffer):
        if isinstance(referrer, MultiCollector):
            owners.append(referrer)
        elif isinstance(referrer, dict) and referrer.get("replay_buffer") is buffer:
            owners.extend(
                o for o in gc.get_referrers(referrer)
                if isinstance(o, MultiCollector) and getattr(o, "__dict__", None) is referrer
            )
    return owners


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
        _prepare_copies(observer, buffer)
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


class SharedBufferObservers(ReplayBufferObservers):
    """The observers of one in-process replay buffer, mirrored to its copies when it is shared.

    Every observer change of a buffer with ``shared=True`` is applied to the
    buffer's copies in the workers of the running multiprocessing
    collectors that write into it (:func:`propagate_to_shared_copies`).
    """

    def add(self, observer: Any, on_error: str | None = None) -> Any:
        entry = super().add(observer, on_error)
        if self.source.__dict__.get("shared"):
            try:
                propagate_to_shared_copies(self.source, "add", observer, entry.on_error, len(self.entries) - 1)
            except BaseException:
                ObserverList.remove(self, observer)
                raise
        return entry

    def remove(self, observer: Any) -> Any:
        if self.source.__dict__.get("shared"):
            position = next((i for i, e in enumerate(self.entries) if e.observer is observer), None)
            if position is not None:
                propagate_to_shared_copies(self.source, "remove", observer, "", position)
        return super().remove(observer)


track_shared_buffer_writers()
