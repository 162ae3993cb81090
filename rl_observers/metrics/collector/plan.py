"""What a collector batch's fold needs: its keys resolved once (:class:`CollectorPlan`), its layout, the episodes in flight."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import is_tensor_collection

from rl_observers.metrics.keys import NestedKey, leaf_keys, missing_key

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


@dataclass(slots=True, eq=False)
class CollectorPlan:
    """Keys of a collector batch, resolved at the first batch.

    ``entries``: the shape of one step's entries (agents, nested envs), ``()``
    for one. ``reads``: ``(key, argument name)`` pairs, each key read once.
    """

    reward: NestedKey | None
    done: NestedKey | None
    closing: tuple[NestedKey, ...]
    mask: NestedKey | None
    traj_ids: NestedKey | None
    env_index: NestedKey | None
    running: bool
    episode_sources: tuple[tuple[int, NestedKey | None], ...]
    entries: tuple[int, ...]
    reads: tuple[tuple[NestedKey, str], ...]


def per_entry(value: torch.Tensor, batch_dims: int, entries: tuple[int, ...]) -> torch.Tensor:
    """``[*B, T, *extra]`` -> ``[B * E, T]`` (a copy): one row per env and entry, a per-step value broadcast."""
    lead = value.shape[:batch_dims]
    steps = lead[-1]
    if math.prod(value.shape[batch_dims:]) == 1:
        value = value.reshape(*lead[:-1], *(1,) * len(entries), steps)
        value = value.expand(*lead[:-1], *entries, steps)
    else:
        value = value.reshape(*lead, *entries).movedim(batch_dims - 1, -1)
    return value.reshape(-1, steps)


def flags(value: torch.Tensor, rows: int, steps: int) -> torch.Tensor:
    """``[*B, T, *extra]`` flags -> ``[rows, steps]`` booleans (any over the extra dims)."""
    if value.numel() == rows * steps:
        value = value.reshape(rows, steps)
        return value if value.dtype is torch.bool else value.to(torch.bool)
    return value.reshape(rows, steps, -1).to(torch.bool).any(-1)


def entries_of(
    batch: Any, per_step: list[tuple[Any, str]], closing: tuple[Any, ...], owner: str
) -> tuple[int, ...]:
    """The shape of one step's entries, decided by the episode values; ``()`` for one entry (any closing flag closes it)."""
    dims = batch.batch_dims
    entries: tuple[int, ...] = ()
    seen = None
    for key, what in [*per_step, *((k, "closing key") for k in closing)]:
        if key is None:
            continue
        shape = tuple(batch.get(key).shape[dims:])
        if math.prod(shape) == 1:
            continue
        if shape and shape[-1] == 1:
            shape = shape[:-1]
        if seen is None and what == "closing key":
            break  # per-step values have one entry: flags are reduced with any
        if seen is None:
            entries, seen = shape, (key, what)
        elif shape != entries:
            raise ValueError(
                f"{owner}: episode metrics need the entries of one step to agree, got {key!r} "
                f"({what}) with {list(shape)} entries per step and {seen[0]!r} ({seen[1]}) with "
                f"{list(entries)}, for batch_size {list(batch.batch_size)}."
            )
    return entries


@dataclass(slots=True, eq=False)
class EpisodeCarry:
    """The episodes in flight at the end of the batches summed so far.

    ``neg``: ``[2, rows]`` float64, minus each row's (return, length) in
    flight (``[2, rows * envs]`` for interleaved batches); ``traj``: the rows'
    last trajectory ids, if any. Padded batches match carries by id.
    """

    neg: torch.Tensor | None = None
    traj: torch.Tensor | None = None

    def clear(self) -> None:
        """Drops the episodes in flight (the envs were reset)."""
        self.neg = self.traj = None

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """``carry``: the ``[rows, 2]`` (return, length) in flight; ``carry_traj_ids``: their ids."""
        neg, traj = self.neg, self.traj
        return {
            "carry": None if neg is None else neg.neg().T.contiguous(),
            "carry_traj_ids": None if traj is None else traj.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], owner: str) -> None:
        """Takes the carry :meth:`state_dict` saved (in place: the fold paths hold this one), checked first."""
        carry = state_dict["carry"]
        if carry is not None and (carry.ndim != 2 or carry.shape[-1] != 2):
            raise ValueError(
                f"{owner}.load_state_dict expects a carry of shape [envs, 2], "
                f"got {list(carry.shape)}."
            )
        traj = state_dict.get("carry_traj_ids")
        self.neg = None if carry is None else carry.to(torch.float64).T.neg()
        self.traj = None if traj is None else traj.clone()


def resolve_plan(metrics: Any, batch: Any) -> CollectorPlan:
    """Resolves the keys of ``metrics`` (a :class:`CollectorBatchMetrics`) on its first ``batch``."""
    owner = type(metrics).__name__
    if not is_tensor_collection(batch):
        raise TypeError(f"{owner} expects TensorDict batches, got {type(batch).__name__}.")
    if not batch.batch_dims:
        raise ValueError(
            f"{owner} expects batches with a time dimension (batch_size [T] or [*B, T]), "
            f"got batch_size={list(batch.batch_size)}."
        )
    present = leaf_keys(batch)

    def required(key: NestedKey | None, what: str) -> NestedKey | None:
        if key is not None and key not in present:
            raise missing_key(owner, what, key, present)
        return key

    def optional(key: NestedKey | None) -> NestedKey | None:
        return key if key is not None and key in present else None

    reward = required(metrics.reward_key, "reward_key")
    done = required(metrics.done_key, "done_key")
    terminated, truncated = optional(metrics.terminated_key), optional(metrics.truncated_key)
    closing = tuple(k for k in (done, terminated, truncated) if k)
    if not closing and metrics._episodes is not None:
        key = metrics.terminated_key or metrics.truncated_key
        raise missing_key(owner, "terminated_key/truncated_key", key, present)
    episode_reward = optional(metrics.episode_reward_key) if metrics.episode_return else None
    step_count = optional(metrics.step_count_key) if metrics.episode_length else None
    sums_rewards = metrics.episode_return and episode_reward is None
    running = sums_rewards or (metrics.episode_length and step_count is None)
    if sums_rewards and reward is None:
        raise missing_key(owner, "episode_reward_key", metrics.episode_reward_key, present)
    per_step = [(episode_reward, "episode_reward_key"), (step_count, "step_count_key")]
    if sums_rewards:
        per_step.append((reward, "reward_key"))
    entries = entries_of(batch, per_step, closing, owner)
    # Per quantity of the episode group: its row of the running sums (0: return,
    # 1: length) and the batch key it is read from at closing steps, if any.
    sources = ((0, episode_reward),) if metrics.episode_return else ()
    if metrics.episode_length:
        sources += ((1, step_count),)
    traj_ids = optional(metrics.traj_ids_key)
    mask = optional(metrics.mask_key)
    # Steps of several envs interleaved in one time dimension (AsyncBatchedCollector):
    # the running sums are kept per env index.
    env_index = optional(metrics.env_index_key) if running and batch.batch_dims == 1 else None
    if env_index is not None:
        traj_ids = None
    # What _fold reads, each once, with the argument that names it.
    reads: dict[NestedKey, str] = {}
    for key, what in (
        (mask, "mask_key"),
        (reward, "reward_key"),
        (done, "done_key"),
        (terminated, "terminated_key"),
        (truncated, "truncated_key"),
        (episode_reward, "episode_reward_key"),
        (step_count, "step_count_key"),
        (traj_ids if running else None, "traj_ids_key"),  # read by the ring only
        (env_index, "env_index_key"),
    ):
        if key is not None:
            reads.setdefault(key, what)
    reads_once = tuple(reads.items())
    return CollectorPlan(
        reward, done, closing, mask, traj_ids, env_index, running, sources, entries, reads_once
    )
