"""Resuming: steps on the source's own counter axis, and what an observer's saved state must fit.

At the first event after attaching or loading, an observer that counted fewer
than torchrl's counter for the source moves up to it; one that counted more
keeps its own. See :ref:`resume`.

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
    """The cumulative counters torchrl keeps for ``source`` and their values now (empty when it does not say)."""
    try:
        if isinstance(source, BaseCollector):
            stats = source.stats()
            return {k: int(stats[k]) for k in ("frames", "batches") if stats.get(k) is not None}
        count = getattr(source, "write_count", None)
        return {} if count is None else {"write_count": int(count)}
    except Exception:  # a source torn down meanwhile: nothing to line up with
        return {}


def owns_axis(source: Any) -> bool:
    """Whether a copy contributing from ``source`` lines up with its counters (its source counts for it alone, not a shared buffer)."""
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
    return dict(name=name, kind=kind, scope=scope, metric_sets=[type(m).__qualname__ for m in sets])


def misfit(saved: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """Why a saved state does not fit this observer (each difference named), or ``None``."""
    version = saved.get("version")
    if version != STATE_VERSION:
        return f"it was saved in format {version!r}, this version reads format {STATE_VERSION}"
    differences = []
    for key in ("name", "kind", "scope", "metric_sets"):
        what = {"name": "namespace", "kind": "kind of source"}.get(key, key.replace("_", " "))
        theirs, ours = saved.get(key), here[key]
        if key == "metric_sets":
            theirs = list(theirs or ())
        if theirs != ours:
            differences.append(f"{what} {theirs!r} (this observer: {ours!r})")
    return "; ".join(differences) or None
