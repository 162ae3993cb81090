"""How replay buffers emit events.

An observed buffer's ``add`` / ``extend`` emit after torchrl wrote the data,
with the index torchrl returned; ``_sample`` emits with the batch and the
sampler's info dict (whether or not the caller asked for it), so sampling is
observed where the batch is made: in the calling thread, or in the prefetch
thread when the buffer prefetches.

Observers always run eagerly, outside any ``torch.compile``d region: a
compiled function that writes to or samples from an observed buffer gets
the graphs (and graph breaks) it gets without observers, and observer code
is never traced, specialised or recompiled. The cost is one
``torch.compiler.disable`` boundary per event (a fraction of a microsecond).
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data import ReplayBuffer

from rl_observers.observer import ObserverList
from rl_observers.signals import REPLAY_BUFFER_EVENTS
from rl_observers.sources.observed import base_class, register_mixin

__all__ = ["ObservedReplayBuffer", "ReplayBufferObservers"]


def _emit_eagerly(source: Any, event: str, *payload: Any) -> None:
    """Emits ``event`` from ``source``; under ``torch.compile`` the observers run eagerly, never traced.

    The observer list is read from the instance's ``__dict__``: a call bound while the
    buffer was observed can run after its last observer was removed (a prefetched
    ``_sample`` queued in the executor, a write from a collector thread), and then
    emits nothing instead of raising ``AttributeError`` (which is also why the mixin's
    methods find torchrl's class with :func:`base_class` rather than ``self._rl_base``).
    """
    if torch.compiler.is_compiling():  # constant for dynamo: the eager path costs ~60 ns, not a wrapper
        _emit_outside_graph(source, event, *payload)
        return
    observers = source.__dict__.get("_rl_observers")
    if observers is not None:
        observers.emit(event, *payload)


@torch.compiler.disable
def _emit_outside_graph(source: Any, event: str, *payload: Any) -> None:
    observers = source.__dict__.get("_rl_observers")
    if observers is not None:
        observers.emit(event, *payload)


class ReplayBufferObservers(ObserverList):
    """The observers of one in-process replay buffer."""

    def __init__(
        self,
        source: Any,
        events: tuple[str, ...] = REPLAY_BUFFER_EVENTS,
        target_name: str = "replay buffer",
    ) -> None:
        super().__init__(source, events, target_name)

    # A shared buffer may have copies in the workers of running multiprocessing collectors:
    # changes are mirrored there (rl_observers.sources.multiprocess).

    def add(self, observer: Any, on_error: str | None = None) -> Any:
        entry = super().add(observer, on_error)
        if self.source.__dict__.get("shared"):
            from rl_observers.sources.multiprocess import propagate_to_shared_copies

            try:
                propagate_to_shared_copies(
                    self.source, "add", observer, entry.on_error, len(self.entries) - 1
                )
            except BaseException:
                super().remove(observer)
                raise
        return entry

    def remove(self, observer: Any) -> Any:
        if self.source.__dict__.get("shared"):
            position = next((i for i, e in enumerate(self.entries) if e.observer is observer), None)
            if position is not None:
                from rl_observers.sources.multiprocess import propagate_to_shared_copies

                propagate_to_shared_copies(self.source, "remove", observer, "", position)
        return super().remove(observer)


class ObservedReplayBuffer:
    """Mixin of observed replay buffers (see :mod:`rl_observers.sources.observed`)."""

    _rl_base: type

    _rl_observers: ReplayBufferObservers

    def add(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        index = base_class(type(self)).add(self, data, *args, **kwargs)
        _emit_eagerly(self, "post_add", data, index)
        return index

    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        index = base_class(type(self)).extend(self, data, *args, **kwargs)
        _emit_eagerly(self, "post_extend", data, index)
        return index

    def _sample(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        result = base_class(type(self))._sample(self, *args, **kwargs)
        _emit_eagerly(self, "post_sample", result[0], result[1])
        return result

    def empty(self, *args: Any, **kwargs: Any) -> None:
        base_class(type(self)).empty(self, *args, **kwargs)
        _emit_eagerly(self, "empty")

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        # The buffer shuts down even if an observer raises (on_error="raise").
        try:
            self._rl_observers.shutdown()
        finally:
            self._rl_base.shutdown(self, *args, **kwargs)  # type: ignore[misc]

    def stats(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        stats = self._rl_base.stats(self, *args, **kwargs)  # type: ignore[misc]
        return self._rl_observers.contribute_stats(stats)


def _is_local_replay_buffer(cls: type) -> bool:
    return issubclass(cls, ReplayBuffer)


register_mixin(_is_local_replay_buffer, ObservedReplayBuffer)
