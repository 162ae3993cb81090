"""Rows of lockstep sources: the copies cut their windows where the driver's rows fall.

For copies on a ``MultiSyncCollector``, a ``RayCollector(sync=True)`` or a
``RayReplayBuffer``: each copy knows every worker's frames per rollout, hence
the driver's counter (:meth:`Lockstep.driver_value`), and sends a window only
where a row is due (``Window.cut``); the owner logs the row once every
worker's window of the cut is in. See ``docs/distributed.rst``.

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


def plan_for(target: Any, schedule: Every | None) -> Lockstep | None:
    """The :class:`Lockstep` of an observer's copies on ``target``, or ``None`` (rows observed)."""
    if schedule is None or schedule.kind != "counter":
        return None
    key, name = schedule.key, torchrl_class(type(target)).__name__
    if name == "RayReplayBuffer":
        return Lockstep(1, key)
    # each worker's frames per rollout, where the batches join the workers in lockstep
    if name == "MultiSyncCollector":
        frames = tuple(int(target.frames_per_batch_worker(worker_idx=i)) for i in range(target.num_workers))
    elif name == "RayCollector" and getattr(target, "_sync", False):
        frames = (int(target._frames_per_batch_corrected),) * int(target.num_collectors)
    else:
        return None
    if len(frames) == 1:
        return Lockstep(1, key)
    if key == "frames":
        return Lockstep(len(frames), key, frames)
    if key == "batches":
        return Lockstep(len(frames), key)
    return None
