"""Sources whose data lives in other processes: multiprocessing and Ray.

Observers of these sources run next to the data, as copies: in every worker
process of a ``MultiSyncCollector`` / ``MultiAsyncCollector``, in every remote
collector actor of a ``RayCollector``, inside the actor of a
``RayReplayBuffer``. Attaching ships the observer once (pickled with
cloudpickle, checked on the driver first) and installs the copy on the
torchrl object that makes the data, with the same observed classes and
observer lists as an in-process source; batches never cross a process
boundary because of an observer. Each copy keeps its own state; use
:func:`rl_observers.sources.placement.source_info` in an observer to learn which worker
it runs in, and a channel handle to send reduced results back.

The driver keeps the original observers, in registration order, for
``target.observers`` and ``remove_observer``; the copies are not the
originals: ``attached`` / ``detached`` are called on the copies, where they
run, and the originals never see events.

How each kind is reached (torchrl 0.14.1):

* multiprocessing collectors: a ``"cascade_execute"`` message on each
  worker's control pipe runs a function on the worker's inner collector,
  between two batches (see :mod:`rl_observers.remote.multiprocess`);
* Ray collectors and replay buffers: ``actor.__ray_call__.remote(fn, ...)``
  runs ``fn(actor_instance, ...)`` inside the actor (see
  :mod:`rl_observers.remote.ray.observed`);
* shared replay buffers (``shared=True``, written by the workers of a
  multiprocessing collector) are in-process sources whose copies in the
  workers carry the observers they had when the workers started; later
  changes are mirrored to those copies (see
  :mod:`rl_observers.remote.multiprocess`).

Errors surface on the driver, at ``add_observer``: an invalid observer
(``TypeError`` / ``ValueError``, before anything is sent), an unpicklable one
(``TypeError``), a source that is shut down or has a dead worker
(``RuntimeError``), or a failure where the copy runs, for example in its
``attached`` method (:class:`RemoteAttachError`, with the remote traceback;
the copies already attached elsewhere are removed again).

``on_error="raise"`` is refused (``ValueError``) where an error raised by a
copy cannot reach the caller (``RemoteKind.raise_reaches_caller``):
in the workers of a multiprocessing collector it kills the worker, in a
``RayCollector``'s actor it kills the actor, and the driver only learns that
a worker failed. In a ``RayReplayBuffer``'s actor Ray hands the error to the
caller and the actor lives on, so ``"raise"`` is kept there.

When the source shuts down, its kind calls :meth:`RemoteKind.shut_down`:
each original's ``copies_removed`` runs then (once; ``remove_observer``
afterwards does not call it again), so an original does not wait for its
removal or for garbage collection to finish what its copies did.

``remove_observer`` always leaves the driver's record consistent: once the
copies were asked to detach, the observer is forgotten on the driver even if
detaching failed somewhere (a copy is dropped before its ``detached`` runs,
and a dead worker took its copy with it); the error, if any, is raised
afterwards.

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
from typing import Any

import cloudpickle
from torchrl._utils import logger as torchrl_logger

from rl_observers.observer import dumps, refused_raise, resolve_observer
from rl_observers.sources import observed
from rl_observers.sources.placement import IdentityMap, place

__all__ = [
    "RemoteAttachError",
    "RemoteKind",
    "attach_here",
    "detach_here",
    "kind_of",
    "portable_error",
    "ship",
]

def kind_of(target: Any) -> RemoteKind | None:
    """Returns how to attach observers to ``target`` when its data is remote, else ``None``.

    Read from the table (:data:`rl_observers.targets.TABLE`), once per class.
    """
    how = observed.how_observed(type(target))
    return None if how is None else how.kind


# -- the driver side -------------------------------------------------------------------------------


class _Attached:
    """One observer attached to a remote source: the original, its policy, its copies' token."""

    __slots__ = ("observer", "on_error", "token")

    def __init__(self, observer: Any, on_error: str, token: int) -> None:
        self.observer = observer
        self.on_error = on_error
        self.token = token


class _RemoteObservers:
    """The driver's record of what is attached to one remote source."""

    __slots__ = ("entries", "lock", "shut_down")

    def __init__(self) -> None:
        self.entries: tuple[_Attached, ...] = ()
        self.lock = threading.RLock()
        self.shut_down = False  # the originals were told that their copies are gone


_REMOTE = IdentityMap()
_TOKENS = itertools.count()


def ship(observer: Any, target: Any, where: str) -> bytes:
    """Pickles ``observer`` with cloudpickle, raising a clear error if it cannot travel.

    Checked on the driver, so an unpicklable observer fails at ``add_observer``
    instead of killing a worker.
    """
    try:
        return dumps(observer, by_value=True)
    except Exception as error:
        raise TypeError(
            f"observers of a {type(target).__name__} run {where} and must be picklable "
            f"with cloudpickle; {observer!r} is not ({type(error).__name__}: {error})."
        ) from error


class RemoteKind:
    """How observers reach one kind of remote source; subclasses say how to get there.

    ``add`` / ``remove`` / ``observers`` are what ``add_observer``,
    ``remove_observer`` and ``observers`` delegate to. Subclasses implement
    :meth:`check`, :meth:`attach_remote` and :meth:`detach_remote`. With its
    first observer the driver-side object becomes its observed class in the
    kind's :attr:`context` (the table's row for its class gives the mixin),
    and a plain torchrl object again once the last one is removed
    (:meth:`first_added`, :meth:`last_removed`).
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
            prepare = getattr(observer, "prepare_copies", None)
            if callable(prepare):
                prepare(target)
            attached = _Attached(observer, entry.on_error, next(_TOKENS))
            try:
                payload = ship(observer, target, self.where)
                self.check(target, "attach an observer to")
                self.attach_remote(target, payload, attached.on_error, attached.token)
            except BaseException:
                removed = getattr(observer, "copies_removed", None)
                if callable(prepare) and callable(removed):
                    removed(target)  # undoes prepare_copies (e.g. frees the logger namespace)
                raise
            state.entries = (*state.entries, attached)
            if len(state.entries) == 1:
                self.first_added(target)
            placed = getattr(observer, "copies_placed", None)
            if callable(placed):  # the workers whose copies the observer's owner should hear from
                placed(target, self.copy_workers(target))

    def remove(self, target: Any, observer: Any) -> None:
        state = _REMOTE.get(target)
        found = None if state is None else next(
            (a for a in state.entries if a.observer is observer), None
        )
        if found is None:
            raise ValueError(f"{observer!r} is not attached to this {type(target).__name__}.")
        error = None
        with state.lock:
            running = self.is_running(target)
            if running:
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
        removed = getattr(observer, "copies_removed", None)
        if callable(removed) and not told:  # once per observer: it was told at shutdown
            removed(target)
        if error is not None:
            raise error

    def shut_down(self, target: Any) -> None:
        """Called on the driver once ``target`` shut down: its copies went with its processes.

        Each original's ``copies_removed`` runs once, in registration order,
        so that it does at shutdown what it would do when removed (a
        ``LoggerObserver`` logs its last aggregate windows and frees its
        namespace). An original that raises is reported with a warning; the
        others are still told.
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
            removed = getattr(attached.observer, "copies_removed", None)
            if not callable(removed):
                continue
            try:
                removed(target)
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

        For a source that gains remote parts while observed (``RayCollector.add_collectors``):
        while the record is held no observer is attached or removed, so the new parts can be
        given exactly the observers the others have, under the same tokens (which is what
        lets ``remove_observer`` reach them too).
        """
        state = _REMOTE.setdefault(target, _RemoteObservers)
        with state.lock:
            yield tuple((a.observer, a.on_error, a.token) for a in state.entries)

    # -- what subclasses provide ----------------------------------------------------------------

    def is_running(self, target: Any) -> bool:
        """Whether the processes or actors holding the copies still exist."""
        return True

    def check(self, target: Any, action: str) -> None:
        """Raises if observers cannot be attached or removed now."""

    def attach_remote(self, target: Any, payload: bytes, on_error: str, token: int) -> None:
        raise NotImplementedError

    def copy_workers(self, target: Any) -> tuple[int | None, ...]:
        """The worker index each copy was placed with (``None``: a source that is not a worker).

        Told to the original (``copies_placed``) once its copies are attached.
        """
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
    """An observer could not be attached or detached where its source runs.

    Carries the remote traceback as text, so that it pickles across pipes and
    Ray whatever the original exception was.
    """


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
) -> None:
    """Attaches the observer copy in ``payload`` to ``source``, in the process where it runs.

    Runs in a worker process or an actor. ``context`` selects the observed
    classes (``None``: the in-process ones, also used by nested remote
    sources; ``"ray_actor"``: a replay buffer inside a Ray actor).
    """
    observer = None
    try:
        observer = cloudpickle.loads(payload)
        place(source, worker, num_workers)
        if context is None:
            source.add_observer(observer, on_error=on_error)
        else:
            observed.attach(source, observer, on_error, context)
        copies = _COPIES.setdefault(source, dict)
        copies[token] = observer
    except Exception as error:
        # ``attached`` raises after the observer was added: leave no copy behind.
        if observer is not None and any(o is observer for o in source.observers):
            with contextlib.suppress(Exception):
                source.remove_observer(observer)
        raise portable_error(error, f"attaching an observer in process {_pid()}") from None


def detach_here(source: Any, token: int) -> None:
    """Detaches the observer copy of ``token`` from ``source``, where it runs."""
    try:
        copies = _COPIES.get(source) or {}
        observer = copies.pop(token, None)
        if observer is not None:
            source.remove_observer(observer)
    except Exception as error:
        raise portable_error(error, f"detaching an observer in process {_pid()}") from None


def _pid() -> int:
    return os.getpid()
