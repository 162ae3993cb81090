"""Where a source runs: its kind, its worker index, its process.

:func:`source_info` tells an observer copy which worker it runs in, from
the ``source`` its event methods receive.

Examples:
    >>> import os
    >>> import rl_observers
    >>> from rl_observers.sources.placement import source_info
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> info = source_info(ReplayBuffer(storage=LazyTensorStorage(10)))
    >>> info.kind, info.worker, info.num_workers, info.remote, info.process == os.getpid()
    ('replay_buffer', None, None, False, True)
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["SourceInfo", "process_token", "source_info"]


@dataclass(frozen=True)
class SourceInfo:
    """Where one source runs, as seen from the process it runs in.

    Attributes:
        kind: ``"collector"`` or ``"replay_buffer"``.
        worker: the worker index among a multiprocessing collector's workers
            or a ``RayCollector``'s remote collectors (a shared buffer written
            in a worker reports that worker); ``None`` otherwise.
        num_workers: how many workers, when known, else ``None``.
        process: the id of the process the source runs in.
        remote: whether it runs in a worker process or a Ray actor.
    """

    kind: str
    worker: int | None = None
    num_workers: int | None = None
    process: int = 0
    remote: bool = False


class IdentityMap:
    """A mapping keyed by object identity that does not keep its keys alive (sources may be unhashable)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self._lock = threading.RLock()

    def get(self, key: Any, default: Any = None) -> Any:
        item = self._items.get(id(key))
        if item is None or item[0]() is not key:
            return default
        return item[1]

    def set(self, key: Any, value: Any) -> None:
        ident, items = id(key), self._items

        def forget(ref: weakref.ref[Any]) -> None:
            current = items.get(ident)
            if current is not None and current[0] is ref:
                del items[ident]

        with self._lock:
            items[ident] = (weakref.ref(key, forget), value)

    def items(self) -> list[tuple[Any, Any]]:
        """The ``(key, value)`` pairs whose key is still alive."""
        with self._lock:
            entries = list(self._items.values())
        return [(key, value) for ref, value in entries if (key := ref()) is not None]

    def setdefault(self, key: Any, factory: Any) -> Any:
        """Returns the value of ``key``, first setting it to ``factory()`` if it has none."""
        with self._lock:
            value = self.get(key)
            if value is None:
                value = factory()
                self.set(key, value)
            return value


# What the process that attached an observer copy told the source: (worker, num_workers, remote).
_PLACEMENTS = IdentityMap()
# The collector worker this process is, once rl_observers has been told: (worker, num_workers).
_PROCESS_WORKER: tuple[int, int | None] | None = None


def place(source: Any, worker: int | None, num_workers: int | None, remote: bool = True) -> None:
    """Records where ``source`` runs (called where copies are attached); a worker index also becomes this process's."""
    global _PROCESS_WORKER
    _PLACEMENTS.set(source, (worker, num_workers, remote))
    if worker is not None:
        _PROCESS_WORKER = (worker, num_workers)


def process_token() -> str:
    """This process, told apart from every other on any machine: ``"<pid>-<random>"``."""
    global _TOKEN
    pid = os.getpid()
    if _TOKEN is None or _TOKEN[0] != pid:  # a fork child gets its own
        _TOKEN = (pid, f"{pid}-{uuid.uuid4().hex[:8]}")
    return _TOKEN[1]


_TOKEN: tuple[int, str] | None = None


def source_kind(source: Any) -> str | None:
    """``"collector"``, ``"replay_buffer"`` or ``None``: the one place that tells them apart."""
    from torchrl.collectors import BaseCollector
    from torchrl.data import ReplayBuffer

    if isinstance(source, BaseCollector):
        return "collector"
    if isinstance(source, ReplayBuffer):
        return "replay_buffer"
    return None


def source_info(source: Any) -> SourceInfo:
    """Returns where ``source`` runs: its kind, worker index and process.

    Works in the driver, in workers and in Ray actors; it looks things up, so
    call it once (in ``attached`` or at the first event) and keep the result.

    Examples:
        >>> import rl_observers
        >>> from rl_observers.sources.placement import source_info
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> env = CountingEnv()
        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=4, total_frames=8)
        >>> source_info(collector).kind, source_info(collector).worker
        ('collector', None)
        >>> collector.shutdown()
    """
    kind = source_kind(source) or "replay_buffer"
    pid = os.getpid()
    placement = _PLACEMENTS.get(source)
    if placement is not None:
        worker, num_workers, remote = placement
        return SourceInfo(kind, worker, num_workers, pid, remote)
    if _PROCESS_WORKER is not None:  # this process is a collector worker
        worker, num_workers = _PROCESS_WORKER
        return SourceInfo(kind, worker, num_workers, pid, True)
    try:  # a torchrl collector worker whose loop is on this thread's stack
        frame = sys._getframe(1)
    except ValueError:  # called from the top of a stack
        frame = None
    while frame is not None and frame.f_code.co_name != "_main_async_collector_impl":
        frame = frame.f_back
    worker = None if frame is None else frame.f_locals.get("worker_idx", frame.f_locals.get("idx"))
    if isinstance(worker, int):
        return SourceInfo(kind, worker, None, pid, True)
    ray = sys.modules.get("ray")
    try:  # a Ray actor's process (None: Ray was never imported)
        ray_worker = ray._private.worker.global_worker  # type: ignore[union-attr]
        in_ray = ray_worker.connected and ray_worker.mode == ray.WORKER_MODE  # type: ignore[union-attr]
    except Exception:
        in_ray = False
    return SourceInfo(kind, None, None, pid, in_ray)
