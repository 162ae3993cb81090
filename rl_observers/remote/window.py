"""A window: what a copy of an observer sends to the owner, typed, from submit to the logger's thread.

Step **observer → channel → logger**, for copies running away from the
channel. A :class:`Window` is a :class:`~rl_observers.channel.payload.Payload`
that also says who sent it (observer, worker, process, copy and number),
the copy's cumulative counters and the observer's :class:`AggregateSpec`.
Two windows of one copy still on the way may merge (:meth:`Window.absorb`).

Examples:
    >>> from rl_observers.remote.window import Window
    >>> from rl_observers.stats import Count
    >>> first = Window("train/worker_0", {"dones": Count("dones", 2)}, observer="train", worker=0,
    ...                counters={"frames": 30}, copy="host/pid 7", seq=3)
    >>> first.absorb(Window("train/worker_0", {"dones": Count("dones", 1)}, observer="train", worker=0,
    ...                     counters={"frames": 50}, copy="host/pid 7", seq=5))
    >>> first.seq, first.windows, first.counters, first.metrics["dones"].n
    (5, 2, {'frames': 50}, 3.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from torchrl.record.loggers.monitoring import Every

from rl_observers.channel.payload import Payload, coalesce, payload_class

__all__ = ["AggregateSpec", "Window", "worker_key"]


@dataclass(slots=True, unsafe_hash=True)
class AggregateSpec:
    """What the owner needs to know to merge one observer's windows: its schedule, step, scope.

    Compared and hashed by value; a copy fills in ``workers`` and ``lockstep``.

    Args:
        schedule (Every, optional): when rows are due; ``None``: at every window.
        step_key (str, optional): the counter used as step.
        scope (str, optional): ``"aggregate"``, ``"per_worker"`` or ``"both"``.
        log_on_close (bool, optional): whether the last partial windows are logged.
        latest (tuple of str, optional): gauges that keep the newest value
            instead of adding up over workers.
        workers (int, optional): how many copies feed the aggregate (``0``: not known).
        lockstep (bool, optional): whether the copies cut their windows where
            the driver's rows fall (:mod:`~rl_observers.remote.lockstep`).
        timeout (float, optional): seconds a row waits for a silent worker.
    """

    schedule: Every | None = None
    step_key: str | None = None
    scope: str = "aggregate"
    log_on_close: bool = True
    latest: tuple[str, ...] = ()
    workers: int = 0
    lockstep: bool = False
    timeout: float = 10.0

    def __reduce__(self) -> tuple[Any, ...]:
        # a window carries its spec: the schedule as a plain tuple pickles in a third of Every's time
        schedule = self.schedule
        raw = None if schedule is None else (schedule.kind, schedule.interval, schedule.key)
        return _spec, (raw, *_SPEC_REST(self))


_SPEC_REST = attrgetter(*(f.name for f in fields(AggregateSpec)[1:]))


def _spec(raw: tuple[str, float, str | None] | None, *rest: Any) -> AggregateSpec:
    return AggregateSpec(None if raw is None else Every(*raw), *rest)


@payload_class
class Window(Payload):
    """One window of one copy of an observer (or the marker that ends an observer's aggregate).

    Args:
        namespace (str): where the copy's own rows would go (``<observer>/worker_<i>``).
        metrics (dict): gauges and partials, as a :class:`~rl_observers.channel.payload.Payload`'s.
        step (int, optional): unused by the owner (rows take their step from the counters).

    Keyword Args:
        observer (str): the observer's name: the aggregate the window merges into.
        worker (Any, optional): the worker it comes from (an index, or ``"main"``).
        process (str, optional): a token of the process it was sent from.
        counters (Mapping, optional): the copy's cumulative counters (``None``: a
            last window that only marks the end).
        base (Mapping, optional): what the copy's source had counted before the
            copy did: in ``counters``, but not progress of this run.
        spec (AggregateSpec, optional): how the owner merges the observer's windows.
        copy (str, optional): which copy sent it (set by the handle that numbers it).
        seq (int, optional): its number among its copy's windows (set by that handle).
        windows (int, optional): how many of its copy's windows it holds.
        last (bool, optional): the copy's last window.
        finish (bool, optional): the marker that ends an observer's aggregate.
        cut (int, optional): for a lockstep copy, the driver's counter where this window ends.
        due (bool, optional): whether the driver's row is due at ``cut``.
    """

    observer: str = ""
    worker: Any = None
    process: str | None = None
    counters: Mapping[str, float] | None = None
    base: Mapping[str, float] | None = None
    spec: AggregateSpec | None = None
    copy: str | None = None
    seq: int | None = None
    windows: int = 1
    last: bool = False
    finish: bool = False
    cut: int | None = None
    due: bool = False

    @property
    def counted_by_number(self) -> int:  # type: ignore[override]
        return self.windows if self.seq is not None else 0

    def absorb(self, newer: Payload) -> Exception | None:
        """Merges ``newer`` (received after this one) into it; returns a partial's merge error, if any.

        Partials merge exactly; the gauges, step, counters and number of the
        higher-numbered window win (without numbers, the later arrival), and
        ``windows`` counts every numbered window merged.
        """
        if newer.__class__ is not Window:  # not super(): the slotted dataclass is a new class
            return Payload.absorb(self, newer)
        if newer.seq is not None and self.seq is not None and newer.seq < self.seq:
            # passed on the way: its plain numbers are stale
            merged = dict(newer.metrics)
            error = coalesce(merged, self.metrics)
            self.metrics = merged
        else:
            error = coalesce(self.metrics, newer.metrics)
            self.step = newer.step
        if self.seq is None or newer.seq is None or newer.copy != self.copy:
            self._take_origin(newer)
            return error
        windows = self.windows + newer.windows
        if newer.seq >= self.seq:
            self._take_origin(newer)
        self.windows = windows
        return error

    def _take_origin(self, other: Window) -> None:
        for name in _ORIGIN:
            setattr(self, name, getattr(other, name))
        self.last = self.last or other.last
        self.finish = self.finish or other.finish

    def numbered(self, copy: str, seq: int) -> Window:
        """This window, numbered ``seq`` among the windows of ``copy`` (set once, by its handle)."""
        self.copy, self.seq = copy, seq
        return self


# what a window takes from the newer of two it merges (its number, counters, settings)
_ORIGIN = tuple(f.name for f in fields(Window)[3:] if f.name not in ("last", "finish"))


def worker_key(worker: Any) -> Any:
    """``worker`` as a key of a mapping: itself, or its ``repr`` when it cannot be hashed."""
    try:
        hash(worker)
    except TypeError:
        return repr(worker)
    return worker
