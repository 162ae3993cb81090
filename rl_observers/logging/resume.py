"""Resuming: steps on the source's own counter axis, and what an observer's saved state must fit.

Step of the flow: **observer** (source → observer → channel → logger), when
a run is resumed from a checkpoint (torchrl's
:class:`~torchrl.checkpoint.Checkpoint`) or an observer is attached to a
source that already ran.

The rule: a :class:`~rl_observers.LoggerObserver` counts on the axis of the
cumulative counter torchrl itself keeps and restores for the source:

- a collector's ``frames`` (its ``state_dict()["frames"]``,
  ``stats()["frames"]``);
- a replay buffer's ``write_count`` (the observer's ``write_count`` and
  ``items_written``).

At the first event after it is attached (or after its
:meth:`~rl_observers.LoggerObserver.load_state_dict`), an observer that
counted fewer than the source moves its counter up to the source's
(:func:`source_axis`), and its counter schedule's next threshold with it,
so an observer attached to a collector restored at 12,000 frames logs its
first row at 13,000. An observer that counted more (its own saved state, a
buffer emptied with ``empty_write_count=True``, a collector rebuilt in a
loop) keeps its own count: steps never go backwards. Counters torchrl does
not keep (``sample_calls``, ``samples_returned``, ``episodes``) come back
only from the observer's own saved state.

Copies that run away from the channel (multiprocessing workers, Ray actors)
line up the same way when their source counts for them alone
(:func:`owns_axis`): a worker of a restored ``MultiSyncCollector`` starts at
its restored ``frames``, and its windows carry how much of the count came
from there (``Window.base``), so the owner's aggregate counts on from the
restored sum and fires no threshold for it, saved state or not.

Examples:
    >>> import torch
    >>> import rl_observers
    >>> from rl_observers.logging.resume import source_axis
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(10))
    >>> _ = rb.extend(torch.arange(4))
    >>> source_axis(rb)
    {'write_count': 4}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchrl.collectors import BaseCollector

from rl_observers.metrics import MetricSet
from rl_observers.sources.placement import source_info

__all__ = ["AXIS_COUNTERS", "describe", "misfit", "owns_axis", "shift_counters", "source_axis"]

#: The observer counters that follow each source counter torchrl keeps.
AXIS_COUNTERS: dict[str, tuple[str, ...]] = {
    "frames": ("frames",),
    "batches": ("batches",),
    "write_count": ("write_count", "items_written"),
}
#: Bumped when the layout of :meth:`LoggerObserver.state_dict` changes.
STATE_VERSION = 1


def source_axis(source: Any) -> dict[str, int]:
    """The cumulative counters torchrl keeps for ``source``, and their values now.

    ``frames`` and ``batches`` for a collector, ``write_count`` for a replay
    buffer; empty when the source does not say.
    """
    try:
        if isinstance(source, BaseCollector):
            stats = source.stats()
            return {k: int(stats[k]) for k in ("frames", "batches") if stats.get(k) is not None}
        count = getattr(source, "write_count", None)
        return {} if count is None else {"write_count": int(count)}
    except Exception:  # a source torn down meanwhile: nothing to line up with
        return {}


def owns_axis(source: Any) -> bool:
    """Whether a copy contributing from ``source`` (away from the channel) lines up with its counters.

    True where the copy's source counts for this copy alone: a
    multiprocessing worker's inner collector, a remote Ray collector, a Ray
    replay buffer's actor. Their counters restored (a ``MultiSyncCollector``
    loaded from a checkpoint restores each worker's ``frames``), the copy
    starts from them and tells the owner's aggregate how much of its count
    came from there (``Window.base``), so the aggregate's thresholds and
    steps go on from the restored sum, saved observer state or not. False
    for a shared replay buffer, whose ``write_count`` counts every process's
    writes.
    """
    info = source_info(source)
    return info.remote and (info.kind == "collector" or info.worker is None)


def shift_counters(sets: Sequence[MetricSet], names: Sequence[str], amount: int) -> None:
    """Adds ``amount`` to the cumulative counters ``names`` of every set that keeps one."""
    for metric_set in sets:
        counters = getattr(metric_set, "_counters", None)
        values = getattr(counters, "values", None)
        if not isinstance(values, dict):
            continue
        with metric_set._lock:
            for name in names:
                if name in values:
                    values[name] += amount


def describe(name: str | None, kind: str, scope: str, sets: Sequence[MetricSet]) -> dict[str, Any]:
    """What a saved state must match to be loaded: namespace, kind of source, scope, metric sets."""
    return {
        "name": name,
        "kind": kind,
        "scope": scope,
        "metric_sets": [type(m).__qualname__ for m in sets],
    }


def misfit(saved: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """Why a saved state does not fit this observer (each difference named), or ``None``."""
    version = saved.get("version")
    if version != STATE_VERSION:
        return f"it was saved in format {version!r}, this version reads format {STATE_VERSION}"
    differences = []
    for key, what in (
        ("name", "namespace"),
        ("kind", "kind of source"),
        ("scope", "scope"),
        ("metric_sets", "metric sets"),
    ):
        theirs, ours = saved.get(key), here[key]
        if key == "metric_sets":
            theirs = list(theirs or ())
        if theirs != ours:
            differences.append(f"{what} {theirs!r} (this observer: {ours!r})")
    return "; ".join(differences) or None
