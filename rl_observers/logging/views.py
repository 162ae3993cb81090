"""Per-worker views of a LoggerObserver, for sources whose batches stack their workers by rank.

Step of the flow: **source → observer**, on the driver of
``DistributedCollector(sync=True)`` / ``DistributedSyncCollector``, whose
workers no observer copy reaches (:mod:`~rl_observers.remote.distributed`):
an observer with ``scope="per_worker"`` or ``"both"`` gets one view per
worker, and the source folds ``batch[w]`` into view ``w``. Registered with
:data:`rl_observers.remote.distributed.WORKER_VIEWS` when this module is
imported (``import rl_observers``).
"""

from __future__ import annotations

import pickle
from typing import Any

from rl_observers.logging.observer import LoggerObserver
from rl_observers.remote.copies import pickled
from rl_observers.remote.distributed import WORKER_VIEWS

__all__ = ["worker_view"]


def worker_view(observer: LoggerObserver, source: Any, worker: int) -> LoggerObserver:
    """A ``LoggerObserver`` of worker ``worker``'s share of ``source``'s batches, attached to it.

    It logs ``<name>/worker_<worker>/<metric>`` from fresh copies of the
    observer's metric sets (made before they fold anything), on the same
    schedule over the worker's own counters, with the same step counter,
    ``log_on_start``, ``log_on_close``, ``on_error`` and ``report_interval``.
    Its counters start at zero: they are the worker's, never lined up with
    the source's. The observer's ``state_dict()`` does not hold it.

    Raises:
        TypeError: the metric sets cannot be copied (pickled).
    """
    sets = pickled(observer.metrics)
    if not sets:
        raise TypeError(
            f"LoggerObserver {observer.name!r}: scope={observer.scope!r} folds each worker's rows "
            "into copies of its metric sets, and these cannot be pickled; use scope='aggregate', "
            "or metric sets (and one-liner functions) that pickle."
        )
    view = LoggerObserver(
        observer._sink,
        schedule=observer.schedule,
        metrics=tuple(pickle.loads(sets)),
        name=f"{observer.name}/worker_{worker}",
        step=observer.step_key,
        log_on_start=observer.log_on_start,
        log_on_close=observer.log_on_close,
        on_error=observer.on_error,
        report_interval=observer.report_interval,
    )
    view.attached(source)
    view._align_pending = False  # its counters are the worker's, not the source's
    return view


WORKER_VIEWS[LoggerObserver] = worker_view
