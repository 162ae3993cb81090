"""Replay buffers shared with the worker processes of multiprocessing collectors.

Step **source → observer**, in every process writing into the buffer. The
workers' copies of the buffer carry the observers it had when they started;
later additions and removals are mirrored to them
(:func:`propagate_to_shared_copies`), each observer's ``prepare_copies``
running on the driver first. See ``docs/distributed.rst``, "Shared replay
buffers".
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import threading
import weakref
from collections.abc import Iterator
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
from rl_observers.remote.shipping import call_hook, portable_error, ship
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
    """Records every multiprocessing collector built with a ``replay_buffer`` (weakly), when its workers start.

    Wraps ``MultiCollector._run_processes``; idempotent.
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
                call_hook(entry.observer, "prepare_copies", buffer)  # before any worker has a copy
            return original(self, *args, **kwargs)

        _run_processes._rl_observers_tracked = True  # type: ignore[attr-defined]
        MultiCollector._run_processes = _run_processes  # type: ignore[method-assign]


def _collectors_writing_into(buffer: Any) -> list[Any]:
    """The running multiprocessing collectors whose workers hold a copy of ``buffer``.

    Those started before ``import rl_observers`` are found by a heap scan
    (~0.1 s), only if worker processes existed at import.
    """
    found: list[Any] = []
    if not multiprocessing.active_children():
        return found  # no worker process, no copy
    with _WRITERS_LOCK:
        candidates = [ref() for ref in _WRITERS]
    if _UNTRACKED_WORKERS:  # those holding it as ``replay_buffer``, from a heap scan
        for referrer in gc.get_referrers(buffer):
            if isinstance(referrer, MultiCollector):
                candidates.append(referrer)
            elif isinstance(referrer, dict) and referrer.get("replay_buffer") is buffer:
                candidates.extend(
                    o for o in gc.get_referrers(referrer)
                    if isinstance(o, MultiCollector) and getattr(o, "__dict__", None) is referrer
                )
    for owner in candidates:
        if (
            owner is not None
            and owner.__dict__.get("replay_buffer") is buffer
            and MULTIPROCESS_COLLECTOR.is_running(owner)
            and not any(owner is f for f in found)
        ):
            found.append(owner)
    return found


@contextlib.contextmanager
def _applying(action: str) -> Iterator[None]:
    """A mirrored change, applied in a worker: not mirrored again; its error goes back as text."""
    _LOCAL.applying = True
    try:
        yield
    except Exception as error:
        raise portable_error(error, f"{action} a worker's replay buffer") from None
    finally:
        _LOCAL.applying = False


def _attach_to_worker_buffer(collector: Any, payload: bytes, on_error: str) -> None:
    with _applying("attaching an observer to"):
        collector.replay_buffer.add_observer(cloudpickle.loads(payload), on_error=on_error)


def _detach_from_worker_buffer(collector: Any, position: int, type_name: str) -> None:
    with _applying("detaching an observer from"):
        observers = collector.replay_buffer.observers
        found = observers[position] if position < len(observers) else None
        # One left behind when the worker started (it could not be unpickled there) keeps its place.
        if not isinstance(found, ObserverLeftBehind) and type(found).__qualname__ != type_name:
            raise RuntimeError(
                f"the worker's copy of the replay buffer has observers {observers!r}, "
                f"expected a {type_name} at position {position}"
            )
        collector.replay_buffer.remove_observer(observers[position])


def propagate_to_shared_copies(buffer: Any, action: str, observer: Any, on_error: str, position: int) -> None:
    """Mirrors one observer change of a shared ``buffer`` onto its copies in running workers.

    Called after ``add`` or before ``remove`` (with the observer's
    ``position``, the same in every copy). A dead worker is skipped with a
    warning; a failed ``add`` is undone where it was applied.

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
        call_hook(observer, "prepare_copies", buffer)
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
    """The observers of one in-process replay buffer, mirrored to its copies in workers when it is shared."""

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
