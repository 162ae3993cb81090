"""Where events come from: the torchrl objects that can be observed.

:func:`install` adds ``add_observer``, ``remove_observer`` and ``observers`` to
torchrl's collectors and replay buffers. What attaching means depends on
where the data lives: an in-process source becomes its observed subclass; a
source whose data lives in other processes or Ray actors forwards its
observers there (:mod:`rl_observers.targets.remote`).
"""

from __future__ import annotations

import threading
from typing import Any

from blinker import ANY
from torchrl.collectors import BaseCollector
from torchrl.data import ReplayBuffer

from rl_observers import signals
from rl_observers.observer import ObserverHandle, ObserverList
from rl_observers.targets._multiprocess import track_shared_buffer_writers
from rl_observers.targets._observed import base_class, observed_class
from rl_observers.targets.collectors import CollectorObservers
from rl_observers.targets.replay_buffers import ReplayBufferObservers

__all__ = ["install", "observers_of"]

_ATTACH_LOCK = threading.RLock()
_INSTALLED = False


def _observer_list_type(target: Any) -> type[ObserverList]:
    if isinstance(target, BaseCollector):
        return CollectorObservers
    if isinstance(target, ReplayBuffer):
        return ReplayBufferObservers
    raise TypeError(
        f"rl_observers observes torchrl collectors and replay buffers, got {type(target).__name__}."
    )


def _remote_kind(target: Any) -> Any | None:
    from rl_observers.targets import remote

    return remote.kind_of(target)


def observers_of(target: Any, create: bool = False) -> ObserverList | None:
    """Returns the observer list of an in-process ``target``, making it observed if ``create``."""
    observers = target.__dict__.get("_rl_observers")
    if observers is None and create:
        with _ATTACH_LOCK:
            observers = target.__dict__.get("_rl_observers")
            if observers is None:
                observers = _observer_list_type(target)(target)
                target._rl_observers = observers
                target.__class__ = observed_class(type(target))
    return observers


def _release_if_idle(target: Any) -> None:
    """Makes ``target`` a plain torchrl object again once nothing observes it."""
    with _ATTACH_LOCK:
        observers = target.__dict__.get("_rl_observers")
        if observers is None or observers.entries or _has_source_receivers(target):
            return
        target.__class__ = base_class(type(target))
        del target._rl_observers


def _has_source_receivers(target: Any) -> bool:
    # blinker keeps receivers per sender id; ``_by_sender`` is its documented-by-use index.
    return any(sig._by_sender.get(id(target)) for sig in _all_signals())


def _all_signals() -> tuple[Any, ...]:
    return tuple(signals.signal_for(e) for e in signals.EVENT_PAYLOADS)


# -- the methods installed on torchrl's classes ----------------------------------------------------


def add_observer(self: Any, observer: Any, *, on_error: str | None = None) -> ObserverHandle:
    """Attaches ``observer`` to this collector or replay buffer.

    The observer runs where the data is: in this process for a local source,
    inside every worker of a multiprocessing collector, inside the Ray actors
    of a Ray collector or Ray replay buffer. Observers of one source are
    called in registration order.

    Args:
        observer: an object with ``on_<event>`` methods (see
            :class:`~rl_observers.Observer`), or a plain callable, which
            receives each ``post_collect`` batch like ``post_collect_hook``.

    Keyword Args:
        on_error (str, optional): what happens when the observer raises:
            ``"warn"`` logs one warning per failure streak (from the first
            failing event until every failing event succeeded again) and
            goes on, ``"raise"`` propagates the error to the caller (the
            observers after it miss that event; ``shutdown`` still reaches
            them all and the source still shuts down), ``"ignore"`` goes
            on silently. Defaults to the observer's own ``on_error`` attribute
            if it has one, else ``"warn"``. Multiprocessing and Ray
            collectors refuse ``"raise"``: their observers run in worker
            processes or actors, where raising kills the worker and the
            error never reaches the caller.

    Returns:
        An :class:`~rl_observers.ObserverHandle`; ``handle.remove()`` (or
        leaving its ``with`` block) detaches the observer.

    Raises:
        TypeError: if ``observer`` is neither an observer nor a callable, has
            an event method with the wrong signature, or observes none of the
            events this source emits.
        ValueError: for an ``on_*`` method that is not an event, an unknown
            ``on_error``, ``on_error="raise"`` on a multiprocessing or Ray
            collector, or an observer that is already attached.
        RuntimeError: if the source is shut down, or one of its worker
            processes is dead (nothing is attached).
        Exception: whatever the observer's ``attached`` method raises; the
            observer is then not attached.

    Examples:
        >>> import rl_observers
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> env = CountingEnv()
        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=16)
        >>> sizes = []
        >>> handle = collector.add_observer(lambda batch: sizes.append(batch.numel()))
        >>> for _ in collector:
        ...     pass
        >>> sizes
        [8, 8]
        >>> collector.shutdown()
    """
    kind = _remote_kind(self)
    if kind is not None:
        kind.add(self, observer, on_error)
    else:
        with _ATTACH_LOCK:
            observers = observers_of(self, create=True)
            assert observers is not None
            try:
                observers.add(observer, on_error)
            except BaseException:
                _release_if_idle(self)
                raise
        attached = getattr(observer, "attached", None)
        if callable(attached):
            try:
                attached(self)
            except BaseException:
                # An observer that refuses its source is not left attached half-way.
                with _ATTACH_LOCK:
                    observers.remove(observer)
                    _release_if_idle(self)
                raise
    return ObserverHandle(self, observer)


def remove_observer(self: Any, observer: Any) -> None:
    """Detaches ``observer`` from this collector or replay buffer.

    Once the last observer is removed the source runs exactly torchrl's own
    code again. On a multiprocessing collector with a dead worker, the
    observer is removed from every live worker and from ``observers``, and
    the dead worker is reported once with a warning.

    Args:
        observer: an observer previously given to :meth:`add_observer`.

    Raises:
        ValueError: if ``observer`` is not attached to this source.
        RuntimeError: if a ``MultiAsyncCollector`` is being iterated (nothing
            is removed).
        RemoteAttachError: if detaching a copy failed where it runs (for
            example in its ``detached`` method); the observer is removed
            from ``observers`` all the same.
    """
    kind = _remote_kind(self)
    if kind is not None:
        kind.remove(self, observer)
        return
    observers = observers_of(self)
    removed = observers.remove(observer) if observers is not None else None
    if removed is None:
        raise ValueError(f"{observer!r} is not attached to this {type(self).__name__}.")
    _release_if_idle(self)
    detached = getattr(observer, "detached", None)
    if callable(detached):
        detached(self)


def _observers(self: Any) -> tuple[Any, ...]:
    """The attached observers, in call order."""
    kind = _remote_kind(self)
    if kind is not None:
        return kind.observers(self)
    observers = observers_of(self)
    return observers.observers if observers is not None else ()


def _on_receiver_connected(signal: Any, *, receiver: Any, sender: Any, weak: bool) -> None:
    if sender is ANY or not isinstance(sender, (BaseCollector, ReplayBuffer)):
        return
    if _remote_kind(sender) is None:
        observers_of(sender, create=True)


def _on_receiver_disconnected(signal: Any, *, receiver: Any, sender: Any) -> None:
    if sender is not ANY and isinstance(sender, (BaseCollector, ReplayBuffer)):
        if _remote_kind(sender) is None:
            _release_if_idle(sender)


def install() -> None:
    """Adds ``add_observer``, ``remove_observer`` and ``observers`` to torchrl's sources.

    Called by ``import rl_observers``; calling it again is harmless.
    """
    global _INSTALLED
    with _ATTACH_LOCK:
        if _INSTALLED:
            return
        for cls in (BaseCollector, ReplayBuffer):
            cls.add_observer = add_observer  # type: ignore[attr-defined]
            cls.remove_observer = remove_observer  # type: ignore[attr-defined]
            cls.observers = property(_observers)  # type: ignore[attr-defined]
        track_shared_buffer_writers()
        for signal in _all_signals():
            signal.receiver_connected.connect(_on_receiver_connected, weak=False)
            signal.receiver_disconnected.connect(_on_receiver_disconnected, weak=False)
        _INSTALLED = True
