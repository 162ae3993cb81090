"""What each torchrl class becomes when an observer is attached: the one table, installed.

A row reads "a ``<class>`` is observed by ``<mixin>`` with ``<observer list>``",
per context. A class matches by the nearest class of its MRO named here; a
class not named, or a subclass replacing a method of its row's ``loop``, is
refused at ``add_observer``. See :ref:`distributed-per-class`.

Examples:
    >>> import rl_observers
    >>> from torchrl.collectors import MultiSyncCollector
    >>> from rl_observers.sources.observed import how_observed
    >>> how_observed(MultiSyncCollector).kind.where
    'in its worker processes'
"""

from __future__ import annotations

from typing import Any

from torchrl.collectors import BaseCollector
from torchrl.data import ReplayBuffer

from rl_observers import signals
from rl_observers.observer import ObserverHandle, ObserverList
from rl_observers.remote.distributed import (
    DistributedCollectorObservers,
    ObservedDistributedCollector,
)
from rl_observers.remote.multiprocess import MULTIPROCESS_COLLECTOR, _DriverObservedMultiCollector
from rl_observers.remote.ray import observed as ray
from rl_observers.remote.shared_buffers import SharedBufferObservers
from rl_observers.remote.shipping import kind_of
from rl_observers.sources.collectors import CollectorObservers, ObservedCollector
from rl_observers.sources.observed import (
    ATTACH_LOCK,
    How,
    attach,
    detach,
    is_observable,
    observe,
    observers_of,
    release,
    use_table,
)
from rl_observers.sources.replay_buffers import (
    PREFETCHING,
    ObservedPrefetchingReplayBuffer,
    ObservedReplayBuffer,
    PrefetchingBufferObservers,
    ReplayBufferObservers,
    prefetching,
)

__all__ = ["TABLE", "install"]

_COLLECTORS = "torchrl.collectors"
_DISTRIBUTED = "torchrl.collectors.distributed"
_BUFFERS = "torchrl.data.replay_buffers"

# The methods that emit a collector's events: a subclass replacing one would be mute.
_COLLECTION_LOOP = ("__iter__", "iterator", "rollout")
_DRIVER_LOOP = ("__iter__",)

_LOCAL_COLLECTOR = How(ObservedCollector, CollectorObservers, loop=_COLLECTION_LOOP)
_MULTIPROCESS = How(_DriverObservedMultiCollector, ObserverList, kind=MULTIPROCESS_COLLECTOR)
_DISTRIBUTED_COLLECTOR = How(ObservedDistributedCollector, DistributedCollectorObservers, loop=_DRIVER_LOOP)
_LOCAL_BUFFER = How(ObservedReplayBuffer, SharedBufferObservers, variant=prefetching)
_PREFETCHING_BUFFER = How(ObservedPrefetchingReplayBuffer, PrefetchingBufferObservers)
_ACTOR_BUFFER = How(ray._ActorObservedReplayBuffer, ReplayBufferObservers)
_ACTOR_TENSORDICT_BUFFER = How(ray._ActorObservedTensorDictReplayBuffer, ReplayBufferObservers)

# torchrl's in-process replay buffers, and whether their actor-side observation is the TensorDict one.
_BUFFER_CLASSES = {
    "replay_buffers:ReplayBuffer": False,
    "replay_buffers:PrioritizedReplayBuffer": False,
    "replay_buffers:TensorDictReplayBuffer": True,
    "replay_buffers:TensorDictPrioritizedReplayBuffer": True,
    "replay_buffers:RemoteTensorDictReplayBuffer": True,
    "replay_buffers:ReplayBufferEnsemble": False,
    "her:HERReplayBuffer": True,
}

#: ``{context: {"module:qualname" of a torchrl class: How}}``: the one answer to "how is it observed?".
TABLE: dict[str | None, dict[str, How]] = {
    None: {
        f"{_COLLECTORS}._single:Collector": _LOCAL_COLLECTOR,
        f"{_COLLECTORS}._async_batched:AsyncBatchedCollector": _LOCAL_COLLECTOR,
        f"{_COLLECTORS}._multi_base:MultiCollector": _MULTIPROCESS,
        f"{_COLLECTORS}._multi_sync:MultiSyncCollector": _MULTIPROCESS,
        f"{_COLLECTORS}._multi_async:MultiAsyncCollector": _MULTIPROCESS,
        f"{_COLLECTORS}._single_async:AsyncCollector": _MULTIPROCESS,
        f"{_DISTRIBUTED}.ray:RayCollector": How(ray._DriverObservedRayCollector, ObserverList, kind=ray.RAY_COLLECTOR),
        f"{_DISTRIBUTED}.generic:DistributedCollector": _DISTRIBUTED_COLLECTOR,
        f"{_DISTRIBUTED}.sync:DistributedSyncCollector": _DISTRIBUTED_COLLECTOR,
        f"{_DISTRIBUTED}.rpc:RPCCollector": _DISTRIBUTED_COLLECTOR,
        **{f"{_BUFFERS}.{name}": _LOCAL_BUFFER for name in _BUFFER_CLASSES},
        f"{_BUFFERS}.ray_buffer:RayReplayBuffer": How(
            ray._DriverObservedRayReplayBuffer, ObserverList, kind=ray.RAY_REPLAY_BUFFER
        ),
    },
    # A buffer built with prefetch=N (torchrl refuses to share one): sampling emits at hand-over.
    PREFETCHING: {f"{_BUFFERS}.{name}": _PREFETCHING_BUFFER for name in _BUFFER_CLASSES},
    # Inside a RayReplayBuffer's actor: writes and samples seen through private lookups.
    ray.ACTOR: {
        f"{_BUFFERS}.{name}": _ACTOR_TENSORDICT_BUFFER if tensordict else _ACTOR_BUFFER
        for name, tensordict in _BUFFER_CLASSES.items()
    },
    # The Ray-transport client an observed RayReplayBuffer hands out.
    ray.CLIENT: {
        f"{_BUFFERS}.ray_buffer:_RayReplayBufferClient": How(ray._ObservedRayReplayBufferClient, ObserverList),
    },
}

use_table(TABLE)  # the one registration: every torchrl class -> how it is observed


def add_observer(self: Any, observer: Any, *, on_error: str | None = None) -> ObserverHandle:
    """Attaches ``observer`` to this collector or replay buffer.

    The observer runs where the data is: in this process, in every worker of a
    multiprocessing collector, or in the Ray actors of a Ray collector or
    replay buffer. Observers are called in registration order.

    Args:
        observer: an object with ``on_<event>`` methods (see
            :class:`~rl_observers.Observer`), or a callable receiving each
            ``post_collect`` batch like ``post_collect_hook``.

    Keyword Args:
        on_error (str, optional): when the observer raises: ``"warn"`` warns
            once per failure streak, ``"raise"`` propagates to the caller (the
            later observers miss that event; ``shutdown`` still reaches all),
            ``"ignore"`` goes on silently. Defaults to the observer's
            ``on_error`` attribute, else ``"warn"``. Multiprocessing and Ray
            collectors refuse ``"raise"`` (it would kill the worker unseen).

    Returns:
        An :class:`~rl_observers.ObserverHandle`.

    Raises:
        TypeError: if ``observer`` is neither an observer nor a callable, has
            an event method with the wrong signature, or observes none of the
            events this source emits.
        ValueError: for an ``on_*`` method that is not an event, an unknown
            ``on_error``, ``"raise"`` on a multiprocessing or Ray collector,
            or an observer already attached.
        RuntimeError: if the source is shut down or a worker is dead.
        Exception: what the observer's ``attached`` raises (not attached then).

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
    """Detaches ``observer``; with the last one gone the source runs exactly torchrl's code again.

    A dead worker of a multiprocessing collector is skipped and warned about
    once.

    Raises:
        ValueError: if ``observer`` is not attached to this source.
        RuntimeError: if a ``MultiAsyncCollector`` is being iterated (nothing
            is removed).
        RemoteAttachError: if detaching a copy failed where it runs; the
            observer is removed from ``observers`` all the same.
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
    """Adds ``add_observer``, ``remove_observer`` and ``observers`` to torchrl's sources; idempotent."""
    with ATTACH_LOCK:  # (blinker connects a receiver once, however often it is asked)
        for cls in (BaseCollector, ReplayBuffer):
            cls.add_observer = add_observer  # type: ignore[attr-defined]
            cls.remove_observer = remove_observer  # type: ignore[attr-defined]
            cls.observers = property(_observers)  # type: ignore[attr-defined]
        for signal in map(signals.signal_for, signals.EVENT_PAYLOADS):
            signal.receiver_connected.connect(_on_receiver_connected, weak=False)
            signal.receiver_disconnected.connect(_on_receiver_disconnected, weak=False)
