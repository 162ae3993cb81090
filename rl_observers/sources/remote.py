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
  between two batches (see :mod:`rl_observers.sources.multiprocess`);
* Ray collectors and replay buffers: ``actor.__ray_call__.remote(fn, ...)``
  runs ``fn(actor_instance, ...)`` inside the actor (see
  :mod:`rl_observers.sources.ray`);
* shared replay buffers (``shared=True``, written by the workers of a
  multiprocessing collector) are in-process sources whose copies in the
  workers carry the observers they had when the workers started; later
  changes are mirrored to those copies (see
  :mod:`rl_observers.sources.multiprocess`).

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

``remove_observer`` always leaves the driver's record consistent: once the
copies were asked to detach, the observer is forgotten on the driver even if
detaching failed somewhere (a copy is dropped before its ``detached`` runs,
and a dead worker took its copy with it); the error, if any, is raised
afterwards.

Examples:
    >>> import rl_observers
    >>> from rl_observers.sources.remote import kind_of
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> kind_of(ReplayBuffer(storage=LazyTensorStorage(10))) is None  # in-process
    True
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import traceback
from typing import Any

import cloudpickle
from torchrl.collectors import BaseCollector

from rl_observers.observer import resolve_observer
from rl_observers.sources.observed import observed_class
from rl_observers.sources.placement import IdentityMap, place

__all__ = ["RemoteKind", "attach_here", "detach_here", "kind_of", "ship"]

_MISSING = object()
_KIND_BY_CLASS: dict[type, Any] = {}


def kind_of(target: Any) -> RemoteKind | None:
    """Returns how to attach observers to ``target`` when its data is remote, else ``None``.

    Decided once per class; a class is remote when it is a torchrl
    multiprocessing collector, ``RayCollector`` or ``RayReplayBuffer``.
    """
    cls = type(target)
    kind = _KIND_BY_CLASS.get(cls, _MISSING)
    if kind is _MISSING:
        kind = _classify(cls)
        _KIND_BY_CLASS[cls] = kind
    return kind


def _classify(cls: type) -> RemoteKind | None:
    # A Ray class can only be the type of an instance once its module was imported.
    ray_buffer = sys.modules.get("torchrl.data.replay_buffers.ray_buffer")
    if ray_buffer is not None and issubclass(cls, ray_buffer.RayReplayBuffer):
        from rl_observers.sources import ray as _ray

        return _ray.RAY_REPLAY_BUFFER
    ray_collector = sys.modules.get("torchrl.collectors.distributed.ray")
    if ray_collector is not None and issubclass(cls, ray_collector.RayCollector):
        from rl_observers.sources import ray as _ray

        return _ray.RAY_COLLECTOR
    from torchrl.collectors import MultiCollector

    if issubclass(cls, MultiCollector):
        from rl_observers.sources import multiprocess as _multiprocess

        return _multiprocess.MULTIPROCESS_COLLECTOR
    return None


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

    __slots__ = ("entries", "lock")

    def __init__(self) -> None:
        self.entries: tuple[_Attached, ...] = ()
        self.lock = threading.RLock()


_REMOTE = IdentityMap()
_TOKENS = itertools.count()


def ship(observer: Any, target: Any, where: str) -> bytes:
    """Pickles ``observer`` with cloudpickle, raising a clear error if it cannot travel.

    Checked on the driver, so an unpicklable observer fails at ``add_observer``
    instead of killing a worker.
    """
    try:
        return cloudpickle.dumps(observer)
    except Exception as error:
        raise TypeError(
            f"observers of a {type(target).__name__} run {where} and must be picklable "
            f"with cloudpickle; {observer!r} is not ({type(error).__name__}: {error})."
        ) from error


class RemoteKind:
    """How observers reach one kind of remote source; subclasses say how to get there.

    ``add`` / ``remove`` / ``observers`` are what ``add_observer``,
    ``remove_observer`` and ``observers`` delegate to. Subclasses implement
    :meth:`check`, :meth:`attach_remote` and :meth:`detach_remote`, and may
    react to the first and last observer (:meth:`first_added`,
    :meth:`last_removed`).
    """

    target_name = "source"
    events: tuple[str, ...] = ()
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
            entry = resolve_observer(observer, self.events, self.target_name, on_error)
            if entry.on_error == "raise" and not self.raise_reaches_caller:
                raise ValueError(
                    f"on_error='raise' cannot be honoured for an observer of a {type(target).__name__}: "
                    f"its copies run {self.where}, where an error cannot reach the caller (it would "
                    "kill the worker, and the driver would only learn that a worker failed). Use "
                    f"on_error='warn' (the default) or 'ignore' for {observer!r}."
                )
            prepare = getattr(observer, "prepare_copies", None)
            if callable(prepare):
                prepare(target)
            payload = ship(observer, target, self.where)
            self.check(target, "attach an observer to")
            attached = _Attached(observer, entry.on_error, next(_TOKENS))
            self.attach_remote(target, payload, attached.on_error, attached.token)
            state.entries = (*state.entries, attached)
            if len(state.entries) == 1:
                self.first_added(target)

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
        removed = getattr(observer, "copies_removed", None)
        if callable(removed):
            removed(target)
        if error is not None:
            raise error

    def observers(self, target: Any) -> tuple[Any, ...]:
        state = _REMOTE.get(target)
        return () if state is None else tuple(a.observer for a in state.entries)

    # -- what subclasses provide ----------------------------------------------------------------

    def is_running(self, target: Any) -> bool:
        """Whether the processes or actors holding the copies still exist."""
        return True

    def check(self, target: Any, action: str) -> None:
        """Raises if observers cannot be attached or removed now."""

    def attach_remote(self, target: Any, payload: bytes, on_error: str, token: int) -> None:
        raise NotImplementedError

    def detach_remote(self, target: Any, token: int) -> None:
        raise NotImplementedError

    def first_added(self, target: Any) -> None:
        """Called once the source has its first observer."""

    def last_removed(self, target: Any) -> None:
        """Called once the source has no observer left."""


# -- the side where the data is: worker processes and actors ---------------------------------------

# The modules registering the observed classes of each context.
_CONTEXT_MODULES = {"ray_actor": "rl_observers.sources.ray"}
# The observer copies attached to each source of this process, by the driver's token.
_COPIES = IdentityMap()


class RemoteAttachError(RuntimeError):
    """An observer could not be attached or detached where its source runs.

    Carries the remote traceback as text, so that it pickles across pipes and
    Ray whatever the original exception was.
    """


def _portable(error: BaseException, action: str) -> RemoteAttachError:
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
            _attach_in_context(source, observer, on_error, context)
        copies = _COPIES.setdefault(source, dict)
        copies[token] = observer
    except Exception as error:
        # ``attached`` raises after the observer was added: leave no copy behind.
        if observer is not None and any(o is observer for o in source.observers):
            with contextlib.suppress(Exception):
                source.remove_observer(observer)
        raise _portable(error, f"attaching an observer in process {_pid()}") from None


def detach_here(source: Any, token: int) -> None:
    """Detaches the observer copy of ``token`` from ``source``, where it runs."""
    try:
        copies = _COPIES.get(source) or {}
        observer = copies.pop(token, None)
        if observer is not None:
            source.remove_observer(observer)
    except Exception as error:
        raise _portable(error, f"detaching an observer in process {_pid()}") from None


def _attach_in_context(source: Any, observer: Any, on_error: str, context: str) -> None:
    import importlib

    from rl_observers import sources as targets

    importlib.import_module(_CONTEXT_MODULES[context])  # registers the context's mixins
    with targets._ATTACH_LOCK:
        observers = source.__dict__.get("_rl_observers")
        if observers is None:
            observers = targets._observer_list_type(source)(source)
            source._rl_observers = observers
            source.__class__ = observed_class(type(source), context)
        try:
            observers.add(observer, on_error)
        except BaseException:
            targets._release_if_idle(source)
            raise
    attached = getattr(observer, "attached", None)
    if callable(attached):
        attached(source)


def _pid() -> int:
    import os

    return os.getpid()


def _call_in_collector(self: BaseCollector, fn: Any, *args: Any) -> Any:
    """Runs ``fn(self, *args)``: the worker-side target of ``cascade_execute``.

    Installed on ``BaseCollector`` as ``_rl_observers_call``, the way
    ``__ray_call__`` is on Ray actors; nothing calls it on a collection path.
    """
    return fn(self, *args)


BaseCollector._rl_observers_call = _call_in_collector  # type: ignore[attr-defined]
