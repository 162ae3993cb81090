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

Shared replay buffers: a buffer passed as ``replay_buffer=`` to a
multiprocessing collector is copied into every worker (inherited by
``fork``, pickled by ``spawn``) together with the observers it had then.
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
import gc
import multiprocessing
import threading
from typing import Any

from torchrl.collectors import MultiCollector

from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.targets.remote import (
    RemoteAttachError,
    RemoteKind,
    attach_here,
    detach_here,
    ship,
)

__all__ = ["MULTIPROCESS_COLLECTOR", "MultiprocessCollectorKind", "propagate_to_shared_copies"]


def _call_workers(collector: Any, calls: list[tuple[Any, ...]], action: str) -> list[Any]:
    """Runs ``fn(inner_collector, *args)`` in each worker, one ``(fn, *args)`` per worker.

    Every worker that got the message is answered for before any error is
    raised, so the control pipes stay in step. Returns the results, or raises
    the first error.
    """
    results: list[Any] = [None] * len(calls)
    sent = []
    for idx, (pipe, call) in enumerate(zip(collector.pipes, calls)):
        try:
            pipe.send((("_rl_observers_call", call, {}), "cascade_execute"))
            sent.append(idx)
        except Exception as error:  # a dead worker
            results[idx] = error
    for idx in sent:
        try:
            result, msg = collector._recv_and_check(collector.pipes[idx], worker_idx=idx)
        except Exception as error:  # a dead worker: nothing left to keep in step with
            result, msg = error, "cascade_execute"
        if msg != "cascade_execute":
            result = RuntimeError(f"expected the answer to 'cascade_execute', got {msg!r}")
        results[idx] = result
    for idx, error in enumerate(results):
        if isinstance(error, BaseException):
            raise RemoteAttachError(
                f"{action} {type(collector).__name__} worker {idx} failed: {error}"
            ) from (None if isinstance(error, RemoteAttachError) else error)
    return results


class MultiprocessCollectorKind(RemoteKind):
    """Observers of ``MultiSyncCollector`` / ``MultiAsyncCollector``: a copy in every worker."""

    target_name = "collector"
    events = COLLECTOR_EVENTS
    where = "in its worker processes"

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
        calls = [(attach_here, payload, on_error, token, idx, n) for idx in range(n)]
        try:
            _call_workers(target, calls, "attaching an observer to")
        except Exception:
            # Undo the workers that attached it; those that failed have no copy.
            with contextlib.suppress(Exception):
                _call_workers(target, [(detach_here, token)] * n, "detaching an observer from")
            raise

    def detach_remote(self, target: Any, token: int) -> None:
        _call_workers(target, [(detach_here, token)] * target.num_workers, "detaching an observer from")


MULTIPROCESS_COLLECTOR = MultiprocessCollectorKind()


# -- shared replay buffers -------------------------------------------------------------------------

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
        if position >= len(observers) or type(observers[position]).__qualname__ != type_name:
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

    Raises:
        TypeError: if an observer to add cannot be pickled.
        RemoteAttachError: if a worker could not apply the change.
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
    for collector in collectors:
        MULTIPROCESS_COLLECTOR.check(collector, f"{action} an observer of its replay buffer on")
        _call_workers(collector, [call] * collector.num_workers, f"mirroring {action} on")
