"""Padded batches of split trajectories: a carry goes on in the row that continues its trajectory.

With ``split_trajs=True`` (or ``trajs_per_batch``) a batch row is a
trajectory, padded with masked steps, not an env, and the rows of two batches
do not correspond. The ring sums each such batch on its own
(:attr:`~rl_observers.metrics.collector.ring.EpisodeRing.by_id`) and
:func:`carry_by_id` hands each row the episode in flight of the previous
batch's row whose last valid step has the trajectory id of its first.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_observers.metrics.collector.plan import EpisodeCarry

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


def carry_by_id(ring: Any, line: Any, carry: EpisodeCarry) -> None:
    """Fills the carry column of a ring of one padded batch, matching trajectory ids.

    A row of the batch takes the carry of the previous batch's row whose last
    valid step has the trajectory id of its first step (and the same entry,
    when steps have several): a trajectory that goes on in the next batch
    keeps its id (``split_trajs``). Rows with no such carry start at zero.
    No host read; ``[rows, previous rows]`` comparisons.
    """
    rows = ring.closing.shape[0]
    previous, neg_carry = carry.traj, carry.neg
    if (
        previous is None
        or neg_carry is None
        or previous.ndim != 1
        or neg_carry.shape != (2, previous.shape[0])
    ):
        line.carry.zero_()
        return
    device = ring.closing.device
    previous = previous.to(device)
    first = line.traj_first.to(torch.int64)
    previous = previous.to(torch.int64)
    entries = ring.entry_count
    if entries > 1:  # rows are (trajectory, entry), entry fastest: the entry is part of the key
        first = first * entries + torch.arange(rows, device=device) % entries
        previous = previous * entries + torch.arange(previous.shape[0], device=device) % entries
    match = (first.unsqueeze(1) == previous.unsqueeze(0)).to(torch.float64)
    line.carry.copy_(torch.mm(neg_carry.to(device), match.T))
