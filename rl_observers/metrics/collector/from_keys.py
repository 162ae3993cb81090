"""Episodes read from the batch: ``RewardSum`` / ``StepCounter`` entries taken at closing steps; nothing carried."""

from __future__ import annotations

from typing import Any

import torch

from rl_observers.metrics.collector.plan import CollectorPlan
from rl_observers.metrics.collector.reducers import BatchReducers
from rl_observers.stats.reducers import Transient

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


class FromKeysFold(Transient):
    """The fold path of batches whose episode quantities are read at their closing steps.

    ``stacked``: the ``[K, rows, steps]`` float64 buffer they are read into
    (remade for another shape or device, never pickled).
    """

    __slots__ = ("reducers", "stacked")
    _transient = ("stacked",)

    def __init__(self, reducers: BatchReducers) -> None:
        self.reducers = reducers
        self.stacked: torch.Tensor | None = None

    def fold(
        self,
        plan: CollectorPlan,
        get: Any,
        rows: int,
        steps: int,
        closing_flags: list[torch.Tensor],
        reward: torch.Tensor | None,
        mask: torch.Tensor | None,
        batch_size: torch.Size,
    ) -> None:
        """Folds a batch whose episode quantities are read at its closing steps (no carry)."""
        reducers = self.reducers
        if reward is not None:
            reducers.fold_reward(reward, mask, batch_size)
        closing = closing_flags[0]
        for key, value in zip(plan.closing, closing_flags):
            if key == plan.done:
                reducers.dones.fold_true(value)  # type: ignore[union-attr]
            if value is not closing:
                closing = closing | value
        n_closed = torch.count_nonzero(closing)
        reducers.count_frames_and_episodes(n_closed, mask, batch_size)
        reducers.episodes.add(n_closed)  # type: ignore[union-attr]
        if reducers.episode is not None:
            # Read at the closing steps, stacked straight into float64 (exact step counts
            # whatever the reward's dtype).
            sources = plan.episode_sources
            values = self.stacked
            shape = (len(sources), rows, steps)
            if values is None or values.shape != shape or values.device != closing.device:
                values = self.stacked = closing.new_empty(shape, dtype=torch.float64)
            torch.stack([get(key).reshape(rows, steps) for _, key in sources], out=values)
            reducers.fold_episodes(values, closing)
