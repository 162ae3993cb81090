"""torch.distributed and RPC collectors, observed on the driver.

Every batch crosses to the driver, so observers run there: the observed
``iterator`` emits ``pre_collect``, ``post_collect`` and ``shutdown``. Where
batches stack the workers by rank, observers get each worker's own
trajectory ids (:func:`own_trajectory_ids`); elsewhere episode statistics
are refused. See ``docs/distributed.rst``.

Examples:
    >>> from rl_observers.remote.distributed import ObservedDistributedCollector
    >>> sorted(name for name in vars(ObservedDistributedCollector) if not name.startswith("__"))
    ['check_metric_sets', 'iterator', 'shutdown', 'stats']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rl_observers.observer import ObserverList
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources.collectors import ObservedCollector
from rl_observers.sources.observed import observers_of, torchrl_class

__all__ = ["DistributedCollectorObservers", "ObservedDistributedCollector"]

_MASK = ("collector", "mask")
_TRAJ_IDS = ("collector", "traj_ids")

#: ``{observer class: view(observer, source, worker)}``: how an observer of that class with
#: ``scope="per_worker"`` or ``"both"`` gets one view per worker (``LoggerObserver``:
#: :func:`rl_observers.logging.views.worker_view`, registered when it is imported).
WORKER_VIEWS: dict[type, Callable[[Any, Any, int], Any]] = {}


class DistributedCollectorObservers(ObserverList):
    """The observers of one torch.distributed / RPC collector, run on the driver.

    Where batches stack the workers by rank, a ``"per_worker"`` / ``"both"``
    observer with a view in :data:`WORKER_VIEWS` gets one view per worker,
    fed ``batch[w]``; resolved when the call tuples are built.
    """

    def __init__(self, source: Any, emits: tuple[str, ...] = COLLECTOR_EVENTS, target_name: str = "collector") -> None:
        super().__init__(source, emits, target_name)
        self._views: dict[int, tuple[Any, ...]] = {}  # id(observer) -> its views, by worker

    def _rebuild(self) -> None:
        super()._rebuild()
        workers = _per_worker_rows(self.source)
        if workers is None:
            return
        calls = dict(self._calls)
        for event, wrap in (("post_collect", self._fold_by_worker), ("shutdown", self._shutdown_views)):
            if event in calls:
                calls[event] = tuple(
                    (wrap(fn, e.observer, workers) if _view_of(e.observer) else fn, e)
                    for fn, e in calls[event]
                )
        self._calls = calls

    def _fold_by_worker(self, fn: Any, observer: Any, workers: int) -> Any:
        both = observer.scope == "both"
        view = _view_of(observer)

        def post_collect(source: Any, batch: Any) -> None:
            views = self._views.get(id(observer))
            if views is None:
                views = self._views[id(observer)] = tuple(view(observer, source, w) for w in range(workers))
            if both:
                fn(source, batch)
            for worker, its_view in enumerate(views):
                its_view.on_post_collect(source, batch[worker])

        return post_collect

    def _shutdown_views(self, fn: Any, observer: Any, workers: int) -> Any:
        def shutdown(source: Any) -> None:
            try:
                fn(source)
            finally:
                for view in self._views.get(id(observer), ()):
                    view.on_shutdown(source)

        return shutdown

    def remove(self, observer: Any) -> Any:
        removed = super().remove(observer)
        if removed is not None:
            for view in self._views.pop(id(observer), ()):
                view.detached(self.source)  # its last window
        return removed


def _view_of(observer: Any) -> Callable[[Any, Any, int], Any] | None:
    """How ``observer`` gets one view per worker, if its scope asks for them (:data:`WORKER_VIEWS`)."""
    if getattr(observer, "scope", None) not in ("per_worker", "both"):
        return None
    return next((view for cls, view in WORKER_VIEWS.items() if isinstance(observer, cls)), None)


def _frames(collector: Any, batch: Any) -> int:
    """The frames torchrl counts for ``batch`` (before ``split_trajs`` padded it)."""
    if getattr(collector, "split_trajs", False):
        mask = batch.get(_MASK, None)
        if mask is not None:
            return int(mask.sum())
    return batch.numel()


def _stacked_workers(collector: Any) -> int | None:
    """The number of workers when ``collector``'s batches stack them by rank, else ``None``."""
    cls = torchrl_class(type(collector)).__name__
    if cls == "DistributedSyncCollector" or (cls == "DistributedCollector" and collector._sync):
        return collector.num_workers
    return None


def _per_worker_rows(collector: Any) -> int | None:
    """The number of workers when observers can fold ``collector``'s batches per worker."""
    return None if getattr(collector, "split_trajs", False) else _stacked_workers(collector)


def _why_not_exact(collector: Any) -> str | None:
    """Why running episode sums cannot be exact over ``collector``'s batches, or ``None``."""
    if getattr(collector, "split_trajs", False):
        return (
            "with split_trajs=True torchrl pads the batch into trajectories by the ids it "
            "renumbered across workers (off by one, afresh at each batch), so two workers' "
            "trajectories can share a padded row"
        )
    if _stacked_workers(collector) is not None:
        return None
    if torchrl_class(type(collector)).__name__ == "RPCCollector" and collector._sync:
        return (
            "its batches concatenate the workers' batches in the order they completed, with "
            "nothing saying which worker sent which part, so an episode in flight at the end "
            "of a batch cannot be joined to its rest"
        )
    return (
        "each of its batches is one worker's, and the driver folds them all into one set of "
        "running sums, which would join one worker's episode in flight to another's"
    )


def own_trajectory_ids(traj_ids: torch.Tensor, workers: int) -> torch.Tensor:
    """Trajectory ids of a batch stacked by rank, as each worker numbered them, made unique.

    Undoes torchrl's shift (by worker ``i - 1``'s largest id in the batch);
    worker ``w``'s trajectory ``k`` becomes ``k * workers + w``. No host sync.

    Examples:
        >>> import torch
        >>> from rl_observers.remote.distributed import own_trajectory_ids
        >>> shifted = torch.tensor([[3, 3, 4], [7, 8, 8]])  # worker 1's own ids: 3, 4, 4
        >>> own_trajectory_ids(shifted, 2)
        tensor([[6, 6, 8],
                [7, 9, 9]])
    """
    last = traj_ids.reshape(workers, -1).amax(1)
    shift = torch.cat((last.new_zeros(1), last[:-1])).view(-1, *(1,) * (traj_ids.ndim - 1))
    rank = torch.arange(workers, device=traj_ids.device).view_as(shift)
    return (traj_ids - shift) * workers + rank


def _presented(batch: Any, workers: int) -> Any:
    """What observers get of a batch stacked by rank: its own trajectory ids (module docstring)."""
    traj_ids = batch.get(_TRAJ_IDS, None)
    if traj_ids is None or batch.batch_dims < 2 or batch.batch_size[0] != workers:
        return batch
    presented = batch.copy()
    presented.set(_TRAJ_IDS, own_trajectory_ids(traj_ids, workers))
    return presented


class ObservedDistributedCollector:
    """Mixin of observed torch.distributed / RPC collectors (see the module docstring)."""

    def check_metric_sets(self, sets: Sequence[Any]) -> None:
        """Refuses metric sets whose numbers this collector's batches cannot make exact.

        A set that follows episodes across batches (``MetricSet.episode_arguments``)
        is refused where a batch does not say which worker's steps are which.

        Raises:
            ValueError: naming the collector, why, and what to use instead.
        """
        reason = _why_not_exact(self)
        if reason is None:
            return
        for metric_set in sets:
            if metric_set.episode_arguments is not None:
                cls = torchrl_class(type(self)).__name__
                mode = "" if cls == "DistributedSyncCollector" else f"(sync={bool(self._sync)})"  # type: ignore[attr-defined]
                split = ", split_trajs=True" if getattr(self, "split_trajs", False) else ""
                name = type(metric_set).__name__
                raise ValueError(
                    f"{metric_set!r} follows episodes across batches, which cannot be exact on "
                    f"{cls}{mode}{split}: {reason}. Use {name}({metric_set.episode_arguments}) "
                    "there (rewards, dones, frames and episode counts stay exact), or collect "
                    "with DistributedSyncCollector or DistributedCollector(sync=True) and "
                    "split_trajs=False, whose batches stack the workers by rank."
                )

    def iterator(self) -> Iterator[Any]:
        batches = torchrl_class(type(self)).iterator(self)  # type: ignore[attr-defined]
        total = getattr(self, "total_frames", float("inf"))
        stacked = _per_worker_rows(self)
        received = 0
        try:
            while True:
                observers = observers_of(self)
                if observers is not None and received < total:  # torchrl's own loop condition
                    observers.emit("pre_collect")
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if batch is not None:
                    received += _frames(self, batch)
                    observers = observers_of(self)
                    if observers is not None:
                        observers.emit("post_collect", batch if stacked is None else _presented(batch, stacked))
                yield batch
        finally:
            batches.close()

    # The collector shuts down even if an observer raises (on_error="raise"); stats() gets
    # the observers' entries: both as for an in-process collector.
    shutdown = ObservedCollector.shutdown
    stats = ObservedCollector.stats
