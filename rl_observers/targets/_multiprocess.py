"""Observers inside the worker processes of multiprocessing collectors.

A ``MultiSyncCollector`` / ``MultiAsyncCollector`` runs one inner torchrl
``Collector`` per worker process and talks to it over a control pipe. Its
worker loop (``torchrl/collectors/_runner.py``) answers a
``"cascade_execute"`` message between two rollouts, also while the collector
runs free after ``start()``; ``_rl_observers_call`` turns that message into
``fn(inner_collector, *args)``. Attaching sends one such message per worker,
which makes the inner collector an observed collector holding the observer
copy, so worker-side observers receive the inner collector as ``source``,
run on that worker's batches, and coexist with the user's
``post_collect_hook`` / ``pre_collect_hook`` (which the driver forwards to
the same inner collector with ``"setattr"`` messages: they land in the hook
slot, the observers stay).

Dead workers: each message is sent only to workers that are alive, and
only the workers a message reached are waited for (each checked for its own
health, never torchrl's check that terminates every worker once one died),
so the control pipes stay in step. Attaching to a collector with a dead
worker raises a ``RuntimeError`` naming it, and attaches nothing anywhere;
removing detaches from every live worker and warns once per dead worker.

Shared replay buffers: a buffer passed as ``replay_buffer=`` to a
multiprocessing collector is copied into every worker (inherited by
``fork``, pickled by ``spawn``) together with the observers it had then;
an observer that cannot be unpickled in a ``spawn`` worker is left behind
there with one warning, instead of killing the worker at start-up (see
:class:`rl_observers.observer.ObserverList`).
Observers attached to the buffer *later* are propagated to the copies of the
buffer in the workers of every running multiprocessing collector that
writes into it, and removals likewise, so a buffer's observers always see
the writes made in every process; see :func:`propagate_to_shared_copies`.

The limits come from torchrl's worker loop: a control message that reaches a
worker during a rollout makes the worker drop that rollout (torchrl does the
same for its own messages, such as setting ``post_collect_hook``), and a
``MultiAsyncCollector`` being iterated has workers collecting ahead, which
such a message would stall; attaching to it then raises.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from torchrl._utils import logger as torchrl_logger
from torchrl.collectors import MultiCollector

from rl_observers.observer import _ObserverLeftBehind
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources import IdentityMap
from rl_observers.targets.remote import (
    RemoteAttachError,
    RemoteKind,
    attach_here,
    detach_here,
    ship,
)

__all__ = [
    "MULTIPROCESS_COLLECTOR",
    "MultiprocessCollectorKind",
    "propagate_to_shared_copies",
    "track_shared_buffer_writers",
]


# How often to check that a worker is still alive while waiting for its answer, in seconds.
_HEALTH_INTERVAL = 0.5
# The dead workers already reported, per collector: a dead worker is reported once.
_REPORTED_DEAD = IdentityMap()


class _WorkerDied(Exception):
    """A worker died before it answered."""


def _worker_death(collector: Any, idx: int) -> str | None:
    """How worker ``idx`` died (``"exit code -9"``), or ``None`` while it is alive."""
    procs = getattr(collector, "procs", None) or ()
    if idx >= len(procs):
        return None
    proc = procs[idx]
    try:
        if proc.is_alive():
            return None
        return f"exit code {proc.exitcode}"
    except ValueError:  # torchrl closes the process objects of workers it terminated
        return "closed"


def _dead_workers(collector: Any) -> dict[int, str]:
    """The dead workers of ``collector``, by index, with how they died."""
    dead = {idx: _worker_death(collector, idx) for idx in range(len(collector.pipes))}
    return {idx: death for idx, death in dead.items() if death is not None}


def _receive(collector: Any, idx: int) -> Any:
    """The next message from worker ``idx``; raises :class:`_WorkerDied` if it died first.

    Waits as long as the worker lives, like torchrl's own control messages,
    but checks only *this* worker's health: torchrl's ``_recv_and_check``
    terminates every worker once any of them is dead, survivors included.
    """
    pipe = collector.pipes[idx]
    try:
        while not pipe.poll(_HEALTH_INTERVAL):
            if _worker_death(collector, idx) is not None and not pipe.poll(0):
                raise _WorkerDied
        return pipe.recv()
    except (EOFError, OSError) as error:  # the worker's end of the pipe is closed
        raise _WorkerDied from error


def _call_workers(collector: Any, calls: Mapping[int, tuple[Any, ...]]) -> tuple[dict[int, Any], dict[int, str]]:
    """Runs ``fn(inner_collector, *args)`` in the workers of ``calls`` (``{worker: (fn, *args)}``).

    Returns ``(answers, dead)``: ``answers`` maps each worker that answered to
    its result or to the exception it raised; ``dead`` maps each worker that
    is dead (found dead, unreachable, or died before answering) to how it
    died. Only the workers a message reached are waited for, each once, so
    the control pipes stay in step whatever happens; nothing is raised here.
    """
    answers: dict[int, Any] = {}
    dead: dict[int, str] = {}
    sent: list[int] = []
    for idx, call in calls.items():
        death = _worker_death(collector, idx)
        if death is None:
            try:
                collector.pipes[idx].send((("_rl_observers_call", call, {}), "cascade_execute"))
            except (OSError, EOFError, ValueError):  # the worker died since (broken pipe)
                death = _worker_death(collector, idx) or "unreachable"
            else:
                sent.append(idx)
                continue
        dead[idx] = death
    for idx in sent:
        try:
            result, msg = _receive(collector, idx)
        except _WorkerDied:
            dead[idx] = _worker_death(collector, idx) or "unreachable"
            continue
        if msg != "cascade_execute":
            result = RuntimeError(f"expected the answer to 'cascade_execute', got {msg!r}")
        answers[idx] = result
    return answers, dead


def _raise_first_error(collector: Any, answers: Mapping[int, Any], action: str) -> None:
    """Raises a :class:`RemoteAttachError` for the first worker whose answer is an error."""
    for idx in sorted(answers):
        error = answers[idx]
        if isinstance(error, BaseException):
            raise RemoteAttachError(
                f"{action} {type(collector).__name__} worker {idx} failed: {error}"
            ) from (None if isinstance(error, RemoteAttachError) else error)


def _describe_dead(dead: Mapping[int, str]) -> str:
    """``"worker 0 (exit code -9) is dead"``, or several workers that ``are dead``."""
    workers = " and ".join(f"worker {idx} ({death})" for idx, death in sorted(dead.items()))
    return f"{workers} {'is' if len(dead) == 1 else 'are'} dead"


def _warn_dead_once(collector: Any, dead: Mapping[int, str], action: str) -> None:
    """Warns once per dead worker of ``collector`` that ``action`` skipped it."""
    reported = _REPORTED_DEAD.setdefault(collector, set)
    new = {idx: death for idx, death in dead.items() if idx not in reported}
    if new:
        reported.update(new)
        torchrl_logger.warning(
            f"rl_observers: {type(collector).__name__} {_describe_dead(new)}: {action} the live "
            "workers only (the observer copies of a dead worker died with it)."
        )


class MultiprocessCollectorKind(RemoteKind):
    """Observers of ``MultiSyncCollector`` / ``MultiAsyncCollector``: a copy in every worker."""

    target_name = "collector"
    events = COLLECTOR_EVENTS
    where = "in its worker processes"
    # An observer raising in a worker kills it: torchrl then reports only "worker <i> failed".
    raise_reaches_caller = False

    def is_running(self, target: Any) -> bool:
        return hasattr(target, "pipes") and not getattr(target, "closed", True)

    def check(self, target: Any, action: str) -> None:
        if not self.is_running(target):
            raise RuntimeError(
                f"cannot {action} a {type(target).__name__} that is shut down: "
                "its worker processes are gone."
            )
        if getattr(target, "running", False) and not getattr(target, "_running_free", False):
            raise RuntimeError(
                f"cannot {action} a {type(target).__name__} while it is being iterated: its "
                "workers collect ahead of the loop and torchrl's control pipe would stall them. "
                "Attach observers before iterating, or use MultiSyncCollector, or start() "
                "with a replay buffer (observers can be attached while it runs free)."
            )

    def attach_remote(self, target: Any, payload: bytes, on_error: str, token: int) -> None:
        n = target.num_workers
        dead = _dead_workers(target)
        if dead:  # nothing is sent: an observer is attached to every worker or to none
            raise RuntimeError(
                f"cannot attach an observer to a {type(target).__name__}: {_describe_dead(dead)}; "
                "nothing was attached."
            )
        calls = {idx: (attach_here, payload, on_error, token, idx, n) for idx in range(n)}
        answers, dead = _call_workers(target, calls)
        attached = [idx for idx, result in answers.items() if not isinstance(result, BaseException)]
        if len(attached) == n:
            return
        # Undo the workers that attached it; those that failed or died have no copy.
        with contextlib.suppress(Exception):
            _call_workers(target, {idx: (detach_here, token) for idx in attached})
        if dead:
            raise RuntimeError(
                f"cannot attach an observer to a {type(target).__name__}: {_describe_dead(dead)} "
                "(it died while the observer was being attached); nothing was attached."
            )
        _raise_first_error(target, answers, "attaching an observer to")

    def detach_remote(self, target: Any, token: int) -> None:
        """Detaches the copies from the live workers; a dead worker is warned about, once."""
        answers, dead = _call_workers(target, dict.fromkeys(range(target.num_workers), (detach_here, token)))
        if dead:
            _warn_dead_once(target, dead, "observers are removed from")
        _raise_first_error(target, answers, "detaching an observer from")


MULTIPROCESS_COLLECTOR = MultiprocessCollectorKind()


# -- shared replay buffers -------------------------------------------------------------------------

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
    collection path changes. Called by ``import rl_observers``; calling it
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
            if self.__dict__.get("replay_buffer") is not None:
                with _WRITERS_LOCK:
                    _WRITERS[:] = [ref for ref in _WRITERS if ref() is not None]
                    _WRITERS.append(weakref.ref(self))
            return original(self, *args, **kwargs)

        _run_processes._rl_observers_tracked = True  # type: ignore[attr-defined]
        MultiCollector._run_processes = _run_processes  # type: ignore[method-assign]


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
    import cloudpickle

    from rl_observers.targets.remote import _portable

    try:
        _LOCAL.applying = True
        try:
            collector.replay_buffer.add_observer(cloudpickle.loads(payload), on_error=on_error)
        finally:
            _LOCAL.applying = False
    except Exception as error:
        raise _portable(error, "attaching an observer to a worker's replay buffer") from None


def _detach_from_worker_buffer(collector: Any, position: int, type_name: str) -> None:
    from rl_observers.targets.remote import _portable

    try:
        observers = collector.replay_buffer.observers
        found = observers[position] if position < len(observers) else None
        # One left behind when the worker started (it could not be unpickled there) keeps its place.
        if not isinstance(found, _ObserverLeftBehind) and type(found).__qualname__ != type_name:
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
        raise _portable(error, "detaching an observer from a worker's replay buffer") from None


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
            answers, dead = _call_workers(collector, dict.fromkeys(range(collector.num_workers), call))
            applied.append((collector, [i for i, r in answers.items() if not isinstance(r, BaseException)]))
            if dead:
                _warn_dead_once(collector, dead, f"replay buffer observers are mirrored ({action}) to")
            _raise_first_error(collector, answers, f"mirroring {action} on")
    except BaseException:
        if action == "add":  # the driver does not keep it: neither may any worker
            undo = (_detach_from_worker_buffer, position, type(observer).__qualname__)
            for collector, workers in applied:
                with contextlib.suppress(Exception):
                    _call_workers(collector, dict.fromkeys(workers, undo))
        raise
