"""Observers inside the worker processes of multiprocessing collectors.

torchrl's worker loop answers a ``"cascade_execute"`` message between two
rollouts; ``_rl_observers_call`` turns it into ``fn(inner_collector, *args)``,
so attaching makes each worker's inner collector observed, holding the copy.
Only live workers are messaged and waited for. Collectors still running at
interpreter exit are shut down first, so their workers report. The limits
are in ``docs/distributed.rst``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

from torchrl._utils import logger as torchrl_logger
from torchrl.collectors import BaseCollector, MultiAsyncCollector

from rl_observers import lifecycle
from rl_observers.remote.shipping import (
    RemoteAttachError,
    RemoteKind,
    attach_here,
    detach_here,
)
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources.observed import torchrl_class
from rl_observers.sources.placement import IdentityMap

__all__ = ["MULTIPROCESS_COLLECTOR", "MultiprocessCollectorKind", "call_workers"]


# How often to check that a worker is still alive while waiting for its answer, in seconds.
_HEALTH_INTERVAL = 0.5
# The context of the driver-side observed class (see the module docstring).
DRIVER = "multiprocess_driver"
# The most seconds the interpreter's exit spends shutting down observed collectors, in all.
_EXIT_TIMEOUT = 10.0
# The least seconds each of them gets, even past that deadline.
_EXIT_MIN_WAIT = 1.0
# Observed collectors of this process (weakly), with whether they still have observers: those
# still running are shut down at exit.
_OBSERVED = IdentityMap()
# The process that observed them (a fork inherits the exit hook, not the workers).
_EXIT_PID: int | None = None
# The dead workers already reported, per collector: a dead worker is reported once.
_REPORTED_DEAD = IdentityMap()


def _worker_death(collector: Any, idx: int) -> str | None:
    """How worker ``idx`` died (``"exit code -9"``), or ``None`` while it is alive."""
    procs = getattr(collector, "procs", None) or ()
    if idx >= len(procs):
        return None
    try:
        code = procs[idx].exitcode
    except ValueError:  # torchrl closes the process objects of workers it terminated
        return "closed"
    return None if code is None else f"exit code {code}"


def call_workers(collector: Any, calls: Mapping[int, tuple[Any, ...]]) -> tuple[dict[int, Any], dict[int, str]]:
    """Runs ``fn(inner_collector, *args)`` in the workers of ``calls`` (``{worker: (fn, *args)}``).

    Returns ``(answers, dead)``: each answering worker's result or exception,
    and how each dead worker died. Raises nothing.
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
        # this worker's health only: torchrl's _recv_and_check would terminate every worker
        pipe = collector.pipes[idx]
        try:
            while not pipe.poll(_HEALTH_INTERVAL):
                if _worker_death(collector, idx) is not None and not pipe.poll(0):
                    raise EOFError  # it died before it answered
            result, msg = pipe.recv()
        except (EOFError, OSError):  # dead, or its end of the pipe is closed
            dead[idx] = _worker_death(collector, idx) or "unreachable"
            continue
        if msg != "cascade_execute":
            result = RuntimeError(f"expected the answer to 'cascade_execute', got {msg!r}")
        answers[idx] = result
    return answers, dead


def raise_first_error(collector: Any, answers: Mapping[int, Any], action: str) -> None:
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


def warn_dead_once(collector: Any, dead: Mapping[int, str], action: str) -> None:
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
    emits = COLLECTOR_EVENTS
    where = "in its worker processes"
    stopped = "that is shut down: its worker processes are gone"
    context = DRIVER
    # An observer raising in a worker kills it: torchrl then reports only "worker <i> failed".
    raise_reaches_caller = False

    def is_running(self, target: Any) -> bool:
        return hasattr(target, "pipes") and not getattr(target, "closed", True)

    def check(self, target: Any, action: str) -> None:
        super().check(target, action)
        if getattr(target, "running", False) and not getattr(target, "_running_free", False):
            raise RuntimeError(
                f"cannot {action} a {type(target).__name__} while it is being iterated: its "
                "workers collect ahead of the loop and torchrl's control pipe would stall them. "
                "Attach observers before iterating, or use MultiSyncCollector, or start() "
                "with a replay buffer (observers can be attached while it runs free)."
            )

    def attach_remote(self, target: Any, payload: bytes, on_error: str, token: int) -> None:
        n = target.num_workers
        dead = {i: d for i in range(n) if (d := _worker_death(target, i)) is not None}
        answers: dict[int, Any] = {}
        during = ""
        if not dead:  # else nothing is sent: an observer is attached to every worker or to none
            taken = isinstance(target, MultiAsyncCollector)  # when the driver asks again
            calls = {i: (attach_here, payload, on_error, token, i, n, None, taken) for i in range(n)}
            answers, dead = call_workers(target, calls)
            during = " (it died while the observer was being attached)"
        attached = [idx for idx, result in answers.items() if not isinstance(result, BaseException)]
        if len(attached) == n:
            return
        if attached:  # undo the workers that attached it; those that failed or died have no copy
            with contextlib.suppress(Exception):
                call_workers(target, {idx: (detach_here, token) for idx in attached})
        if dead:
            raise RuntimeError(
                f"cannot attach an observer to a {type(target).__name__}: {_describe_dead(dead)}"
                f"{during}; nothing was attached."
            )
        raise_first_error(target, answers, "attaching an observer to")

    def copy_workers(self, target: Any) -> tuple[int | None, ...]:
        return tuple(range(target.num_workers))

    def detach_remote(self, target: Any, token: int) -> None:
        """Detaches the copies from the live workers; a dead worker is warned about, once."""
        answers, dead = call_workers(target, dict.fromkeys(range(target.num_workers), (detach_here, token)))
        if dead:
            warn_dead_once(target, dead, "observers are removed from")
        raise_first_error(target, answers, "detaching an observer from")

    def first_added(self, target: Any) -> None:
        """Has ``target`` shut down at interpreter exit, before multiprocessing's hook and the channels."""
        global _EXIT_PID
        super().first_added(target)
        _OBSERVED.set(target, True)
        _EXIT_PID = os.getpid()
        lifecycle.at_exit(_shut_down_observed_at_exit, lifecycle.SOURCES)

    def last_removed(self, target: Any) -> None:
        super().last_removed(target)
        _OBSERVED.set(target, False)


MULTIPROCESS_COLLECTOR = MultiprocessCollectorKind()


class _DriverObservedMultiCollector:
    """Driver-side ``MultiSyncCollector`` / ``MultiAsyncCollector`` with observers."""

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        # torchrl's shutdown first: the workers exit and their copies send their last windows;
        # then the originals learn that the copies are gone (last aggregate rows, namespace freed).
        try:
            return torchrl_class(type(self)).shutdown(self, *args, **kwargs)  # type: ignore[attr-defined]
        finally:
            MULTIPROCESS_COLLECTOR.shut_down(self)


def _shut_down_observed_at_exit() -> None:
    """Shuts down the observed collectors still running, so that their workers report.

    A worker terminated for not stopping lost its copies' last windows; a warning says so.
    """
    if _EXIT_PID != os.getpid():
        return
    deadline = time.monotonic() + _EXIT_TIMEOUT
    for collector, observed in _OBSERVED.items():
        if not observed or not MULTIPROCESS_COLLECTOR.is_running(collector):
            continue
        timeout = max(_EXIT_MIN_WAIT, deadline - time.monotonic())
        error = None
        try:
            collector.shutdown(timeout=timeout, raise_on_error=False)
        except Exception as raised:  # the process is going away; report, never fail its exit
            error = raised
        workers = range(len(getattr(collector, "procs", None) or ()))
        states = (_worker_death(collector, i) or "still running" for i in workers)
        lost = [f"worker {i} ({state})" for i, state in enumerate(states) if state != "exit code 0"]
        if lost or error is not None:
            why = f"{type(error).__name__}: {error}" if error is not None else ", ".join(lost)
            torchrl_logger.warning(
                f"rl_observers: a {type(collector).__name__} was still running at interpreter "
                f"exit; shutting it down so that its workers report their last windows failed "
                f"({why}): what their observers folded since their last report is lost. Call "
                "collector.shutdown() before the program ends."
            )


def _call_in_collector(self: BaseCollector, fn: Any, *args: Any) -> Any:
    """Runs ``fn(self, *args)``: ``BaseCollector._rl_observers_call``, the target of ``cascade_execute``."""
    return fn(self, *args)


BaseCollector._rl_observers_call = _call_in_collector  # type: ignore[attr-defined]
