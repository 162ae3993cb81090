"""Running episode sums of ``[*B, T]`` batches: staged into a ring, summed a ring at a time.

Returns and lengths with no ``RewardSum`` / ``StepCounter`` entries are sums
carried across batches; no tensor value is read on the host off the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from rl_observers.metrics.collector.plan import CollectorPlan, EpisodeCarry
from rl_observers.metrics.collector.reducers import BatchReducers
from rl_observers.stats.reducers import Transient

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []

# A ring holds up to this many batches (and steps): the running sums are paid once per ring.
# A window closes over at most ~4k staged steps (1000-step batches: -20 % per window; a
# 2k cap cost 7 % per batch).
_RING_BATCHES = 16
_RING_STEPS = 2**12
# A host ring that filled up with no episode closed is replaced by one this large: such a
# flush only moves the carries, ~100 us fixed (no-reset 1000-step batches: 64 -> 45 us each).
_RING_STEPS_OPEN = 2**14
# CPU batches are counted on the host (no sync); tests turn this off to run the device path.
_CPU_SHORTCUTS = True


class EpisodeRing:
    """Batches waiting for their running episode sums, laid out ``[rows, batches, steps]``, with the sums' work buffers.

    ``host``: unmasked CPU batches, whose closed episodes and done steps are
    counted on the host per batch.
    """


    def __init__(
        self,
        plan: CollectorPlan,
        key: tuple[Any, ...],
        rows: int,
        steps: int,
        *,
        traj_dtype: torch.dtype | None,
        alone: bool = False,
        opened: bool = False,
    ) -> None:
        self.key = key
        self._spec = (plan, key, rows, steps, traj_dtype)  # what opened() makes a ring from
        device, mask = key[2], not key[3]
        self.host = device.type == "cpu" and _CPU_SHORTCUTS and not mask
        # Padded batches with trajectory ids: a row is a trajectory, not an env; each batch is
        # summed on its own and its carries are matched by trajectory id (and entry).
        self.by_id = mask and traj_dtype is not None
        self.entry_count = math.prod(plan.entries)
        self.opens = False  # whether a full ring with no closed episode is replaced, opened
        if self.by_id or alone:  # ``alone``: the caller sums every batch on its own
            size = self.size = self.closing_size = 1
        else:
            per_batch = max(1, rows * steps)
            size = self.closing_size = max(1, min(_RING_BATCHES, _RING_STEPS // per_batch))
            self.size = size
            if self.host:
                open_size = max(1, min(_RING_BATCHES, _RING_STEPS_OPEN // per_batch))
                if opened:
                    size = self.size = open_size
                else:
                    self.opens = open_size > size
        self.used = 0
        f64, shape = torch.float64, (rows, size, steps)
        sources = self.sources = plan.episode_sources  # the rows close_episodes returns
        reward = plan.reward is not None and any(r == 0 and k is None for r, k in sources)
        self.reward = torch.zeros(shape, dtype=f64, device=device) if reward else None
        self.closing = torch.zeros(shape, dtype=torch.bool, device=device)
        # Where done is among the closing flags, when its steps are counted apart from them.
        done = plan.done is not None and plan.closing != (plan.done,)
        self.done_index = plan.closing.index(plan.done) if done else None
        self.done = torch.zeros(shape, dtype=torch.bool, device=device) if done and not self.host else None
        self.mask = torch.zeros(shape, dtype=torch.bool, device=device) if mask else None
        self.traj = (
            None if traj_dtype is None else torch.zeros(shape, dtype=traj_dtype, device=device)
        )
        # Per row of the sums (0: return, 1: length) read from a batch key instead.
        self.from_keys = {r: torch.zeros(shape, dtype=f64, device=device) for r, k in sources if k}
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
        # Episodes closed and done steps in the used slots, when counted on the host.
        self.closed: int | None = self.empty_count()
        self.dones = 0
        self.plain: PlainStage | bool | None = None  # None: not tried yet; False: not plain
        self.base: tuple[int, int] | None = None  # the episode window's clocks at slot 0

    def empty_count(self) -> int | None:
        return 0 if self.host else None

    def due(self) -> bool:
        """Whether to sum now: the ring is full, or an opened ring staged ``closing_size`` batches with an episode closed."""
        used = self.used
        return used == self.size or (used >= self.closing_size and self.closed != 0)

    def opened(self) -> EpisodeRing:
        """An empty ring for the same batches, holding up to ``_RING_STEPS_OPEN`` steps."""
        plan, key, rows, steps, traj_dtype = self._spec
        return EpisodeRing(plan, key, rows, steps, traj_dtype=traj_dtype, opened=True)

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

    ``copies`` lay a partly used ring out as ``[rows, used * steps]``.
    """


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
        # Per env, the (reward, steps) totals of the timeline, when no episode closed in it.
        self.totals = sums.new_zeros((2, rows))
        self.totals[1] = length
        self.reward_totals = self.totals[0]
        # The used slots as ``[rows, length]`` views; the flat sums the host path indexes.
        self.closing_slots = ring.closing[:, :used].view(rows, length)
        self.reward_slots = None if ring.reward is None else ring.reward[:, :used].view(rows, length)
        width = ring.sums.shape[-1]
        self.flat_sums = ring.sums.view(2, -1)
        self.row_starts = torch.arange(rows, device=ring.sums.device) * width
        self.width = width
        self.before_first = torch.full((1,), -1, dtype=torch.int64, device=ring.sums.device)
        traj = ring.traj
        if traj is not None:
            self.traj_first = traj[:, 0, 0]
            self.traj_last = traj[:, used - 1, -1]
            self.traj_next_first = traj[:, 1:used, 0]
            self.traj_prev_last = traj[:, : used - 1, -1]
            self.slot_ends_closing = ring.closing[:, : used - 1, -1]
            self.traj_joined = torch.empty_like(self.traj_next_first)


def carry_by_id(ring: EpisodeRing, line: Timeline, carry: EpisodeCarry) -> None:
    """Fills the carry column of a ring of one padded batch of split trajectories (a row is a trajectory, not an env).

    Each row takes the carry of the previous batch's row whose last trajectory id starts it, else zero. No host read.
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
    first, previous = line.traj_first.to(torch.int64), previous.to(device, torch.int64)
    entries = ring.entry_count
    if entries > 1:  # rows are (trajectory, entry), entry fastest: the entry is part of the key
        first = first * entries + torch.arange(rows, device=device) % entries
        previous = previous * entries + torch.arange(previous.shape[0], device=device) % entries
    match = (first.unsqueeze(1) == previous.unsqueeze(0)).to(torch.float64)
    line.carry.copy_(torch.mm(neg_carry.to(device), match.T))


class Closed(NamedTuple):
    """What :func:`close_episodes` found in a ring's batches, to fold into reducers."""

    #: Per-step rewards of the summed steps (``[rows, steps]``), or ``None``.
    reward: torch.Tensor | None
    #: Which of those steps are valid (padded batches), or ``None``: all are.
    mask: torch.Tensor | None
    #: Number of done steps (a 0-d tensor, or an int counted on the host), when counted here.
    dones: torch.Tensor | int | None
    #: ``[K, rows, steps]`` episode quantities (returns, lengths) at ``closing`` steps, or
    #: ``[K, episodes]``, one per closed episode, when ``closing`` is ``None``; or ``None``
    #: when no episode closed.
    values: torch.Tensor | None
    #: Where episodes closed (``[rows, steps]`` booleans), or ``None``: ``values`` are dense.
    closing: torch.Tensor | None


def _count_on_host(
    ring: EpisodeRing, closing: torch.Tensor, closing_flags: Sequence[torch.Tensor]
) -> int:
    """Adds a staged CPU batch's closing (and done) steps to the ring's host counts."""
    closed = int(torch.count_nonzero(closing))
    if closed:
        ring.closed += closed  # type: ignore[operator]
        if ring.done_index is not None:  # done steps are among the closing ones
            ring.dones += int(torch.count_nonzero(closing_flags[ring.done_index]))
    return closed


class PlainStage:
    """How a plain batch is staged into a ring: its entries and each slot's views, made once.

    A plain batch has the stage's batch size, entry shapes and ``bool`` flags,
    one value per step and no mask. :meth:`read` returns its entries (plain
    dict look-ups) or ``None`` for any other batch.
    """

    __slots__ = ("plan", "batch_size", "entries", "closing", "direct_reward", "slots")

    def __init__(self, ring: EpisodeRing, plan: CollectorPlan, batch: TensorDict) -> None:
        self.plan = plan
        self.batch_size = batch.batch_size
        # Closing flags first, then what is copied into the ring, then the reward folded
        # directly (when the ring keeps none).
        keys: list[Any] = list(plan.closing)
        buffers: list[torch.Tensor] = []
        for buffer, key in (
            (ring.reward, plan.reward),
            (ring.traj, plan.traj_ids),
            *((ring.from_keys[row], key) for row, key in plan.episode_sources if key is not None),
        ):
            if buffer is not None:
                keys.append(key)
                buffers.append(buffer)
        self.direct_reward = ring.reward is None and plan.reward is not None
        if self.direct_reward:
            keys.append(plan.reward)
        values = [batch.get(key) for key in keys]
        self.closing = len(plan.closing)
        self.entries = tuple(
            ((key,) if isinstance(key, str) else tuple(key), value.shape, i < self.closing)
            for i, (key, value) in enumerate(zip(keys, values))
        )
        shape = values[0].shape
        copied = values[self.closing : self.closing + len(buffers)]
        self.slots = [
            (
                ring.closing[:, used].view(shape),
                tuple(b[:, used].view(v.shape) for b, v in zip(buffers, copied)),
            )
            for used in range(ring.size)
        ]

    def read(self, batch: Any) -> list[torch.Tensor] | None:
        """The batch's entries, in the stage's order, or ``None`` when it is not plain."""
        if type(batch) is not TensorDict or batch.batch_size != self.batch_size:
            return None
        values = []
        for path, shape, is_flag in self.entries:
            value = batch
            for name in path:
                if type(value) is not TensorDict:
                    return None
                value = value._tensordict.get(name)
            if (
                not isinstance(value, torch.Tensor)
                or value.shape != shape
                or (is_flag and value.dtype is not torch.bool)
            ):
                return None
            values.append(value)
        return values

    def stage(self, ring: EpisodeRing, values: list[torch.Tensor]) -> int:
        """Copies ``values`` (from :meth:`read`) into the ring's next slot; its closing count."""
        closing, targets = self.slots[ring.used]
        flags = values[: self.closing]
        if len(flags) == 1:
            closing.copy_(flags[0])
        else:
            torch.bitwise_or(flags[0], flags[1], out=closing)
            for value in flags[2:]:
                closing |= value
        for target, value in zip(targets, values[self.closing :]):
            target.copy_(value)
        return _count_on_host(ring, closing, flags)


def plain_stage(ring: EpisodeRing, plan: CollectorPlan, batch: Any) -> PlainStage | bool:
    """A :class:`PlainStage` for ``ring`` when ``batch`` is plain, else ``False``."""
    if not ring.host or plan.entries or plan.mask is not None or type(batch) is not TensorDict:
        return False
    rows, _, steps = ring.closing.shape
    flags = [batch.get(key, None) for key in plan.closing]
    if not all(isinstance(f, torch.Tensor) for f in flags):  # a key missing: not plain
        return False
    shape = flags[0].shape
    if (
        any(f.dtype is not torch.bool or f.shape != shape for f in flags)
        or math.prod(shape) != rows * steps
    ):
        return False
    stage = PlainStage(ring, plan, batch)
    return stage if stage.read(batch) is not None else False


def close_episodes(ring: EpisodeRing, carry: EpisodeCarry, *, dense: bool = False) -> Closed | None:
    """Sums the batches in the ring: the episodes that closed, and the new carry (updated in place).

    Cumulative sums of (reward, 1) along each env's timeline, prefixed with
    minus the carry; an episode closing at ``t`` is the sum at ``t`` minus
    the one at its segment's start (a running maximum of closing positions).
    A break in trajectory ids drops the episode in flight. ``dense``: return
    ``[K, episodes]`` values with no flags (computed at the closing steps
    alone on the CPU). Returns ``None`` for an empty ring. No host read off
    the CPU.
    """
    if not ring.used:
        return None
    used, ring.used = ring.used, 0
    closed, ring.closed = ring.closed, ring.empty_count()
    host_dones, ring.dones = ring.dones, 0
    line = ring.timeline(used)
    rows = ring.closing.shape[0]
    device = ring.closing.device
    length = line.length
    # Done steps are among the closing ones, so when none closed there is none to count.
    dones: torch.Tensor | int | None = None
    if line.done is not None and closed != 0:
        dones = torch.count_nonzero(line.done)
    elif host_dones:
        dones = host_dones
    # The carry column: minus the episode in flight, unless its trajectory does not continue.
    neg_carry = carry.neg
    traj = ring.traj
    if ring.by_id:
        carry_by_id(ring, line, carry)
    elif neg_carry is None or neg_carry.shape != (2, rows):
        line.carry.zero_()
    else:
        neg_carry, previous = neg_carry.to(device), carry.traj
        if traj is not None and previous is not None and previous.shape == (rows,):
            continues = line.traj_first == previous.to(device)
            torch.where(continues, neg_carry, ring.no_carry, out=line.carry)
        else:
            line.carry.copy_(neg_carry)
    cut = None
    if traj is not None and not ring.by_id:
        carry.traj = line.traj_last.clone()
        if used > 1:  # a trajectory that does not continue in the next batch is dropped
            if closed is None:
                cut = line.traj_next_first != line.traj_prev_last
            else:
                # (On the CPU: no device to wait for.) A cut where an episode closes starts a
                # segment already; where the previous batch closed, its last id stands in.
                joined = line.traj_next_first
                if closed:
                    joined = torch.where(
                        line.slot_ends_closing, line.traj_prev_last, joined, out=line.traj_joined
                    )
                if not torch.equal(joined, line.traj_prev_last):
                    cut = torch.gt(line.traj_next_first != line.traj_prev_last, line.slot_ends_closing)
    if closed == 0 and cut is None:
        # CPU batches, no episode closed, no trajectory cut: each carry grows by its totals.
        if line.reward is not None:
            if line.reward_copy is not None:
                line.reward_copy[1].copy_(line.reward_copy[0])
            torch.sum(line.reward, -1, out=line.reward_totals)
        carry.neg = torch.sub(line.carry, line.totals)
        return Closed(line.reward, None, dones, None, None)
    if dense and closed and cut is None and not ring.from_keys:
        return _closed_on_host(ring, line, carry, dones)
    for source, target in line.copies:  # the used slots as one timeline per env
        target.copy_(source)
    closing, mask = line.closing, line.mask
    if line.reward is not None:
        torch.cumsum(line.reward, -1, out=line.cum_reward)
    if mask is not None:
        torch.cumsum(mask, -1, dtype=torch.float64, out=line.cum_length)
    starts = closing
    if cut is not None:
        breaks = ring.closing.new_zeros((rows, used, ring.closing.shape[-1]))
        breaks[:, :-1, -1] = cut
        starts = closing | breaks.view(rows, length)
    # positions[:, j]: 1 + the last segment end before step j (0: none), j in [0, length].
    torch.where(starts, line.step_numbers, ring.no_step, out=line.positions_tail)
    torch.cummax(line.positions, -1, out=(line.start, line.start_indices))
    torch.gather(line.sums, -1, line.start_index, out=line.at_start)
    carry.neg = line.at_end - line.sums_end
    if ring.by_id:
        # Each row's carry is keyed by the trajectory of its last valid step.
        last = line.cum_length[:, -1].sub(1).clamp_(min=0).to(torch.int64)
        carry.traj = traj[:, 0].gather(-1, last.unsqueeze(-1)).squeeze(-1)  # type: ignore[index]
    values = torch.sub(line.sums_tail, line.at_head, out=line.values)
    sources = ring.sources
    for row, key in sources:
        if key is not None:
            values[row].copy_(line.from_keys[row])
    if len(sources) == 1:
        row = sources[0][0]
        values = values[row : row + 1]
    return Closed(line.reward, mask, dones, values, closing)


def _closed_on_host(
    ring: EpisodeRing,
    line: Timeline,
    carry: EpisodeCarry,
    dones: torch.Tensor | int | None,
) -> Closed:
    """:func:`close_episodes` for CPU batches: each episode is the difference of two cumulative sums at its env's closing steps."""
    if line.reward_slots is not None:
        torch.cumsum(line.reward_slots, -1, out=line.cum_reward)
    flat = line.flat_sums
    rows, steps = torch.nonzero(line.closing_slots).unbind(1)  # episodes in row-major order
    row_starts = rows * line.width
    ends = torch.add(row_starts, steps).add_(1)  # each episode's cumulative sums, flat
    # The previous closing step, when it is in the same row (else the row's carry column).
    starts = torch.cat((line.before_first, ends[:-1]))
    torch.maximum(starts, row_starts, out=starts)
    values = torch.sub(flat.index_select(1, ends), flat.index_select(1, starts))
    # Each row's last closing step, flat (a row with none: its carry column), where its new
    # carry starts: the largest episode end of the row (no pass over the other steps).
    last = line.row_starts.scatter_reduce(0, rows, ends, "amax")
    carry.neg = torch.sub(flat.index_select(1, last), line.sums_end)
    if len(ring.sources) == 1:
        row = ring.sources[0][0]
        values = values[row : row + 1]
    return Closed(line.reward_slots, None, dones, values, None)


class RingFold(Transient):
    """The fold path of ``[*B, T]`` batches with running episode sums, through a ring (never pickled: summed first).

    ``reset_each_batch``: the bound collector resets its envs at each batch.
    """

    _transient = ("ring",)  # buffers, remade at the next batch (the set sums it first)

    def __init__(self, reducers: BatchReducers, carry: EpisodeCarry) -> None:
        self.reducers = reducers
        self.carry = carry
        self.window = reducers.window
        self.reward = reducers.reward
        self.counts = reducers.counts
        self.ring: EpisodeRing | None = None
        self.reset_each_batch = False

    def reset_at_each_batch(self, reset: bool) -> None:
        """Whether the bound collector resets its envs at each batch; the ring is summed first."""
        if reset != self.reset_each_batch:
            self.flush()
            self.ring = None
            self.reset_each_batch = reset

    def discard(self) -> None:
        """Drops the ring and what is staged in it (a state loaded over it, another layout)."""
        self.ring = None

    def fold(
        self,
        plan: CollectorPlan,
        batch: Any,
        read: dict[Any, torch.Tensor],
        get: Any,
        rows: int,
        steps: int,
        closing_flags: list[torch.Tensor],
        mask: torch.Tensor | None,
        episode_mask: torch.Tensor | None,
    ) -> None:
        """Copies what the episode sums need into the ring's next slot; ``get`` gives ``read``'s entries as ``[rows, steps]``."""
        batch_size = batch.batch_size
        ring = self.ring
        key = (rows, steps, closing_flags[0].device, mask is None)
        if ring is None or ring.key != key:
            self.flush()  # a batch of another shape: the ring's batches are summed first
            traj_dtype = None if plan.traj_ids is None else read[plan.traj_ids].dtype
            # Reset at each batch, and no trajectory ids to say so: each batch is summed
            # alone and its carries dropped (see flush).
            alone = self.reset_each_batch and traj_dtype is None
            ring = self.ring = EpisodeRing(plan, key, rows, steps, traj_dtype=traj_dtype, alone=alone)
        if not ring.used and self.window is not None:
            ring.base = self.window.clocks
        # Into the ring's next slot: what the sums read, each as [rows, steps].
        if ring.reward is not None:  # its moments are folded from the ring
            reward = get(plan.reward)
            if ring.mask is not None:  # padding adds nothing to a return, whatever it holds
                reward = torch.where(episode_mask.view(reward.shape), reward, 0)  # type: ignore[union-attr]
            ring.slot(ring.reward, "reward", reward.shape).copy_(reward)
        elif plan.reward is not None:
            self.reducers.fold_reward(read[plan.reward], mask, batch_size)
        if ring.done is not None:
            done = closing_flags[ring.done_index]  # type: ignore[index]
            ring.slot(ring.done, "done", done.shape).copy_(done)
        shape = closing_flags[0].shape
        closing = ring.slot(ring.closing, "closing", shape)
        if len(closing_flags) == 1:
            closing.copy_(closing_flags[0])
        else:
            torch.bitwise_or(closing_flags[0], closing_flags[1].reshape(shape), out=closing)
            for value in closing_flags[2:]:
                closing |= value.reshape(shape)
        if ring.mask is not None:
            ring.slot(ring.mask, "mask", episode_mask.shape).copy_(episode_mask)  # type: ignore[union-attr]
        if ring.traj is not None:
            traj = get(plan.traj_ids)
            ring.slot(ring.traj, "traj", traj.shape).copy_(traj)
        for row, key in plan.episode_sources:
            if key is not None:
                value = get(key)
                ring.slot(ring.from_keys[row], f"from_keys_{row}", value.shape).copy_(value)
        if ring.host:  # CPU, no mask: counted at once, no device to wait for
            counts = self.counts
            counts["frames"] += batch_size.numel()
            counts["episodes"] += _count_on_host(ring, closing, closing_flags)
        else:
            self.reducers.count_frames_and_episodes(torch.count_nonzero(closing), mask, batch_size)
        ring.used += 1
        if ring.due():
            self._flush_due()

    def fold_plain(
        self, ring: EpisodeRing, stage: PlainStage, values: list[torch.Tensor], batch_size: Any
    ) -> None:
        """What :meth:`fold` does with a plain batch, in fewer steps; also counts it and advances the episode window."""
        window = self.window
        if window is not None and not ring.used:
            ring.base = window.clocks
        closed = stage.stage(ring, values)
        if stage.direct_reward:
            self.reward.fold(values[-1])  # type: ignore[union-attr]
        counts = self.counts
        counts["batches"] += 1
        counts["frames"] += batch_size.numel()
        counts["episodes"] += closed
        ring.used += 1
        if ring.due():
            self._flush_due()
        if window is not None:
            window.advance(batch_size)

    def _flush_due(self) -> None:
        """Sums a due ring; one that filled up with no episode closed is replaced, opened."""
        ring = self.ring
        opens = ring.opens and ring.closed == 0  # type: ignore[union-attr]
        self.flush()
        if opens:
            self.ring = ring.opened()  # type: ignore[union-attr]

    def flush(self) -> None:
        """Sums the batches in the ring (:func:`close_episodes`) and folds what they closed."""
        ring = self.ring
        if ring is None:
            return
        if self.reset_each_batch and ring.traj is None and ring.used:
            self.carry.clear()  # the envs were reset: nothing goes on
        # (the episode window keeps where episodes closed)
        closed = close_episodes(ring, self.carry, dense=self.window is None)
        if closed is None:
            return
        reducers = self.reducers
        if closed.reward is not None:
            # A ring's steps, as many as it held: a different size at each fill level.
            reducers.reward.fold(closed.reward, closed.mask, staged=False)  # type: ignore[union-attr]
        if closed.dones is not None:
            reducers.dones.add(closed.dones)  # type: ignore[union-attr]
        if closed.values is not None:
            # Dense episodes are as many as closed: a different size at each flush.
            reducers.fold_episodes(
                closed.values, closed.closing, staged=closed.closing is not None, base=ring.base
            )
