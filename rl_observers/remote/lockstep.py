"""Rows of lockstep sources: the copies cut their windows where the driver's rows fall.

Step of the flow: **observer → channel**, for copies of an observer whose
source collects in lockstep (source → observer → channel → logger). Each
batch a ``MultiSyncCollector`` or a ``RayCollector(sync=True)`` yields joins
rollout ``k`` of every worker. One observer on the driver with
``Every.counter("frames", N)`` would log a row at the first batch whose
cumulative frames reach each multiple of ``N``, holding every worker's data
of the batches since its previous row.

The copies reproduce those rows without a host copy per batch. Each copy
knows, from the driver, how many frames each worker collects per rollout, so
after its rollout ``k`` it knows the driver's cumulative frames at batch
``k``: :meth:`Lockstep.driver_value`. It runs the observer's schedule on that
value and sends a window only where a row is due, marked with that value
(``Window.cut``, ``Window.due``). The owner's aggregate
(:mod:`~rl_observers.remote.aggregate`) waits until every worker's window of a
cut is in, merges them and logs the row at the cut: the same steps and the
same data as the driver's observer, whatever the timing. A worker silent for
``worker_timeout`` seconds does not hold rows back longer: the row is logged
with what arrived, its ``workers_reporting`` says how many workers it holds,
one warning names the missing ones, and their late windows go into the next
row.

Which counters can be cut this way: ``frames`` (the driver's frames are the
sum over workers of their fixed frames per rollout) and ``batches`` (the
driver's batch ``k`` is every worker's rollout ``k``); any counter when one
copy feeds the aggregate (a ``RayReplayBuffer``'s actor, a single remote
collector), whose rows are then exactly those of an in-process observer of
the same object. Other counters (``episodes``) and ``Every.seconds`` are
observed at the owner (:mod:`~rl_observers.remote.aggregate`).

Examples:
    >>> from rl_observers.remote.lockstep import Lockstep
    >>> plan = Lockstep(workers=2, key="frames", per_rollout=(250, 250))
    >>> plan.driver_value(1, {"frames": 750})  # worker 1 after its third rollout
    1500
    >>> Lockstep(workers=1, key="sample_calls").driver_value(0, {"sample_calls": 30})
    30
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrl.record.loggers.monitoring import Every

from rl_observers.sources.observed import torchrl_class

__all__ = ["Lockstep", "plan_for"]


@dataclass(slots=True)
class Lockstep:
    """How a copy of a lockstep source turns its own counter into the driver's.

    Args:
        workers (int): how many copies feed the aggregate.
        key (str): the schedule's counter.
        per_rollout (tuple of int, optional): each worker's frames per rollout
            (``key == "frames"`` with several workers); ``None``: the copy's
            own counter is the driver's (one copy, or ``batches``).
    """

    workers: int
    key: str
    per_rollout: tuple[int, ...] | None = None
    total: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.total = None if self.per_rollout is None else sum(self.per_rollout)

    def driver_value(self, worker: Any, counters: Mapping[str, float]) -> int | None:
        """The driver's counter once this worker's counters are ``counters``; ``None`` if unknown."""
        value = counters.get(self.key)
        if value is None:
            return None
        per_rollout = self.per_rollout
        if per_rollout is None:
            return int(value)
        if worker.__class__ is not int or not 0 <= worker < len(per_rollout):
            return None  # not one of the source's workers (the driver's original)
        return int(value // per_rollout[worker]) * self.total  # type: ignore[operator]


def _rollout_frames(target: Any) -> tuple[int, ...] | None:
    """Each worker's frames per rollout of a collector whose batches join its workers in lockstep."""
    name = torchrl_class(type(target)).__name__
    if name == "MultiSyncCollector":
        return tuple(int(target.frames_per_batch_worker(worker_idx=i)) for i in range(target.num_workers))
    if name == "RayCollector" and getattr(target, "_sync", False):
        return (int(target._frames_per_batch_corrected),) * int(target.num_collectors)
    return None


def plan_for(target: Any, schedule: Every | None) -> Lockstep | None:
    """The :class:`Lockstep` of an observer's copies on ``target``, or ``None`` (rows observed).

    A counter schedule on a ``MultiSyncCollector`` or a ``RayCollector(sync=True)``
    (``frames`` or ``batches``; any counter with a single worker), or on a
    ``RayReplayBuffer`` (its one actor).
    """
    if schedule is None or schedule.kind != "counter":
        return None
    key = schedule.key
    if torchrl_class(type(target)).__name__ == "RayReplayBuffer":
        return Lockstep(1, key)
    frames = _rollout_frames(target)
    if frames is None:
        return None
    if len(frames) == 1:
        return Lockstep(1, key)
    if key == "frames":
        return Lockstep(len(frames), key, frames)
    if key == "batches":
        return Lockstep(len(frames), key)
    return None
