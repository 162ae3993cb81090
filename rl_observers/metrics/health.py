"""WorkerHealth: throughput and health of the process a collector runs in, per worker.

Per event two host integers; the clock, ``/proc`` and the CUDA allocator are read at the pull.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rl_observers.metrics.base import MetricSet
from rl_observers.stats import Partial, PerSecond, Scalar

__all__ = ["WorkerHealth"]

#: The seconds since the owner last heard from the worker heard from longest ago (``0`` in a
#: worker's own rows: it measures nothing of its own silence).
STALENESS = "seconds_since_last_heard"
_MB = 1024.0 * 1024.0


class _Silence(Scalar):
    """:data:`STALENESS`, which the owner merging the workers measures (``Partial.silence``)."""

    __slots__ = ()
    silence = True


def resident_memory_mb() -> float:
    """This process's resident memory in MiB, from ``/proc/self/statm`` (NaN where there is none).

    Examples:
        >>> resident_memory_mb() > 0
        True
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _MB
    except (OSError, IndexError, ValueError):
        return float("nan")


class WorkerHealth(MetricSet):
    """Frames and batches per second, resident and CUDA memory, and staleness, per worker.

    Opt-in (``metrics=[CollectorBatchMetrics(), WorkerHealth()]``, with
    ``scope="per_worker"`` or ``"both"`` to see each worker). Rates merge as
    :class:`~rl_observers.stats.PerSecond` (workers' rates add), memory by
    max; ``seconds_since_last_heard`` is measured at the channel's owner (max
    over workers). See :doc:`health`.

    Examples:
        >>> from tensordict import TensorDict
        >>> import torch
        >>> from rl_observers import WorkerHealth
        >>> health = WorkerHealth()
        >>> health.on_post_collect(None, TensorDict({"obs": torch.zeros(50, 3)}, [50]))
        >>> health.on_post_collect(None, TensorDict({"obs": torch.zeros(50, 3)}, [50]))
        >>> window = health.pull()
        >>> window["frames_per_second"].amount, window["batches_per_second"].amount
        (100.0, 2.0)
        >>> window["resident_memory_mb"].finalize()["resident_memory_mb"] > 0
        True
    """

    _lock_folds = False  # two host additions per event; the pull takes the lock

    def __init__(self) -> None:
        super().__init__()
        self._clear_window()

    def bind(self, source: Any) -> None:
        """The first window starts when the set is attached (in the process that runs it)."""
        self._start = time.time()

    def on_post_collect(self, source: Any, batch: Any) -> None:
        self._frames += batch.numel()
        self._batches += 1

    def pull(self) -> dict[str, float | Partial]:
        with self._lock:
            out: dict[str, float | Partial] = dict(super().pull())
            end = time.time()  # the one clock read of the window
            start, self._start = self._start, end
            frames, self._frames = self._frames, 0
            batches, self._batches = self._batches, 0
            out["frames_per_second"] = PerSecond("frames_per_second", frames, start, end)
            out["batches_per_second"] = PerSecond("batches_per_second", batches, start, end)
            out["resident_memory_mb"] = Scalar("resident_memory_mb", "max", resident_memory_mb())
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                allocated = torch.cuda.memory_allocated() / _MB
                reserved = torch.cuda.memory_reserved() / _MB
                out["cuda_memory_allocated_mb"] = Scalar("cuda_memory_allocated_mb", "max", allocated)
                out["cuda_memory_reserved_mb"] = Scalar("cuda_memory_reserved_mb", "max", reserved)
            out[STALENESS] = _Silence(STALENESS, "max", 0.0)
            return out

    def metric_names(self) -> tuple[str, ...]:
        rates = ("frames_per_second", "batches_per_second")
        memory = ("resident_memory_mb", "cuda_memory_allocated_mb", "cuda_memory_reserved_mb")
        return (*super().metric_names(), *rates, *memory, STALENESS)

    def _clear_window(self) -> None:
        self._frames = self._batches = 0
        self._start = time.time()
