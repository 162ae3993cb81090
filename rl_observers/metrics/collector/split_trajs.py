"""Padded batches of split trajectories: a carry goes on in the row that continues its trajectory.

A row is a trajectory, not an env, so rows of two batches do not
correspond; each batch is summed alone and carries are matched by id.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_observers.metrics.collector.plan import EpisodeCarry

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


def carry_by_id(ring: Any, line: Any, carry: EpisodeCarry) -> None:
    """Fills the carry column of a ring of one padded batch from the previous batch's row whose last trajectory id starts this row.

    Rows with no such carry start at zero. No host read.
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
