"""How collectors emit events.

torchrl's collectors read their ``pre_collect_hook`` / ``post_collect_hook``
properties at every rollout. An observed collector answers *those* reads
(told apart by the calling frame's code object, learnt once per class)
with dispatchers that call the user's hook, then the observers; every
other read gets what was set. So a slot round-trips, and the slot,
``enable_profile`` and observers never evict one another.
"""

from __future__ import annotations

import functools
import sys
import weakref
from types import CodeType, FunctionType
from typing import Any

from rl_observers.observer import ObserverList
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources.observed import ObservedSource, observers_of, torchrl_class

__all__ = ["WORKER_DELIVERIES", "CollectorObservers", "ObservedCollector", "WorkerDeliveries"]

_HOOKS = ("pre_collect_hook", "post_collect_hook")
# The code objects of torchrl's functions that read a hook slot to call it, and the classes
# they were learnt from.
_READERS: frozenset[CodeType] = frozenset()
_LEARNT: set[type] = set()


def _codes(code: CodeType) -> list[CodeType]:
    """``code`` and the code objects nested in it (closures, comprehensions)."""
    found = [code]
    for const in code.co_consts:
        if isinstance(const, CodeType):
            found.extend(_codes(const))
    return found


def _learn_readers(cls: type) -> None:
    """Adds the functions of ``cls``'s hierarchy that read a hook property to the known readers."""
    global _READERS
    if cls in _LEARNT:
        return
    readers = set(_READERS)
    for klass in cls.__mro__:
        if klass in _LEARNT or not klass.__module__.startswith("torchrl."):
            continue
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            while value is not None and not isinstance(value, property):  # the wrapped ones too
                if isinstance(value, FunctionType):
                    readers.update(c for c in _codes(value.__code__) if any(h in c.co_names for h in _HOOKS))
                value = getattr(value, "__wrapped__", None)
    _LEARNT.update(cls.__mro__)
    _READERS = frozenset(readers)


class CollectorObservers(ObserverList):
    """The observers of one in-process collector, and the hook dispatchers it calls.

    In a worker, a rollout reaches ``post_collect`` once torchrl delivers it
    (:class:`WorkerDeliveries`); dropped rollouts' frames count apart in
    :attr:`frames_discarded` (:ref:`what-is-counted`).
    """

    def __init__(
        self, source: Any, emits: tuple[str, ...] = COLLECTOR_EVENTS, target_name: str = "collector"
    ) -> None:
        super().__init__(source, emits, target_name)
        _learn_readers(torchrl_class(type(source)))
        #: Frames of rollouts torchrl finished but never delivered (dropped, or collected again).
        self.frames_discarded = 0
        mode = WORKER_DELIVERIES.watch(self, source)
        #: Whether a rollout is delivered after ``post_collect`` (see :class:`WorkerDeliveries`).
        self.defers_delivery = mode is not None
        self._handed_on_at_collect = mode == WorkerDeliveries.RETURNED
        self._undelivered: Any = None  # collected last, until torchrl delivers or drops it
        self._handed_on = False  # handed on, but delivered only when the worker is asked again
        self._next_started = False  # delivering as torchrl starts the next rollout

    def pre_collect_hook(self) -> None:
        user_hook = self.source._pre_collect_hook
        if user_hook is not None:
            user_hook()
        if self._undelivered is not None:
            if self._handed_on:  # asked for another rollout: the driver took this one
                self._next_started = True
                try:
                    self.delivered()
                finally:
                    self._next_started = False
            else:
                self.drop_undelivered()
        self.emit("pre_collect")

    def contribute_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        if self._next_started and "batches" in stats:
            stats["batches"] -= 1  # torchrl counts the one it started, observers the one delivered
        return super().contribute_stats(stats)

    def post_collect_hook(self, batch: Any) -> None:
        user_hook = self.source._post_collect_hook
        if user_hook is not None:
            user_hook(batch)
        if self.defers_delivery:
            self._undelivered = batch  # until the worker hands it on (handed_on())
            self._handed_on = self._handed_on_at_collect
            return
        self.emit("post_collect", batch)

    def handed_on(self, *, taken: bool) -> None:
        """The worker hands on the rollout it collected last.

        ``taken``: the hand-over is the delivery; otherwise it is delivered when
        the worker is asked for its next, and dropped if it shuts down first.
        """
        if taken:
            self.delivered()
        elif self._undelivered is not None:
            self._handed_on = True

    def delivered(self) -> None:
        """The rollout collected last is delivered now."""
        batch, self._undelivered, self._handed_on = self._undelivered, None, False
        if batch is not None:
            self.emit("post_collect", batch)

    def drop_undelivered(self) -> None:
        """The rollout collected last was never delivered (torchrl dropped it): counted apart."""
        batch, self._undelivered, self._handed_on = self._undelivered, None, False
        if batch is not None:
            self.frames_discarded += batch.numel()

    def shutdown(self) -> None:
        self.drop_undelivered()
        super().shutdown()


class WorkerDeliveries:
    """Where a multiprocessing worker hands its rollout on, in this process.

    By a write into the shared replay buffer (the loop's device-normalizing
    function is wrapped), a put on the queue to the driver (``queue_out.put``
    is wrapped; ``queue.Full`` means not handed on), or a return from an
    asynchronous ``RayCollector``'s actor. A ``MultiSyncCollector``'s put is
    the delivery; other rollouts are delivered when the driver asks for the
    next (:attr:`taken_when_asked_again`). Elsewhere: at ``post_collect``.
    """

    def __init__(self) -> None:
        self._watched: weakref.WeakSet[CollectorObservers] = weakref.WeakSet()
        self._wrapped: set[str] = set()
        #: Set in the worker by its driver (a ``MultiAsyncCollector``, an asynchronous ``RayCollector``).
        self.taken_when_asked_again = False

    #: A rollout handed on at a write or a put (wrapped here).
    HANDED_OVER = "handed over"
    #: A rollout handed on as it is collected (returned by a Ray actor's call).
    RETURNED = "returned"

    def watch(self, observers: CollectorObservers, source: Any) -> str | None:
        """Watches ``observers`` of a worker's collector that delivers later; returns how, or ``None``."""
        buffer = getattr(source, "replay_buffer", None)
        if buffer is not None and getattr(source, "_ignore_rb", False):  # it writes rollouts
            self._wrap_write()
        elif (queue := self._runner_queue()) is not None:
            self._wrap_put(queue)
        elif self.taken_when_asked_again and buffer is None:
            return self.RETURNED
        else:
            return None
        self._watched.add(observers)
        return self.HANDED_OVER

    @staticmethod
    def _runner_queue() -> Any:
        """The queue to the driver of the worker loop running this call (``None`` outside one, or with a replay buffer)."""
        from torchrl.collectors import _runner

        loop = _runner._main_async_collector_impl.__code__
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not loop:
            frame = frame.f_back
        if frame is None or frame.f_locals.get("replay_buffer") is not None:
            return None
        return frame.f_locals.get("queue_out")

    def _hand_on(self, *, taken: bool) -> None:
        for watched in list(self._watched):
            watched.handed_on(taken=taken)

    def _wrap_write(self) -> None:
        if "write" in self._wrapped:
            return
        self._wrapped.add("write")
        from torchrl.collectors import _runner

        normalize = _runner._maybe_normalize_replay_buffer_tensordict_device

        @functools.wraps(normalize)
        def normalize_then_deliver(data: Any, replay_buffer: Any) -> Any:
            self._hand_on(taken=True)
            return normalize(data, replay_buffer)

        _runner._maybe_normalize_replay_buffer_tensordict_device = normalize_then_deliver

    def _wrap_put(self, queue: Any) -> None:
        if "put" in self._wrapped:
            return
        self._wrapped.add("put")
        put = queue.put

        @functools.wraps(put)
        def put_then_deliver(item: Any, *args: Any, **kwargs: Any) -> None:
            # a rollout, not "paused"
            rollout = isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], int)
            if rollout and not self.taken_when_asked_again:
                # the driver takes every worker's rollout of a round: the queue has room for each
                self._hand_on(taken=True)
            put(item, *args, **kwargs)  # raises queue.Full: not handed on, the loop rolls out again
            if rollout and self.taken_when_asked_again:
                self._hand_on(taken=False)

        queue.put = put_then_deliver


#: The hand-over points of this process (see :class:`WorkerDeliveries`).
WORKER_DELIVERIES = WorkerDeliveries()


def _hook_slot(name: str) -> property:
    """The ``name`` slot: the observers' dispatcher for torchrl's readers, else what was set."""

    def get(self: Any) -> Any:
        observers = observers_of(self)
        if observers is not None and sys._getframe(1).f_code in _READERS:
            return getattr(observers, name)
        return getattr(torchrl_class(type(self)), name).fget(self)

    def set(self: Any, hook: Any) -> None:
        getattr(torchrl_class(type(self)), name).fset(self, hook)

    return property(get, set)


class ObservedCollector(ObservedSource):
    """Mixin of observed collectors (see :mod:`rl_observers.sources.observed`)."""

    pre_collect_hook = _hook_slot("pre_collect_hook")
    post_collect_hook = _hook_slot("post_collect_hook")
