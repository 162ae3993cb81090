"""Interleaved batches (``AsyncBatchedCollector``'s flat ``[N]``): several envs' steps in one time dimension, carried per env index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_observers.metrics.collector.plan import CollectorPlan, EpisodeCarry
from rl_observers.metrics.collector.reducers import BatchReducers
from rl_observers.metrics.collector.ring import RingFold

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


@dataclass(slots=True, eq=False)
class InterleavedFold:
    """The fold path of interleaved batches: each folded on its own, carried per env index.

    ``envs``: env indices are below it (the bound source's count, else learnt
    from CPU batches; ``None`` until known). ``owner`` names the set in errors.
    """

    reducers: BatchReducers
    carry: EpisodeCarry
    ring_fold: RingFold
    owner: str
    envs: int | None = None

    def bind_envs(self, envs: int) -> None:
        """The source has ``envs`` envs (``AsyncBatchedCollector``): indices are below it."""
        self.envs = max(envs, self.envs or 0)

    def fold(
        self,
        plan: CollectorPlan,
        read: dict[Any, torch.Tensor],
        get: Any,
        rows: int,
        steps: int,
        closing_flags: list[torch.Tensor],
        mask: torch.Tensor | None,
        episode_mask: torch.Tensor | None,
        batch_size: torch.Size,
    ) -> None:
        """Folds a batch of interleaved env steps (``env_index``) at once, carried per env index."""
        ring_fold = self.ring_fold
        ring_fold.flush()  # batches of another layout in the ring are summed first
        ring_fold.discard()
        env = read[plan.env_index]
        if env.numel() != batch_size.numel():
            raise ValueError(
                f"{self.owner}: env_index_key {plan.env_index!r} must hold one env "
                f"index per step, got shape {list(env.shape)} for batch_size "
                f"{list(batch_size)}."
            )
        envs = self.envs
        if env.is_cpu and env.numel():
            # Read on the host at no device cost: the table grows to every index seen.
            envs = self.envs = max(envs or 0, int(env.max()) + 1)
        elif envs is None:
            raise ValueError(
                f"{self.owner}: batches of interleaved env steps ({plan.env_index!r}) "
                f"off the CPU need the number of envs, known when the set is bound to its "
                f"AsyncBatchedCollector (attach it with add_observer). Otherwise add RewardSum() "
                f"and StepCounter() transforms to the env, so that episodes are read from "
                f"('next', 'episode_reward') and ('next', 'step_count')."
            )
        closing_flags = [value.reshape(rows, steps) for value in closing_flags]
        closing = closing_flags[0]
        for value in closing_flags[1:]:
            closing = closing | value
        reducers = self.reducers
        if plan.reward is not None:
            reducers.fold_reward(read[plan.reward], mask, batch_size)
        if plan.done is not None and plan.closing != (plan.done,):
            reducers.dones.fold_true(closing_flags[plan.closing.index(plan.done)])  # type: ignore[union-attr]
        sources = plan.episode_sources
        reward = None
        if any(row == 0 and key is None for row, key in sources):
            reward = get(plan.reward).reshape(rows, steps)
        from_keys = [(row, get(key).reshape(rows, steps)) for row, key in sources if key]
        values = close_interleaved(
            self.carry, env, closing, reward, episode_mask, max(envs or 0, 1), from_keys
        )
        reducers.count_frames_and_episodes(torch.count_nonzero(closing), mask, batch_size)
        if len(sources) == 1:
            row = sources[0][0]
            values = values[row : row + 1]
        reducers.fold_episodes(values, closing)


def close_interleaved(
    carry: EpisodeCarry,
    env: torch.Tensor,
    closing: torch.Tensor,
    reward: torch.Tensor | None,
    mask: torch.Tensor | None,
    envs: int,
    from_keys: Sequence[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """Episodes of a batch of interleaved steps, carried per env index (``carry`` updated).

    The steps are stably sorted by env, so each env's steps form one run
    summed as in :func:`close_episodes`, its carry added at its first step.
    ``from_keys``: (row, values) taken from batch keys instead of the sums.
    Returns the ``[2, rows, steps]`` (return, length) closing at each step,
    in batch order. No host read.
    """
    rows, steps = closing.shape
    device = closing.device
    f64 = torch.float64
    # The per-env carry as ``[2, rows, envs]``.
    table = torch.zeros((2, rows, envs), dtype=f64, device=device)
    neg = carry.neg
    if neg is not None and carry.traj is None and neg.shape[-1] % rows == 0:
        known = min(envs, neg.shape[-1] // rows)
        table[..., :known] = neg.to(device).reshape(2, rows, -1)[..., :known].neg()
    env = env.reshape(steps).to(device=device, dtype=torch.int64)
    order = torch.argsort(env, stable=True)
    env = env[order]
    first = torch.ones(steps, dtype=torch.bool, device=device)  # an env's first step
    torch.ne(env[1:], env[:-1], out=first[1:])
    last = torch.ones(steps, dtype=torch.bool, device=device)  # an env's last step
    last[:-1] = first[1:]
    closing = closing[:, order]
    per_step = torch.zeros((2, rows, steps), dtype=f64, device=device)
    if reward is not None:
        reward = reward[:, order]
        per_step[0] = reward if mask is None else torch.where(mask[:, order], reward, 0)
    if mask is None:
        per_step[1] = 1
    else:
        per_step[1] = mask[:, order]
    sums = torch.zeros((2, rows, steps + 1), dtype=f64, device=device)
    torch.cumsum(per_step, -1, out=sums[..., 1:])
    # A segment starts at an env's first step and after each closing step.
    starts = first.expand(rows, steps).clone()
    starts[:, 1:] |= closing[:, :-1]
    index = torch.arange(steps, device=device)
    start = torch.where(starts, index, 0).cummax(-1).values
    values = sums[..., 1:] - sums.gather(-1, start.expand(2, rows, steps))
    # Segments that start at the env's first step in the batch continue its carry.
    carried = table.gather(-1, env.expand(2, rows, steps))
    values += torch.where(first[start], carried, 0)
    # The new carry: what is in flight at each env's last step; envs absent keep theirs.
    present = torch.zeros(envs, dtype=torch.bool, device=device).index_fill_(0, env, True)
    table.masked_fill_(present, 0)
    table.index_add_(-1, env, torch.where(last & ~closing, values, 0))
    carry.neg = table.reshape(2, rows * envs).neg()
    carry.traj = None
    out = torch.empty_like(values).index_copy_(-1, order, values)
    for row, value in from_keys:
        out[row].copy_(value)
    return out
