"""How replay buffers emit events.

``add`` / ``extend`` emit after torchrl wrote, with the index it returned,
under the buffer's reentrant lock (an observer sees the buffer as the write
left it). ``post_sample`` carries the batch and the sampler's info, once per
batch ``sample()`` hands over (at hand-over with ``prefetch=N``). Observers
run eagerly, outside any ``torch.compile`` region. See :ref:`events`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
from torchrl.collectors import MultiCollector

from rl_observers.observer import ObserverList, refused_raise
from rl_observers.signals import REPLAY_BUFFER_EVENTS
from rl_observers.sources.observed import ObservedSource, observers_of, torchrl_class

__all__ = [
    "PREFETCHING",
    "ObservedPrefetchingReplayBuffer",
    "ObservedReplayBuffer",
    "PrefetchingBufferObservers",
    "ReplayBufferObservers",
    "emit_eagerly",
    "prefetching",
    "writes_held",
]

#: The context whose rows observe a buffer built with ``prefetch=N`` (see :func:`prefetching`).
PREFETCHING = "prefetching"


# torchrl's multiprocessing collectors set an empty buffer's storage up with a fake write and
# an empty(): not data, so no event (told by the calling frame's code, as hook reads are).
_SETUP = inspect.unwrap(getattr(MultiCollector, "_check_replay_buffer_init", None))
_SETUP_CODE: CodeType | None = getattr(_SETUP, "__code__", None)


def emit_eagerly(source: Any, event: str, *payload: Any) -> None:
    """Emits ``event`` from ``source`` (nothing once it has no observer list); under ``torch.compile`` the observers run eagerly."""
    if torch.compiler.is_dynamo_compiling():  # constant for dynamo, ``return False`` eagerly
        _emit_outside_graph(source, event, *payload)
        return
    observers = source.__dict__.get("_rl_observers")  # observers_of(source), inlined
    if observers is not None:
        observers.emit(event, *payload)


@torch.compiler.disable
def _emit_outside_graph(source: Any, event: str, *payload: Any) -> None:
    observers = observers_of(source)
    if observers is not None:
        observers.emit(event, *payload)


def _write_method(name: str, event: str) -> Callable[..., Any]:
    """torchrl's ``add`` / ``extend``, then ``event`` with the data and the index it returned.

    The hot path of every write, with its calls inlined (~0.5 us each).
    """

    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        cls = type(self)
        method = getattr(cls.__dict__.get("_rl_base", cls), name)
        if torch.compiler.is_dynamo_compiling():  # torchrl takes no lock when compiled either
            index = method(self, *args, **kwargs)
            data = args[0] if args else _data_argument(method, kwargs)
            _emit_outside_graph(self, event, data, index)
            return index
        with self._replay_lock:  # reentrant; see the module docstring
            index = method(self, *args, **kwargs)
            observers = self.__dict__.get("_rl_observers")
            if observers is not None and sys._getframe(1).f_code is not _SETUP_CODE:
                observers.emit(event, args[0] if args else _data_argument(method, kwargs), index)
        return index

    write.__name__ = name
    write.__qualname__ = f"ObservedReplayBuffer.{name}"
    return write


def writes_held(source: Any) -> Any:
    """The reentrant lock each observed write holds from torchrl's count to its event, or a no-op context."""
    lock = getattr(source, "__dict__", {}).get("_replay_lock")  # no __getattr__ forwarding
    return contextlib.nullcontext() if lock is None else lock


def _data_argument(method: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """The data of a write passed by keyword (``extend(tensordicts=td)``): torchrl's first argument."""
    params = list(inspect.signature(method).parameters)  # (self, data, ...)
    return kwargs.get(params[1]) if len(params) > 1 else None


#: Where the copies of a shared buffer's observers run (for ``on_error="raise"``'s refusal).
SHARED_COPIES_RUN = "in the workers of the collectors writing into it"


class ReplayBufferObservers(ObserverList):
    """The observers of one in-process replay buffer; one shared with workers (``shared=True``) refuses ``on_error="raise"``."""

    def __init__(
        self,
        source: Any,
        emits: tuple[str, ...] = REPLAY_BUFFER_EVENTS,
        target_name: str = "replay buffer",
    ) -> None:
        super().__init__(source, emits, target_name)

    def add(self, observer: Any, on_error: str | None = None) -> Any:
        entry = super().add(observer, on_error)
        if entry.on_error == "raise" and self.source.__dict__.get("shared"):
            super().remove(observer)
            raise ValueError(refused_raise(observer, "shared replay buffer", SHARED_COPIES_RUN))
        return entry


class ObservedReplayBuffer(ObservedSource):
    """Mixin of observed replay buffers; torchrl's class is found per call (a bound call may run after the buffer became plain)."""

    add = _write_method("add", "post_add")
    extend = _write_method("extend", "post_extend")

    def _sample(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        cls = type(self)  # torchrl_class and emit_eagerly inlined, as in _write_method
        result = cls.__dict__.get("_rl_base", cls)._sample(self, *args, **kwargs)
        if torch.compiler.is_dynamo_compiling():
            _emit_outside_graph(self, "post_sample", result[0], result[1])
        else:
            observers = self.__dict__.get("_rl_observers")
            if observers is not None:
                observers.emit("post_sample", result[0], result[1])
        return result

    def empty(self, *args: Any, **kwargs: Any) -> None:
        with self._replay_lock:  # as a write: no other thread's write lands before the event
            torchrl_class(type(self)).empty(self, *args, **kwargs)
            if sys._getframe(1).f_code is not _SETUP_CODE:
                emit_eagerly(self, "empty")


def prefetching(source: Any) -> str | None:
    """:data:`PREFETCHING` for a buffer built with ``prefetch=N``, else ``None``: the in-process rows' :attr:`~rl_observers.sources.observed.How.variant`."""
    return PREFETCHING if source.__dict__.get("_prefetch") else None


class PrefetchingBufferObservers(ReplayBufferObservers):
    """The observers of a replay buffer that prefetches: ``post_sample`` at hand-over.

    :meth:`hand_over` runs torchrl's ``sample()`` and emits for the batch it
    returned (the queue's head, peeked before torchrl pops it, or the batch
    made at once in this thread, noted by :meth:`made`). Batches the queue
    drops leave nothing behind.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Held from a sample()'s peek at the queue to the end of its event: observed
        # sample() calls take turns, so observers never run in two threads at once.
        self._handing = threading.RLock()
        self._handing_thread: int | None = None  # the thread in sample(), under _handing
        self._made: tuple[Any, Any] | None = None  # the batch sample() made at once

    def made(self, result: tuple[Any, Any]) -> None:
        """Notes a batch ``_sample`` made, if ``sample()`` made it at once in this thread."""
        if threading.get_ident() == self._handing_thread:
            self._made = result

    def hand_over(self, sample: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Runs torchrl's ``sample`` and emits ``post_sample`` for the batch it handed over."""
        source = self.source
        with self._handing:
            queue = source.__dict__.get("_prefetch_queue")
            head = queue[0] if queue else None
            outer, self._made = self._handing_thread, None
            self._handing_thread = threading.get_ident()
            try:
                out = sample(source, *args, **kwargs)
                result = self._made if head is None else head.result()
            finally:  # an observer that samples from its event nests here
                self._handing_thread, self._made = outer, None
            if result is not None:
                self.emit("post_sample", result[0], result[1])
        return out


class ObservedPrefetchingReplayBuffer(ObservedReplayBuffer):
    """Mixin of observed replay buffers that prefetch: sampling emits at hand-over; the rest is :class:`ObservedReplayBuffer`'s."""

    def _sample(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        cls = type(self)
        result = cls.__dict__.get("_rl_base", cls)._sample(self, *args, **kwargs)
        observers = self.__dict__.get("_rl_observers")
        if observers is not None:
            observers.made(result)
        return result

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        cls = type(self)
        sample = cls.__dict__.get("_rl_base", cls).sample
        observers = self.__dict__.get("_rl_observers")
        if observers is None:  # the last observer left while this call was bound
            return sample(self, *args, **kwargs)
        if torch.compiler.is_dynamo_compiling():
            return _hand_over_outside_graph(observers, sample, args, kwargs)
        return observers.hand_over(sample, args, kwargs)


_hand_over_outside_graph = torch.compiler.disable(PrefetchingBufferObservers.hand_over)
