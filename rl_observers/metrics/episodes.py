"""The episode kernel: per-env running sums of batches, carried across batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CollectorPlan", "EpisodeRing", "Timeline", "flags"]


class CollectorPlan:
    """Keys of a collector batch, resolved at the first batch."""

    __slots__ = (
        "reward",
        "done",
        "closing",
        "mask",
        "episode_reward",
        "step_count",
        "traj_ids",
        "running",
        "episode_sources",
    )

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields[name])


def flags(value: torch.Tensor, rows: int, steps: int) -> torch.Tensor:
    """``[*B, T, *extra]`` flags -> ``[rows, steps]`` booleans (any over the extra dims)."""
    if value.numel() == rows * steps:
        value = value.reshape(rows, steps)
        return value if value.dtype is torch.bool else value.to(torch.bool)
    return value.reshape(rows, steps, -1).to(torch.bool).any(-1)


# Batches folded with running episode sums are kept in a ring of up to this many batches
# (and this many steps in all) and summed together: the cost of the running sums is paid
# once per ring, not once per batch.
_RING_BATCHES = 16
_RING_STEPS = 2**15
# CPU batches need no device sync to be read: the ring counts their closed episodes on the
# host, and a flush with none (and no trajectory cut) only moves the carries. Tests turn
# this off to check the values of the device path on the CPU.
_CPU_SHORTCUTS = True


class EpisodeRing:
    """Batches waiting for their running episode sums, laid out ``[rows, batches, steps]``.

    Each batch is copied into the next slot (rewards as float64, closing flags,
    and what else the sums need); :meth:`CollectorBatchMetrics._flush` sums the
    used slots as one timeline per env. The buffers the sums work in are kept
    here too, sized for a full ring.
    """

    __slots__ = (
        "key",
        "size",
        "used",
        "reward",
        "closing",
        "done",
        "mask",
        "traj",
        "from_keys",
        "sums",
        "positions",
        "step_numbers",
        "no_step",
        "no_carry",
        "_views",
        "_timelines",
        "closed",
    )

    def __init__(
        self,
        key: tuple[Any, ...],
        rows: int,
        steps: int,
        device: torch.device,
        *,
        reward: bool,
        done: bool,
        mask: bool,
        traj_dtype: torch.dtype | None,
        from_keys: Sequence[int],
    ) -> None:
        self.key = key
        size = self.size = max(1, min(_RING_BATCHES, _RING_STEPS // max(1, rows * steps)))
        self.used = 0
        f64, shape = torch.float64, (rows, size, steps)
        self.reward = torch.zeros(shape, dtype=f64, device=device) if reward else None
        self.closing = torch.zeros(shape, dtype=torch.bool, device=device)
        self.done = torch.zeros(shape, dtype=torch.bool, device=device) if done else None
        self.mask = torch.zeros(shape, dtype=torch.bool, device=device) if mask else None
        self.traj = None if traj_dtype is None else torch.zeros(shape, dtype=traj_dtype, device=device)
        # Per row of the sums (0: return, 1: length) read from a batch key instead.
        self.from_keys = {row: torch.zeros(shape, dtype=f64, device=device) for row in from_keys}
        timeline = size * steps
        self.sums = torch.zeros((2, rows, timeline + 1), dtype=f64, device=device)
        if not mask:  # every step counts: the cumulative lengths are 1, 2, ...
            self.sums[1, :, 1:] = torch.arange(1, timeline + 1, dtype=f64, device=device)
        self.positions = torch.zeros((rows, timeline + 1), dtype=torch.int64, device=device)
        self.step_numbers = torch.arange(1, timeline + 1, dtype=torch.int64, device=device)
        self.no_step = torch.zeros((), dtype=torch.int64, device=device)
        self.no_carry = torch.zeros((), dtype=f64, device=device)
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self._timelines: dict[int, Timeline] = {}
        # Episodes closed in the used slots, when known on the host (CPU batches), else None.
        self.closed: int | None = self.empty_count()

    def empty_count(self) -> int | None:
        return 0 if self.closing.device.type == "cpu" and _CPU_SHORTCUTS else None

    def timeline(self, used: int) -> Timeline:
        """The views and buffers a flush of ``used`` slots works with (made once per ``used``)."""
        timeline = self._timelines.get(used)
        if timeline is None:
            if len(self._timelines) >= 4:  # flushes come at a few fill levels at most
                self._timelines.pop(next(iter(self._timelines)))
            timeline = self._timelines[used] = Timeline(self, used)
        return timeline

    def slot(self, buffer: torch.Tensor, name: str, shape: torch.Size) -> torch.Tensor:
        """The current slot of ``buffer`` viewed with a batch entry's ``shape`` (cached)."""
        key = (name, self.used, shape)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = buffer[:, self.used].view(shape)
        return view


class Timeline:
    """The first ``used`` slots of a ring as one timeline per env: views and work buffers.

    ``copies`` are the (source, destination) pairs that lay the slots out as
    ``[rows, used * steps]`` when the ring is not full (a full ring already is).
    """

    __slots__ = (
        "length",
        "copies",
        "closing",
        "reward",
        "reward_copy",
        "mask",
        "from_keys",
        "done",
        "sums",
        "cum_reward",
        "cum_length",
        "carry",
        "sums_end",
        "sums_tail",
        "positions",
        "positions_tail",
        "step_numbers",
        "start",
        "start_indices",
        "start_index",
        "at_start",
        "at_end",
        "at_head",
        "values",
        "traj_first",
        "traj_last",
        "traj_next_first",
        "traj_prev_last",
    )

    def __init__(self, ring: EpisodeRing, used: int) -> None:
        rows, size, steps = ring.closing.shape
        length = self.length = used * steps
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def laid_out(buffer: torch.Tensor | None) -> Any:
            """``buffer``'s timeline and, when the ring is not full, the copy that makes it."""
            if buffer is None:
                return None, None
            source = buffer[:, :used]
            if used == size:
                return source.view(rows, length), None
            target = torch.empty_like(source, memory_format=torch.contiguous_format)
            self.copies.append((source, target))
            return target.view(rows, length), (source, target)

        self.closing, _ = laid_out(ring.closing)
        self.reward, self.reward_copy = laid_out(ring.reward)
        self.mask, _ = laid_out(ring.mask)
        self.from_keys = {row: laid_out(buffer)[0] for row, buffer in ring.from_keys.items()}
        self.done = None if ring.done is None else ring.done[:, :used]
        sums = self.sums = ring.sums[..., : length + 1]
        self.cum_reward = sums[0, :, 1:]
        self.cum_length = sums[1, :, 1:]
        self.carry = sums[:, :, 0]
        self.sums_end = sums[..., length]
        self.sums_tail = sums[..., 1:]
        self.positions = ring.positions[:, : length + 1]
        self.positions_tail = self.positions[:, 1:]
        self.step_numbers = ring.step_numbers[:length]
        self.start = torch.empty_like(self.positions)
        self.start_indices = torch.empty_like(self.positions)
        self.start_index = self.start.expand(2, rows, length + 1)
        self.at_start = torch.empty_like(sums)
        self.at_end = self.at_start[..., length]
        self.at_head = self.at_start[..., :length]
        self.values = sums.new_empty((2, rows, length))
        traj = ring.traj
        if traj is not None:
            self.traj_first = traj[:, 0, 0]
            self.traj_last = traj[:, used - 1, -1]
            self.traj_next_first = traj[:, 1:used, 0]
            self.traj_prev_last = traj[:, : used - 1, -1]
