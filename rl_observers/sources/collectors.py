"""How collectors emit events.

torchrl's collectors call their ``pre_collect_hook`` / ``post_collect_hook``
slots at every rollout, reading the properties of the same names (in
``Collector.rollout`` and ``Collector.iterator``; in a multiprocessing worker
the inner collector does the same). An observed collector answers *those*
reads with its observer list's dispatchers, which call the user's hook
first and then the observers; every other read of the slot (the user's
code, torchrl's tests, a save-and-restore) gets exactly what was set, or
``None``. So a slot round-trips (``saved = c.post_collect_hook; ...;
c.post_collect_hook = saved``), and the slot, ``enable_profile`` and
observers never evict one another. The readers are told apart by the code
object of the calling frame, learnt once per torchrl class from the
functions of its class hierarchy that read a hook property.
"""

from __future__ import annotations

import functools
import sys
import weakref
from types import CodeType, FunctionType
from typing import Any

from rl_observers.observer import ObserverList
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources.observed import observers_of, torchrl_class

__all__ = ["RUNNER_WRITES", "CollectorObservers", "ObservedCollector", "RunnerWrites"]

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


def _functions(value: Any) -> list[FunctionType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    found = []
    while value is not None and not isinstance(value, property):
        if isinstance(value, FunctionType):
            found.append(value)
        value = getattr(value, "__wrapped__", None)
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
            for fn in _functions(value):
                readers.update(c for c in _codes(fn.__code__) if any(h in c.co_names for h in _HOOKS))
    _LEARNT.update(cls.__mro__)
    _READERS = frozenset(readers)


class CollectorObservers(ObserverList):
    """The observers of one in-process collector, and the hook dispatchers it calls.

    A multiprocessing worker's collector whose rollouts the worker writes into
    a shared replay buffer (``replay_buffer=`` without ``trajs_per_batch``)
    delivers a rollout only when the worker writes it: torchrl's worker drops
    a rollout finished while a control message arrived (shutdown, pause, an
    attribute set, an observer attached). Its observers get ``post_collect``
    at that write (:class:`RunnerWrites`), never for a dropped rollout, whose
    frames are counted apart in :attr:`frames_discarded`. Between the end of a
    rollout and its write nothing else runs in the worker: the held batch is
    read before torchrl's next rollout reuses it, and nothing is copied.
    """

    def __init__(self, source: Any, emits: tuple[str, ...] = COLLECTOR_EVENTS, target_name: str = "collector") -> None:
        super().__init__(source, emits, target_name)
        _learn_readers(torchrl_class(type(source)))
        #: Frames of rollouts torchrl finished but never delivered (dropped before their write).
        self.frames_discarded = 0
        self.delivered_at_write = RunnerWrites.writes_for(source)
        self._unwritten: Any = None  # the rollout awaiting the worker's write
        if self.delivered_at_write:
            RUNNER_WRITES.watch(self)

    def pre_collect_hook(self) -> None:
        user_hook = self.source._pre_collect_hook
        if user_hook is not None:
            user_hook()
        if self._unwritten is not None:
            self.drop_unwritten()
        self.emit("pre_collect")

    def post_collect_hook(self, batch: Any) -> None:
        user_hook = self.source._post_collect_hook
        if user_hook is not None:
            user_hook(batch)
        if self.delivered_at_write:
            self._unwritten = batch  # delivered when the worker writes it (written())
            return
        self.emit("post_collect", batch)

    def written(self) -> None:
        """The worker writes the rollout it collected last: it is delivered now."""
        batch, self._unwritten = self._unwritten, None
        if batch is not None:
            self.emit("post_collect", batch)

    def drop_unwritten(self) -> None:
        """The rollout collected last was never written (torchrl dropped it): counted apart."""
        batch, self._unwritten = self._unwritten, None
        if batch is not None:
            self.frames_discarded += batch.numel()

    def shutdown(self) -> None:
        self.drop_unwritten()
        super().shutdown()


class RunnerWrites:
    """Where a multiprocessing worker writes its rollout into the shared replay buffer.

    torchrl's worker loop (``torchrl/collectors/_runner.py``) normalizes a
    rollout's device with ``_maybe_normalize_replay_buffer_tensordict_device``
    just before ``replay_buffer.extend``, and only for a rollout it writes.
    That call, looked up in the loop's module at every write, is wrapped once
    per process when the first collector there is watched; the wrapper tells
    the watched collectors' observer lists (one per worker process) that their
    last rollout is written.
    """

    def __init__(self) -> None:
        self._watched: weakref.WeakSet[CollectorObservers] = weakref.WeakSet()
        self._installed = False

    @staticmethod
    def writes_for(source: Any) -> bool:
        """Whether ``source`` is a worker's collector whose rollouts the worker writes into a buffer."""
        return getattr(source, "replay_buffer", None) is not None and bool(getattr(source, "_ignore_rb", False))

    def watch(self, observers: CollectorObservers) -> None:
        self._watched.add(observers)
        if not self._installed:
            self._installed = True
            from torchrl.collectors import _runner

            normalize = _runner._maybe_normalize_replay_buffer_tensordict_device

            @functools.wraps(normalize)
            def normalize_then_deliver(data: Any, replay_buffer: Any) -> Any:
                for watched in list(self._watched):
                    watched.written()
                return normalize(data, replay_buffer)

            _runner._maybe_normalize_replay_buffer_tensordict_device = normalize_then_deliver


#: The one write point of this process (see :class:`RunnerWrites`).
RUNNER_WRITES = RunnerWrites()


class ObservedCollector:
    """Mixin of observed collectors (see :mod:`rl_observers.sources.observed`)."""

    @property
    def pre_collect_hook(self) -> Any:
        observers = observers_of(self)
        if observers is not None and sys._getframe(1).f_code in _READERS:
            return observers.pre_collect_hook
        return torchrl_class(type(self)).pre_collect_hook.fget(self)  # type: ignore[attr-defined]

    @pre_collect_hook.setter
    def pre_collect_hook(self, hook: Any) -> None:
        torchrl_class(type(self)).pre_collect_hook.fset(self, hook)  # type: ignore[attr-defined]

    @property
    def post_collect_hook(self) -> Any:
        observers = observers_of(self)
        if observers is not None and sys._getframe(1).f_code in _READERS:
            return observers.post_collect_hook
        return torchrl_class(type(self)).post_collect_hook.fget(self)  # type: ignore[attr-defined]

    @post_collect_hook.setter
    def post_collect_hook(self, hook: Any) -> None:
        torchrl_class(type(self)).post_collect_hook.fset(self, hook)  # type: ignore[attr-defined]

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        # The collector shuts down even if an observer raises (on_error="raise"): the
        # error is raised once torchrl's shutdown has run.
        observers = observers_of(self)
        try:
            if observers is not None:
                observers.shutdown()
        finally:
            result = torchrl_class(type(self)).shutdown(self, *args, **kwargs)
        return result

    def stats(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        stats = torchrl_class(type(self)).stats(self, *args, **kwargs)
        observers = observers_of(self)
        return stats if observers is None else observers.contribute_stats(stats)
