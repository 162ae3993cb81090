"""The episode window of ``episode_window=N``: the last ``N`` episodes, across logging windows."""

from __future__ import annotations

from typing import Any

import torch

from rl_observers.sources.placement import source_info
from rl_observers.stats import LatestWindow, Partial, QuantileReducer, ReducerBank
from rl_observers.stats.latest import latest_reducer

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []

#: What the episode window reports per quantity.
WINDOW_STATS: dict[str, tuple[str, ...]] = {
    "episode_return": ("mean", "std", "min", "max", "p10", "median", "p90"),
    "episode_length": ("mean",),
}


class EpisodeWindow:
    """The last ``size`` episodes completed, folded on the device, kept on the host.

    ``clocks``: ``(steps, cells)`` folded so far, which stamp and order the episode ends.
    """

    __slots__ = ("reducer", "clocks", "recent")

    def __init__(
        self,
        bank: ReducerBank,
        size: int,
        names: tuple[str, ...],
        quantiles: tuple[QuantileReducer, ...] = (),
    ) -> None:
        extra = tuple(f"p{q * 100:g}" for q in quantiles[0].empty().quantiles) if quantiles else ()
        stats = tuple(
            WINDOW_STATS[name] + tuple(s for s in extra if s not in WINDOW_STATS[name])
            for name in names
        )
        self.reducer = latest_reducer(bank, "episode_window", size, names, stats=stats)
        self.clocks = (0, 0)
        self.recent = LatestWindow(size, names, stats=stats)

    def bind(self, source: Any) -> None:
        """Episodes are keyed by the worker they end in (``0`` outside workers)."""
        worker = source_info(source).worker
        self.reducer.source = 0 if worker is None else int(worker)

    def advance(self, batch_size: torch.Size) -> None:
        steps, cells = self.clocks
        self.clocks = (steps + batch_size[-1], cells + batch_size.numel())

    def fold(
        self, values: torch.Tensor, closing: torch.Tensor, base: tuple[int, int] | None = None
    ) -> None:
        """Folds the episodes closing at ``closing`` steps; ``base``: clocks of their first batch."""
        steps, cells = self.clocks if base is None else base
        self.reducer.fold(values, closing, step_base=steps, cell_base=cells)

    def pulled(self, out: dict[str, Any]) -> None:
        """Replaces the pulled window's episodes in ``out`` with the last ``size`` of all."""
        key = self.reducer.key
        self.recent = self.recent.merge(out[key])
        out[key] = self.recent

    def state(self) -> dict[str, Any]:
        """The last episodes (with those of the open window) and the clocks."""
        recent: Partial = self.recent.merge(self.reducer.peek())
        return {
            "size": recent.size,  # type: ignore[attr-defined]
            "names": recent.names,  # type: ignore[attr-defined]
            "entries": [(list(key), list(values)) for key, values in recent.entries],  # type: ignore[attr-defined]
            "clocks": self.clocks,
        }

    def load(self, state: dict[str, Any] | None, owner: str) -> None:
        reducer, entries = self.reducer, []
        if state is not None:
            if state["size"] != reducer.size or tuple(state["names"]) != reducer.names:
                raise ValueError(
                    f"{owner}.load_state_dict: the episode window holds "
                    f"{tuple(state['names'])!r} over {state['size']} episodes, this set keeps "
                    f"{reducer.names!r} over {reducer.size}."
                )
            entries = [(tuple(key), values) for key, values in state["entries"]]
            self.clocks = tuple(state["clocks"])  # type: ignore[assignment]
        self.recent = LatestWindow(reducer.size, reducer.names, stats=reducer.stats, entries=entries)
