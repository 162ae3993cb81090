"""Observers for tests: they record what they see and can be pickled to workers.

Examples:
    >>> import torch
    >>> import rl_observers
    >>> from rl_observers.testing import EventRecorder
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(10))
    >>> recorder = EventRecorder()
    >>> _ = rb.add_observer(recorder)
    >>> _ = rb.extend(torch.arange(4))
    >>> _ = rb.sample(2)
    >>> recorder.events
    ['post_extend', 'post_sample']
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from rl_observers.signals import EVENT_PAYLOADS

__all__ = ["EventRecorder"]


def _size(value: Any) -> int | None:
    numel = getattr(value, "numel", None)
    if callable(numel):
        return int(numel())
    try:
        return len(value)
    except TypeError:
        return None


class EventRecorder:
    """Records every event it receives, in order, with the size of its payload; thread-safe, picklable.

    Keyword Args:
        keep_payloads (bool, optional): also keep the payloads. Defaults to
            ``False`` (batches are not kept alive).

    Attributes:
        events (list[str]): event names, in order.
        sizes (list[int | None]): ``numel()`` or ``len()`` of each first payload.
        payloads (list[tuple]): the payloads, when ``keep_payloads``.
        pid (int | None): the process of the last event.
    """

    def __init__(self, *, keep_payloads: bool = False) -> None:
        self.keep_payloads = keep_payloads
        self.events: list[str] = []
        self.sizes: list[int | None] = []
        self.payloads: list[tuple[Any, ...]] = []
        self.pid: int | None = None
        self._lock = threading.Lock()

    def _record(self, event: str, source: Any, *payload: Any) -> None:
        size = _size(payload[0]) if payload else None
        with self._lock:
            self.events.append(event)
            self.sizes.append(size)
            if self.keep_payloads:
                self.payloads.append(payload)
            self.pid = os.getpid()

    def count(self, event: str) -> int:
        """Returns how many ``event`` events were recorded."""
        return self.events.count(event)

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EventRecorder(events={len(self.events)})"


for _event in EVENT_PAYLOADS:  # on_<event>(source, *payload) records every event
    setattr(EventRecorder, f"on_{_event}", functools.partialmethod(EventRecorder._record, _event))
