"""Episodes read from the batch: ``RewardSum`` / ``StepCounter`` entries taken at closing steps.

When the env provides ``("next", "episode_reward")`` and ``("next",
"step_count")`` (or whichever of them the set reports), an episode's return and
length are the entries at its closing step: nothing is carried across batches
and each batch is folded at once, on its device.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_observers.metrics.collector.plan import CollectorPlan

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


def fold_from_keys(
    metrics: Any,
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
    if reward is not None:
        metrics._fold_reward(reward, mask, batch_size)
    closing = closing_flags[0]
    for key, value in zip(plan.closing, closing_flags):
        if key == plan.done:
            metrics._dones.fold_true(value)
        if value is not closing:
            closing = closing | value
    n_closed = torch.count_nonzero(closing)
    metrics._count_frames_and_episodes(n_closed, mask, batch_size)
    metrics._episodes.add(n_closed)
    if metrics._episode is not None:
        # Read at the closing steps, stacked straight into float64 (exact step counts
        # whatever the reward's dtype).
        sources = plan.episode_sources
        values = metrics._stacked
        shape = (len(sources), rows, steps)
        if values is None or values.shape != shape or values.device != closing.device:
            values = metrics._stacked = closing.new_empty(shape, dtype=torch.float64)
        torch.stack([get(key).reshape(rows, steps) for _, key in sources], out=values)
        metrics._episode.fold(values, closing)
        metrics._fold_episode_quantiles(values, closing)
        if metrics._window is not None:
            metrics._window.fold(values, closing)
