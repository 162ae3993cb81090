"""What each torchrl class becomes when an observer is attached: the one table.

Read a row as "a ``<class>`` is observed by ``<mixin>``, keeps its observers
in ``<observer list>``, and, for a remote kind, its observers run as copies
``<kind.where>``". A class is matched by the nearest class of its MRO named
here (a user's subclass of ``Collector`` is a ``Collector``), never by the
order of rows or imports; a class not named here is refused at
``add_observer`` with what to use instead (see
:func:`rl_observers.sources.observed.refusal`):

* a torchrl class this table does not name (a future torchrl release's),
* a subclass that replaces a method of its row's ``loop`` (for an
  in-process collector, the collection loop whose hook reads emit the
  events: its observers would hear nothing).

Where the user holds the object (context ``None``):

* ``Collector``, ``AsyncBatchedCollector``: ``ObservedCollector``; observers
  run in this process, called from the collection loop's hook-slot reads.
* ``MultiSyncCollector``, ``MultiAsyncCollector``, ``AsyncCollector``
  (``MultiCollector``): ``MultiprocessCollectorKind``; one copy per worker
  process.
* ``RayCollector``: ``RayCollectorKind``; one copy per remote collector actor.
* ``DistributedCollector``, ``DistributedSyncCollector``, ``RPCCollector``:
  ``ObservedDistributedCollector``; on the driver, on the batches it yields.
* ``ReplayBuffer`` and torchrl's subclasses (prioritized, ``TensorDict*``,
  HER, remote, ensemble): ``ObservedReplayBuffer``; in this process, and in
  every worker writing into it when it is shared. One built with
  ``prefetch=N`` takes its row in the ``"prefetching"`` context instead:
  ``ObservedPrefetchingReplayBuffer``, whose ``sample()`` emits for the
  batch it hands over.
* ``RayReplayBuffer``: ``RayReplayBufferKind``; one copy inside the buffer's
  actor.

Inside a ``RayReplayBuffer``'s actor (context ``"ray_actor"``), the buffer
is observed through the private lookups torchrl's public methods make; the
clients an observed ``RayReplayBuffer`` hands out (context ``"ray_client"``)
route ``stats()`` / ``empty()`` through the actor's observers.

Examples:
    >>> import rl_observers
    >>> from torchrl.collectors import MultiSyncCollector
    >>> from rl_observers.sources.observed import how_observed
    >>> how_observed(MultiSyncCollector).kind.where
    'in its worker processes'
"""

from __future__ import annotations

from rl_observers.observer import ObserverList
from rl_observers.sources import ray
from rl_observers.sources.collectors import CollectorObservers, ObservedCollector
from rl_observers.sources.distributed import (
    DistributedCollectorObservers,
    ObservedDistributedCollector,
)
from rl_observers.sources.multiprocess import MULTIPROCESS_COLLECTOR, _DriverObservedMultiCollector
from rl_observers.sources.observed import How
from rl_observers.sources.replay_buffers import (
    PREFETCHING,
    ObservedPrefetchingReplayBuffer,
    ObservedReplayBuffer,
    PrefetchingBufferObservers,
    ReplayBufferObservers,
    prefetching,
)
from rl_observers.sources.shared_buffers import SharedBufferObservers

__all__ = ["TABLE"]

_COLLECTORS = "torchrl.collectors"
_DISTRIBUTED = "torchrl.collectors.distributed"
_BUFFERS = "torchrl.data.replay_buffers"

# The methods whose hook-slot reads emit an in-process collector's events (see
# rl_observers.sources.collectors): a subclass replacing one would be mute.
_COLLECTION_LOOP = ("__iter__", "iterator", "rollout")
# A distributed collector's observed ``iterator`` wraps whatever ``iterator`` the class has,
# as long as iterating goes through it.
_DRIVER_LOOP = ("__iter__",)

_LOCAL_COLLECTOR = How(ObservedCollector, CollectorObservers, loop=_COLLECTION_LOOP)
_MULTIPROCESS = How(_DriverObservedMultiCollector, ObserverList, kind=MULTIPROCESS_COLLECTOR)
_DISTRIBUTED_COLLECTOR = How(ObservedDistributedCollector, DistributedCollectorObservers, loop=_DRIVER_LOOP)
_LOCAL_BUFFER = How(ObservedReplayBuffer, SharedBufferObservers, variant=prefetching)
_PREFETCHING_BUFFER = How(ObservedPrefetchingReplayBuffer, PrefetchingBufferObservers)
_ACTOR_BUFFER = How(ray._ActorObservedReplayBuffer, ReplayBufferObservers)
_ACTOR_TENSORDICT_BUFFER = How(ray._ActorObservedTensorDictReplayBuffer, ReplayBufferObservers)

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
        f"{_BUFFERS}.replay_buffers:ReplayBuffer": _LOCAL_BUFFER,
        f"{_BUFFERS}.replay_buffers:PrioritizedReplayBuffer": _LOCAL_BUFFER,
        f"{_BUFFERS}.replay_buffers:TensorDictReplayBuffer": _LOCAL_BUFFER,
        f"{_BUFFERS}.replay_buffers:TensorDictPrioritizedReplayBuffer": _LOCAL_BUFFER,
        f"{_BUFFERS}.replay_buffers:RemoteTensorDictReplayBuffer": _LOCAL_BUFFER,
        f"{_BUFFERS}.replay_buffers:ReplayBufferEnsemble": _LOCAL_BUFFER,
        f"{_BUFFERS}.her:HERReplayBuffer": _LOCAL_BUFFER,
        f"{_BUFFERS}.ray_buffer:RayReplayBuffer": How(
            ray._DriverObservedRayReplayBuffer, ObserverList, kind=ray.RAY_REPLAY_BUFFER
        ),
    },
    # A buffer built with prefetch=N (torchrl refuses to share one): sampling emits at hand-over.
    PREFETCHING: {
        f"{_BUFFERS}.replay_buffers:ReplayBuffer": _PREFETCHING_BUFFER,
        f"{_BUFFERS}.replay_buffers:PrioritizedReplayBuffer": _PREFETCHING_BUFFER,
        f"{_BUFFERS}.replay_buffers:TensorDictReplayBuffer": _PREFETCHING_BUFFER,
        f"{_BUFFERS}.replay_buffers:TensorDictPrioritizedReplayBuffer": _PREFETCHING_BUFFER,
        f"{_BUFFERS}.replay_buffers:RemoteTensorDictReplayBuffer": _PREFETCHING_BUFFER,
        f"{_BUFFERS}.replay_buffers:ReplayBufferEnsemble": _PREFETCHING_BUFFER,
        f"{_BUFFERS}.her:HERReplayBuffer": _PREFETCHING_BUFFER,
    },
    # Inside a RayReplayBuffer's actor: writes and samples seen through private lookups.
    ray.ACTOR: {
        f"{_BUFFERS}.replay_buffers:ReplayBuffer": _ACTOR_BUFFER,
        f"{_BUFFERS}.replay_buffers:PrioritizedReplayBuffer": _ACTOR_BUFFER,
        f"{_BUFFERS}.replay_buffers:TensorDictReplayBuffer": _ACTOR_TENSORDICT_BUFFER,
        f"{_BUFFERS}.replay_buffers:TensorDictPrioritizedReplayBuffer": _ACTOR_TENSORDICT_BUFFER,
        f"{_BUFFERS}.replay_buffers:RemoteTensorDictReplayBuffer": _ACTOR_TENSORDICT_BUFFER,
        f"{_BUFFERS}.replay_buffers:ReplayBufferEnsemble": _ACTOR_BUFFER,
        f"{_BUFFERS}.her:HERReplayBuffer": _ACTOR_TENSORDICT_BUFFER,
    },
    # The Ray-transport client an observed RayReplayBuffer hands out (the "distributed"
    # transport's client is never observed: that transport is refused at attach).
    ray.CLIENT: {
        f"{_BUFFERS}.ray_buffer:_RayReplayBufferClient": How(ray._ObservedRayReplayBufferClient, ObserverList),
    },
}
