"""Sources whose data lives in other processes: multiprocessing and Ray.

Attaching ships the observer once (cloudpickle, checked on the driver) and
installs a copy next to the data: in each worker of a multiprocessing
collector, in each Ray actor. The driver keeps the originals, which never see
events. Errors surface at ``add_observer`` (:class:`RemoteAttachError` where
the copy runs). See ``docs/distributed.rst``.

Examples:
    >>> import rl_observers
    >>> from rl_observers.remote.shipping import kind_of
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> kind_of(ReplayBuffer(storage=LazyTensorStorage(10))) is None  # in-process
    True
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cloudpickle
from torchrl._utils import logger as torchrl_logger

from rl_observers.observer import dumps, refused_raise, resolve_observer
from rl_observers.sources import observed
from rl_observers.sources.collectors import WORKER_DELIVERIES
from rl_observers.sources.placement import IdentityMap, place

__all__ = [
    "RemoteAttachError",
    "RemoteKind",
    "attach_here",
    "call_hook",
    "detach_here",
    "kind_of",
    "portable_error",
    "ship",
]

def kind_of(target: Any) -> RemoteKind | None:
    """How to attach observers to ``target`` when its data is remote, else ``None`` (from ``targets.TABLE``)."""
    how = observed.how_observed(type(target))
    return None if how is None else how.kind


# -- the driver side -------------------------------------------------------------------------------


class _Attached(NamedTuple):
    """One observer attached to a remote source: the original, its policy, its copies' token."""

    observer: Any
    on_error: str
    token: int


@dataclass(slots=True, eq=False)
class _RemoteObservers:
    """The driver's record of what is attached to one remote source."""

    entries: tuple[_Attached, ...] = ()
    lock: Any = field(default_factory=threading.RLock)
    shut_down: bool = False  # the originals were told that their copies are gone


_REMOTE = IdentityMap()
_TOKENS = itertools.count()


def call_hook(observer: Any, hook: str, *args: Any) -> bool:
    """Calls ``observer.<hook>(*args)`` if it has one (``prepare_copies``, ...); whether it did."""
    fn = getattr(observer, hook, None)
    if callable(fn):
        fn(*args)
    return callable(fn)


def ship(observer: Any, target: Any, where: str) -> bytes:
    """Pickles ``observer`` with cloudpickle on the driver; a ``TypeError`` if it cannot travel."""
    try:
        return dumps(observer, by_value=True)
    except Exception as error:
        raise TypeError(
            f"observers of a {type(target).__name__} run {where} and must be picklable "
            f"with cloudpickle; {observer!r} is not ({type(error).__name__}: {error})."
        ) from error


class RemoteKind:
    """How observers reach one kind of remote source.

    ``add`` / ``remove`` / ``observers`` back the source's methods of those
    names; subclasses implement :meth:`check`, :meth:`attach_remote` and
    :meth:`detach_remote`.
    """

    target_name = "source"
    #: The context of the driver-side observed classes (see :mod:`~rl_observers.sources.observed`).
    context = "remote_driver"
    #: The events the source emits.
    emits: tuple[str, ...] = ()
    #: Where the copies run, for error messages.
    where = "in other processes"
    #: Whether an observer raising where it runs reaches the caller (else ``on_error="raise"`` is refused).
    raise_reaches_caller = True
    #: What a source whose copies are gone is, for the error refusing to attach or remove.
    stopped = "that is shut down"

    def add(self, target: Any, observer: Any, on_error: str | None) -> None:
        state = _REMOTE.setdefault(target, _RemoteObservers)
        with state.lock:
            if any(a.observer is observer for a in state.entries):
                raise ValueError(
                    f"{observer!r} is already attached to this {type(target).__name__}; "
                    "an observer is attached at most once per source."
                )
            entry = resolve_observer(observer, self.emits, self.target_name, on_error)
            if entry.on_error == "raise" and not self.raise_reaches_caller:
                raise ValueError(refused_raise(observer, type(target).__name__, self.where))
            prepared = call_hook(observer, "prepare_copies", target)
            attached = _Attached(observer, entry.on_error, next(_TOKENS))
            try:
                payload = ship(observer, target, self.where)
                self.check(target, "attach an observer to")
                self.attach_remote(target, payload, attached.on_error, attached.token)
            except BaseException:
                if prepared:  # undoes prepare_copies (e.g. frees the logger namespace)
                    call_hook(observer, "copies_removed", target)
                raise
            state.entries = (*state.entries, attached)
            if len(state.entries) == 1:
                self.first_added(target)
            # the workers whose copies the observer's owner should hear from
            call_hook(observer, "copies_placed", target, self.copy_workers(target))

    def remove(self, target: Any, observer: Any) -> None:
        state = _REMOTE.get(target)
        found = next((a for a in state.entries if a.observer is observer), None) if state else None
        if found is None:
            raise ValueError(f"{observer!r} is not attached to this {type(target).__name__}.")
        error = None
        with state.lock:
            if self.is_running(target):
                self.check(target, "remove an observer from")  # raises before anything is sent
                try:
                    self.detach_remote(target, found.token)
                except Exception as raised:
                    # Forgotten all the same: a copy whose detaching raised was dropped first
                    # (``detach_here``), and a dead worker or actor took its copy with it.
                    error = raised
            state.entries = tuple(a for a in state.entries if a is not found)
            if not state.entries:
                self.last_removed(target)
            told = state.shut_down
        if not told:  # once per observer: it was told at shutdown
            call_hook(observer, "copies_removed", target)
        if error is not None:
            raise error

    def shut_down(self, target: Any) -> None:
        """Called on the driver once ``target`` shut down: each original's ``copies_removed`` runs once, in order.

        An original that raises is reported with a warning; the others are still told.
        """
        state = _REMOTE.get(target)
        if state is None:
            return
        with state.lock:
            if state.shut_down:
                return
            state.shut_down = True
            entries = state.entries
        for attached in entries:
            try:
                call_hook(attached.observer, "copies_removed", target)
            except Exception as error:  # the source is shut down already; report, go on
                torchrl_logger.warning(
                    f"rl_observers: {attached.observer!r} raised in copies_removed after its "
                    f"{type(target).__name__} shut down ({type(error).__name__}: {error})."
                )

    def observers(self, target: Any) -> tuple[Any, ...]:
        state = _REMOTE.get(target)
        return () if state is None else tuple(a.observer for a in state.entries)

    @contextlib.contextmanager
    def attached(self, target: Any) -> Iterator[tuple[tuple[Any, str, int], ...]]:
        """Holds ``target``'s record; yields ``(observer, on_error, token)`` per observer, in order.

        For a source that gains remote parts while observed (``RayCollector.add_collectors``).
        """
        state = _REMOTE.setdefault(target, _RemoteObservers)
        with state.lock:
            yield state.entries

    # -- what subclasses provide ----------------------------------------------------------------

    def is_running(self, target: Any) -> bool:
        """Whether the processes or actors holding the copies still exist."""
        return True

    def check(self, target: Any, action: str) -> None:
        """Raises if observers cannot be attached or removed now."""
        if not self.is_running(target):
            raise RuntimeError(f"cannot {action} a {type(target).__name__} {self.stopped}.")

    def attach_remote(self, target: Any, payload: bytes, on_error: str, token: int) -> None:
        raise NotImplementedError

    def copy_workers(self, target: Any) -> tuple[int | None, ...]:
        """The worker index each copy was placed with (``None``: a source that is not a worker)."""
        return ()

    def detach_remote(self, target: Any, token: int) -> None:
        raise NotImplementedError

    def first_added(self, target: Any) -> None:
        """Called once the source has its first observer: it becomes its driver-side observed class."""
        observed.switch_class(target, self.context)

    def last_removed(self, target: Any) -> None:
        """Called once the source has no observer left: it becomes torchrl's own object again."""
        observed.switch_back(target)


# -- the side where the data is: worker processes and actors ---------------------------------------

# The observer copies attached to each source of this process, by the driver's token.
_COPIES = IdentityMap()


class RemoteAttachError(RuntimeError):
    """An observer could not be attached or detached where its source runs (with the remote traceback as text)."""


def portable_error(error: BaseException, action: str) -> RemoteAttachError:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return RemoteAttachError(f"{action} failed: {type(error).__name__}: {error}\n\n{text}")


def attach_here(
    source: Any,
    payload: bytes,
    on_error: str,
    token: int,
    worker: int | None = None,
    num_workers: int | None = None,
    context: str | None = None,
    taken_when_asked_again: bool | None = None,
) -> None:
    """Attaches the observer copy in ``payload`` to ``source``, in the worker or actor where it runs.

    ``context`` selects the observed classes (``None``: the in-process ones;
    ``"ray_actor"``: a replay buffer inside a Ray actor). In a collector's
    worker, ``taken_when_asked_again`` says how its driver takes rollouts.
    """
    observer = None
    if taken_when_asked_again is not None:
        WORKER_DELIVERIES.taken_when_asked_again = taken_when_asked_again
    try:
        observer = cloudpickle.loads(payload)
        place(source, worker, num_workers)
        if context is None:
            source.add_observer(observer, on_error=on_error)
        else:
            observed.attach(source, observer, on_error, context)
        _COPIES.setdefault(source, dict)[token] = observer
    except Exception as error:
        # ``attached`` raises after the observer was added: leave no copy behind.
        if observer is not None and any(o is observer for o in source.observers):
            with contextlib.suppress(Exception):
                source.remove_observer(observer)
        raise portable_error(error, f"attaching an observer in process {os.getpid()}") from None


def detach_here(source: Any, token: int) -> None:
    """Detaches the observer copy of ``token`` from ``source``, where it runs."""
    try:
        observer = (_COPIES.get(source) or {}).pop(token, None)
        if observer is not None:
            source.remove_observer(observer)
    except Exception as error:
        raise portable_error(error, f"detaching an observer in process {os.getpid()}") from None
