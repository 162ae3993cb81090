"""The episode kernel: episodes that close in collector batches, carried across batches.

Episode returns and lengths come either from the batch (``RewardSum`` /
``StepCounter`` entries read at closing steps) or from per-env running sums.
The running sums are computed here, as functions of the batches and of the
episodes in flight (:class:`EpisodeCarry`): batches are copied into an
:class:`EpisodeRing` by :func:`stage_batch` and summed, as one timeline per
env, by :func:`close_episodes`, which returns what to fold and updates the
carry. Everything works on ``[rows, steps]`` tensors (time last); batches
whose steps have several entries (agents, nested envs) are first laid out
with one row per env and entry by :func:`per_entry`. No function reads a
tensor value on the host off the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

__all__ = [
    "Closed",
    "CollectorPlan",
    "EpisodeCarry",
    "EpisodeRing",
    "PlainStage",
    "Timeline",
    "close_episodes",
    "close_interleaved",
    "entries_of",
    "flags",
    "new_ring",
    "per_entry",
    "plain_stage",
    "stage_batch",
]


class CollectorPlan:
    """Keys of a collector batch, resolved at the first batch.

    ``entries`` is the shape of the entries of one step (agents, nested
    envs) when the per-step values have several, else ``()``: each entry
    then has episodes of its own. ``reads`` are the keys a batch is read at,
    each once, with the argument that names it: ``(key, "truncated_key")``.
    """

    __slots__ = (
        "reward",
        "done",
        "closing",
        "mask",
        "episode_reward",
        "step_count",
        "traj_ids",
        "env_index",
        "running",
        "episode_sources",
        "entries",
        "reads",
    )

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields[name])


def per_entry(value: torch.Tensor, batch_dims: int, entries: tuple[int, ...]) -> torch.Tensor:
    """``[*B, T, *extra]`` -> ``[B * E, T]``: one row per env and entry, time last.

    ``extra`` is ``entries`` (possibly with a trailing 1), or one value per
    step, which is broadcast to every entry. Makes a copy.
    """
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
    """The shape of the entries of one step (agents, nested envs), ``()`` for one entry.

    Decided by the per-step values of the episodes (rewards, ``RewardSum``
    and ``StepCounter`` entries); with one entry, closing flags with several
    close the env's episode when any is set. Otherwise every key has one
    value per step (broadcast to the entries) or one per entry.
    """
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
    and what else the sums need); :func:`close_episodes` sums the
    used slots as one timeline per env. The buffers the sums work in are kept
    here too, sized for a full ring.

    ``host``: the batches are unmasked CPU tensors, read at once (no device to
    wait for): closed episodes and done steps are counted on the host per
    batch, and no done flags are kept.
    """

    __slots__ = (
        "key",
        "size",
        "used",
        "reward",
        "closing",
        "done",
        "done_index",
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
        "host",
        "closed",
        "dones",
        "plain",
        "base",
        "by_id",
        "entry_count",
    )

    def __init__(
        self,
        key: tuple[Any, ...],
        rows: int,
        steps: int,
        device: torch.device,
        *,
        reward: bool,
        done: int | None,
        mask: bool,
        traj_dtype: torch.dtype | None,
        from_keys: Sequence[int],
        entry_count: int = 1,
        alone: bool = False,
    ) -> None:
        self.key = key
        self.host = device.type == "cpu" and _CPU_SHORTCUTS and not mask
        # Padded batches with trajectory ids (split_trajs, trajs_per_batch): a row is a
        # trajectory, not an env, and rows of two batches do not correspond. Each batch is
        # summed on its own and its carries are matched by trajectory id (and entry).
        self.by_id = mask and traj_dtype is not None
        self.entry_count = entry_count
        if self.by_id or alone:  # ``alone``: the caller sums every batch on its own
            size = self.size = 1
        else:
            size = self.size = max(1, min(_RING_BATCHES, _RING_STEPS // max(1, rows * steps)))
        self.used = 0
        f64, shape = torch.float64, (rows, size, steps)
        self.reward = torch.zeros(shape, dtype=f64, device=device) if reward else None
        self.closing = torch.zeros(shape, dtype=torch.bool, device=device)
        # Where done is among the closing flags, when its steps are counted apart from them.
        self.done_index = done
        self.done = (
            torch.zeros(shape, dtype=torch.bool, device=device)
            if done is not None and not self.host
            else None
        )
        self.mask = torch.zeros(shape, dtype=torch.bool, device=device) if mask else None
        self.traj = (
            None if traj_dtype is None else torch.zeros(shape, dtype=traj_dtype, device=device)
        )
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
        # Episodes closed in the used slots, when known on the host (CPU batches), else None;
        # done steps among them, on the host (when done is one of several closing keys).
        self.closed: int | None = self.empty_count()
        self.dones = 0
        # How plain batches are staged (see plain_stage): None until tried, False if not.
        self.plain: PlainStage | bool | None = None
        # Where the first slot's batch starts on the episode window's clocks (steps, cells),
        # when the set keeps one.
        self.base: tuple[int, int] | None = None

    def empty_count(self) -> int | None:
        return 0 if self.host else None

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
        "totals",
        "reward_totals",
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
        # Per env, the (reward, steps) totals of the timeline, when no episode closed in it.
        self.totals = sums.new_zeros((2, rows))
        self.totals[1] = length
        self.reward_totals = self.totals[0]
        traj = ring.traj
        if traj is not None:
            self.traj_first = traj[:, 0, 0]
            self.traj_last = traj[:, used - 1, -1]
            self.traj_next_first = traj[:, 1:used, 0]
            self.traj_prev_last = traj[:, : used - 1, -1]


class EpisodeCarry:
    """The episodes in flight at the end of the batches summed so far.

    ``neg``: ``[2, rows]`` float64, minus the (return, length) of each row's
    episode in flight; ``traj``: ``[rows]`` trajectory ids of the last step
    summed (when the batches have them). ``None`` before the first sum.
    For padded batches with trajectory ids (:attr:`EpisodeRing.by_id`),
    ``rows`` are the last batch's rows and ``traj`` the id of each row's
    last valid step, matched by id (not by row) in the next batch. For
    interleaved batches (:func:`close_interleaved`), ``neg`` is
    ``[2, rows * envs]`` (one column per entry row and env index, env
    fastest) and ``traj`` is ``None``.
    """

    __slots__ = ("neg", "traj")

    def __init__(self, neg: torch.Tensor | None = None, traj: torch.Tensor | None = None) -> None:
        self.neg = neg
        self.traj = traj


class Closed(NamedTuple):
    """What :func:`close_episodes` found in a ring's batches, to fold into reducers."""

    #: Per-step rewards of the summed steps (``[rows, steps]``), or ``None``.
    reward: torch.Tensor | None
    #: Which of those steps are valid (padded batches), or ``None``: all are.
    mask: torch.Tensor | None
    #: Number of done steps (a 0-d tensor, or an int counted on the host), when counted here.
    dones: torch.Tensor | int | None
    #: ``[K, rows, steps]`` episode quantities (returns, lengths) at ``closing`` steps, or
    #: ``None`` when no episode closed.
    values: torch.Tensor | None
    #: Where episodes closed (``[rows, steps]`` booleans), or ``None``.
    closing: torch.Tensor | None


def new_ring(
    plan: CollectorPlan,
    key: tuple[Any, ...],
    rows: int,
    steps: int,
    device: torch.device,
    *,
    masked: bool,
    traj_dtype: torch.dtype | None,
    alone: bool = False,
) -> EpisodeRing:
    """A ring for batches of ``rows`` x ``steps`` laid out as ``plan`` says (``alone``: of one)."""
    return EpisodeRing(
        key,
        rows,
        steps,
        device,
        reward=plan.reward is not None
        and any(row == 0 and k is None for row, k in plan.episode_sources),
        done=plan.closing.index(plan.done)
        if plan.done is not None and plan.closing != (plan.done,)
        else None,
        mask=masked,
        traj_dtype=traj_dtype,
        from_keys=[row for row, k in plan.episode_sources if k is not None],
        entry_count=math.prod(plan.entries),
        alone=alone,
    )


def stage_batch(
    ring: EpisodeRing,
    plan: CollectorPlan,
    get: Callable[[Any], torch.Tensor],
    closing_flags: Sequence[torch.Tensor],
    reward: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> torch.Tensor | int:
    """Copies one batch into the ring's next slot; returns its count of closing steps.

    ``get`` reads a batch entry as ``[rows, steps]`` (or in the batch's own
    layout, when it has that many values); ``closing_flags`` are the batch's
    closing flags as ``[rows, steps]`` booleans (already masked), in the order
    of ``plan.closing``. The count is an int when the ring counts on the host
    (``ring.host``; it is then added to ``ring.closed``), else a 0-d tensor.
    The caller advances ``ring.used``.
    """
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
    if ring.reward is not None:
        if ring.mask is not None:  # padding adds nothing to a return, whatever it holds
            reward = torch.where(mask.view(reward.shape), reward, 0)  # type: ignore[union-attr]
        ring.slot(ring.reward, "reward", reward.shape).copy_(reward)  # type: ignore[union-attr]
    if ring.mask is not None:
        ring.slot(ring.mask, "mask", mask.shape).copy_(mask)  # type: ignore[union-attr]
    if ring.traj is not None:
        traj = get(plan.traj_ids)
        ring.slot(ring.traj, "traj", traj.shape).copy_(traj)
    for row, key in plan.episode_sources:
        if key is not None:
            value = get(key)
            ring.slot(ring.from_keys[row], f"from_keys_{row}", value.shape).copy_(value)
    if not ring.host:
        return torch.count_nonzero(closing)
    return _count_on_host(ring, closing, closing_flags)


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

    A plain batch is a ``TensorDict`` (its nested entries too) of the batch
    size, entry shapes and closing-flag dtype (``bool``) of the batch the
    stage was made from, with one value per step and no mask, for a ring
    that counts on the host. :meth:`read` finds its entries with dictionary
    look-ups (what ``TensorDict.get`` does, without the per-call
    overhead), or returns ``None`` for any other batch; :meth:`stage` then
    does what :func:`stage_batch` does, with the slot views made once.
    """

    __slots__ = ("plan", "batch_size", "entries", "closing", "done_index", "direct_reward", "slots")

    def __init__(
        self, ring: EpisodeRing, plan: CollectorPlan, batch: TensorDict, direct_reward: bool
    ) -> None:
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
        self.direct_reward = direct_reward
        if direct_reward:
            keys.append(plan.reward)
        values = [batch.get(key) for key in keys]
        self.closing = len(plan.closing)
        self.done_index = ring.done_index
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
    direct_reward = ring.reward is None and plan.reward is not None
    stage = PlainStage(ring, plan, batch, direct_reward)
    return stage if stage.read(batch) is not None else False


def _carry_by_id(ring: EpisodeRing, line: Timeline, carry: EpisodeCarry) -> None:
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


def close_episodes(
    ring: EpisodeRing, carry: EpisodeCarry, sources: Sequence[tuple[int, Any]]
) -> Closed | None:
    """Sums the batches in the ring: the episodes that closed, and the new carry.

    The used slots form one timeline per env, across batches. Within it,
    the cumulative sums of (reward, 1) are prefixed with minus the carry
    of the episode in flight; an episode closing at step ``t`` is the
    cumulative sum at ``t`` minus the one at the previous segment start
    (found with a running maximum of closing positions), or minus the
    prefix when none. Between two batches whose trajectory ids do not
    continue, the episode in flight is dropped (a segment start that
    closes no episode); padded batches with ids are summed one at a time
    and their carries matched by id (:func:`_carry_by_id`). What follows the last closing is the new carry
    (``carry`` is updated in place). ``sources`` are the plan's
    ``episode_sources``. Returns ``None`` when the ring is empty.
    Off the CPU: tensor operations only, no host read, no data-dependent
    shape (on the CPU, see ``_CPU_SHORTCUTS``).
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
        _carry_by_id(ring, line, carry)
    elif neg_carry is None or neg_carry.shape != (2, rows):
        line.carry.zero_()
    else:
        if neg_carry.device != device:
            neg_carry = neg_carry.to(device)
        previous = carry.traj
        if traj is not None and previous is not None and previous.shape == (rows,):
            if previous.device != device:
                previous = previous.to(device)
            continues = line.traj_first == previous
            torch.where(continues, neg_carry, ring.no_carry, out=line.carry)
        else:
            line.carry.copy_(neg_carry)
    cut = None
    if traj is not None and not ring.by_id:
        carry.traj = line.traj_last.clone()
        if used > 1:  # a trajectory that does not continue in the next batch is dropped
            cut = line.traj_next_first != line.traj_prev_last
            # (On the CPU, reading whether any was cut waits for no device.)
            # (count_nonzero: cheaper than any on the CPU.)
            if closed is not None and not int(torch.count_nonzero(cut)):
                cut = None
    if closed == 0 and cut is None:
        # CPU batches where no episode closed and every trajectory went on: nothing to
        # fold but the rewards; each env's carry grows by its totals (its reward sum, and
        # ``length`` steps).
        if line.reward is not None:
            if line.reward_copy is not None:
                line.reward_copy[1].copy_(line.reward_copy[0])
            torch.sum(line.reward, -1, out=line.reward_totals)
        carry.neg = torch.sub(line.carry, line.totals)
        return Closed(line.reward, None, dones, None, None)
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
    for row, key in sources:
        if key is not None:
            values[row].copy_(line.from_keys[row])
    if len(sources) == 1:
        row = sources[0][0]
        values = values[row : row + 1]
    return Closed(line.reward, mask, dones, values, closing)


def close_interleaved(
    carry: EpisodeCarry,
    env: torch.Tensor,
    closing: torch.Tensor,
    reward: torch.Tensor | None,
    mask: torch.Tensor | None,
    envs: int,
    from_keys: Sequence[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """Episodes of a batch of interleaved steps of several envs, carried per env index.

    ``env`` (``[steps]`` integers below ``envs``) says which env each step
    of the batch comes from (``AsyncBatchedCollector``'s ``env_index``);
    each env's steps are in time order. ``closing``, ``reward`` and ``mask``
    are ``[rows, steps]`` (``rows``: the entries of one step, ``1`` for
    one); ``closing`` is already masked. The steps are stably sorted by env,
    so every env's steps form one run: the running sums are those of
    :func:`close_episodes` with a segment start at each env's first step,
    where the env's carry (in ``carry.neg``, one column per entry row and
    env index) is added. ``from_keys`` are (row, ``[rows, steps]`` values)
    taken from batch keys instead of the sums. Returns the ``[2, rows,
    steps]`` float64 (return, length) of the episodes closing at each step,
    in the batch's order, and updates ``carry``. No host read, no
    data-dependent shape.
    """
    rows, steps = closing.shape
    device = closing.device
    f64 = torch.float64
    table = _interleaved_table(carry, rows, envs, device)
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


def _interleaved_table(
    carry: EpisodeCarry, rows: int, envs: int, device: torch.device
) -> torch.Tensor:
    """The per-env carry of :func:`close_interleaved` as ``[2, rows, envs]`` (a new tensor)."""
    table = torch.zeros((2, rows, envs), dtype=torch.float64, device=device)
    neg = carry.neg
    if neg is not None and carry.traj is None and neg.shape[-1] % rows == 0:
        known = min(envs, neg.shape[-1] // rows)
        table[..., :known] = neg.to(device).reshape(2, rows, -1)[..., :known].neg()
    return table
