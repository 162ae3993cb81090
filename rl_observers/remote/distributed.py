"""torch.distributed and RPC collectors, observed on the driver.

``DistributedCollector`` (sync and async), ``DistributedSyncCollector`` and
``RPCCollector`` (sync and async), whatever their launcher (``"mp"``,
``"submitit"``, ...), and ``Collector(backend="distributed" | "submitit" |
"rpc")``, which builds them, run their collectors in processes started by
torchrl (on other machines with submitit), and in torchrl 0.14.1 none of
them takes a replay buffer: every batch crosses to the driver through
``torch.distributed`` (``isend`` / ``irecv``) or RPC, and the driver's
iterator yields it. Their workers are torchrl's own collection loops
(``_run_collector``, ``_distributed_init_collection_node``,
``_rpc_init_collection_node``), which no hook slot of the driver reaches.

So their observers run **on the driver**, in the process that iterates:
an observed distributed collector's ``iterator`` wraps torchrl's and emits

* ``pre_collect`` before it asks torchrl for each batch, while the frames
  the driver received are below ``total_frames`` (torchrl's own loop
  condition; with ``split_trajs=True`` the frames of a batch are its
  ``("collector", "mask")`` count, else its ``numel()``; a ``postproc`` that
  changes the number of frames can make the last ``pre_collect`` go
  unanswered by a batch);
* ``post_collect`` with each batch the driver yields, after torchrl's
  ``split_trajs`` / ``postproc``, just before the caller gets it: metrics
  are exactly those of the batches the driver received;
* ``shutdown`` when ``shutdown()`` is called, before torchrl's.

The wrapping happens when iteration starts (``for batch in collector``,
``collector.next()``'s first call): observers attached while the driver is
already iterating are heard from the next iteration on; removing an
observer takes effect at the next batch.

Batches are not split per worker: a sync batch stacks (``DistributedCollector``,
``DistributedSyncCollector``) or concatenates in arrival order
(``RPCCollector``) the workers' batches, an async one is one worker's, and
torchrl does not say which. Metrics are therefore aggregate only: a
``LoggerObserver`` with ``scope="per_worker"`` sees one source, the driver's
collector (``source_info(source).worker`` is ``None``).

Examples:
    >>> from rl_observers.remote.distributed import ObservedDistributedCollector
    >>> sorted(name for name in vars(ObservedDistributedCollector) if not name.startswith("__"))
    ['iterator', 'shutdown', 'stats']
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rl_observers.observer import ObserverList
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources.collectors import ObservedCollector
from rl_observers.sources.observed import observers_of, torchrl_class

__all__ = ["DistributedCollectorObservers", "ObservedDistributedCollector"]

_MASK = ("collector", "mask")


class DistributedCollectorObservers(ObserverList):
    """The observers of one torch.distributed / RPC collector, run on the driver."""

    def __init__(self, source: Any, emits: tuple[str, ...] = COLLECTOR_EVENTS, target_name: str = "collector") -> None:
        super().__init__(source, emits, target_name)


def _frames(collector: Any, batch: Any) -> int:
    """The frames torchrl counts for ``batch`` (before ``split_trajs`` padded it)."""
    if getattr(collector, "split_trajs", False):
        mask = batch.get(_MASK, None)
        if mask is not None:
            return int(mask.sum())
    return batch.numel()


class ObservedDistributedCollector:
    """Mixin of observed torch.distributed / RPC collectors (see the module docstring)."""

    def iterator(self) -> Iterator[Any]:
        batches = torchrl_class(type(self)).iterator(self)  # type: ignore[attr-defined]
        total = getattr(self, "total_frames", float("inf"))
        received = 0
        try:
            while True:
                observers = observers_of(self)
                if observers is not None and received < total:  # torchrl's own loop condition
                    observers.emit("pre_collect")
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if batch is not None:
                    received += _frames(self, batch)
                    observers = observers_of(self)
                    if observers is not None:
                        observers.emit("post_collect", batch)
                yield batch
        finally:
            batches.close()

    # The collector shuts down even if an observer raises (on_error="raise"); stats() gets
    # the observers' entries: both as for an in-process collector.
    shutdown = ObservedCollector.shutdown
    stats = ObservedCollector.stats
