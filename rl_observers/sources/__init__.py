"""Where events come from: the torchrl objects that can be observed.

:func:`install` adds ``add_observer``, ``remove_observer`` and ``observers`` to
torchrl's collectors and replay buffers. What attaching means for each
torchrl class is one table, :data:`rl_observers.sources.table.TABLE`, handed
to :mod:`~rl_observers.sources.observed` here and nowhere else: an
in-process source becomes its observed class (emitting as
:mod:`~rl_observers.sources.collectors`,
:mod:`~rl_observers.sources.replay_buffers` and
:mod:`~rl_observers.sources.distributed` say); a source whose data lives in
other processes or Ray actors forwards its observers there through its
remote kind (:class:`~rl_observers.sources.remote.RemoteKind`:
:mod:`~rl_observers.sources.multiprocess`, :mod:`~rl_observers.sources.ray`;
a shared buffer's copies, :mod:`~rl_observers.sources.shared_buffers`). A
class the table does not know is refused at ``add_observer``.
:mod:`~rl_observers.sources.placement` tells an observer where its source
runs.
"""

from __future__ import annotations

from typing import Any

from torchrl.collectors import BaseCollector
from torchrl.data import ReplayBuffer

from rl_observers import signals
from rl_observers.observer import ObserverHandle
from rl_observers.sources.observed import (
    ATTACH_LOCK,
    attach,
    detach,
    is_observable,
    observe,
    observers_of,
    release,
    use_table,
)
from rl_observers.sources.placement import SourceInfo, source_info
from rl_observers.sources.remote import kind_of
from rl_observers.sources.table import TABLE

use_table(TABLE)  # the one registration: every torchrl class -> how it is observed

__all__ = ["SourceInfo", "install", "observers_of", "source_info"]

_INSTALLED = False


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
    kind = kind_of(self)
    if kind is not None:
        kind.add(self, observer, on_error)
    else:
        attach(self, observer, on_error)
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
    kind = kind_of(self)
    if kind is not None:
        kind.remove(self, observer)
    else:
        detach(self, observer)


def _observers(self: Any) -> tuple[Any, ...]:
    """The attached observers, in call order."""
    kind = kind_of(self)
    if kind is not None:
        return kind.observers(self)
    observers = observers_of(self)
    return observers.observers if observers is not None else ()


def _on_receiver_connected(signal: Any, *, receiver: Any, sender: Any, weak: bool) -> None:
    # A receiver connected for one in-process source makes it emit, as an observer would.
    if is_observable(sender) and kind_of(sender) is None:
        observe(sender)


def _on_receiver_disconnected(signal: Any, *, receiver: Any, sender: Any) -> None:
    if is_observable(sender) and kind_of(sender) is None:
        release(sender)


def install() -> None:
    """Adds ``add_observer``, ``remove_observer`` and ``observers`` to torchrl's sources.

    Called by ``import rl_observers``; calling it again is harmless.
    """
    global _INSTALLED
    with ATTACH_LOCK:
        if _INSTALLED:
            return
        for cls in (BaseCollector, ReplayBuffer):
            cls.add_observer = add_observer  # type: ignore[attr-defined]
            cls.remove_observer = remove_observer  # type: ignore[attr-defined]
            cls.observers = property(_observers)  # type: ignore[attr-defined]
        for signal in map(signals.signal_for, signals.EVENT_PAYLOADS):
            signal.receiver_connected.connect(_on_receiver_connected, weak=False)
            signal.receiver_disconnected.connect(_on_receiver_disconnected, weak=False)
        _INSTALLED = True
