"""Metric sets: what a :class:`~rl_observers.LoggerObserver` folds and logs.

A metric set has the event methods of an observer (``on_post_collect``,
``on_post_add``, ``on_post_extend``, ``on_post_sample``) and folds what it sees
into reducers (:mod:`rl_observers.reducers`), on the data's device and without
waiting for it. Besides the events it offers:

* :meth:`MetricSet.counters`: cumulative host-side counters (``frames``,
  ``batches``, ``episodes``, ``write_count``, ``sample_calls``, ...) for
  counter schedules such as ``Every.counter("frames", 10_000)``;
* :meth:`MetricSet.pull`: closes the current window in **one** device-to-host
  transfer and returns its partials (:class:`~rl_observers.reducers.Partial`,
  merged exactly across workers by the channel) and cumulative gauges
  (floats); a payload's logged names are the keys of its float entries and
  the keys of each partial's :meth:`~rl_observers.reducers.Partial.finalize`;
* :meth:`MetricSet.stats`: entries for the target's ``stats()``;
* :meth:`MetricSet.state_dict` / :meth:`MetricSet.load_state_dict`:
  cumulative counters and in-flight accumulators, so a resumed run neither
  double-counts nor loses an episode.

Configuration is validated at construction; keys are resolved at the first
batch, and a missing key raises a :class:`KeyError` naming the key and the
keys present (what happens next is the observer's ``on_error`` policy).

Counters that depend on tensor values (``episodes``, and ``frames`` of masked
``trajs_per_batch`` batches) are *observed, not exact*: on CPU they are read
at once; on CUDA the value is copied without blocking to pinned memory and
added at a later event, once its CUDA event has completed, so such a counter
may lag by a batch or so. They are exact again after every :meth:`pull`.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tensordict import is_tensor_collection, unravel_key
from torch.utils._pytree import tree_leaves

from .reducers import Count, Partial, ReducerBank

__all__ = ["CollectorBatchMetrics", "MetricSet", "SampleMetrics", "WriteMetrics"]

NestedKey = str | tuple[str, ...]

# Stamps for storages up to this many slots are allocated in one go; larger or
# unbounded storages grow on demand (which reads the largest index on the host,
# so it is only done for indices that live on the CPU).
_STAMPS_EAGER_LIMIT = 2**24
_STAMPS_MIN_ALLOC = 1024
# The stamps of up to this many samples (and this many sampled items) are kept and their
# ages folded together.
_AGE_SAMPLES = 16
_AGE_ENTRIES = 2**16


def _check_key(value: Any, what: str, owner: str) -> NestedKey | None:
    if value is None:
        return None
    if isinstance(value, str) or (
        isinstance(value, tuple) and value and all(isinstance(k, str) for k in value)
    ):
        return unravel_key(value)
    raise TypeError(
        f"{owner}: {what} must be a str, a non-empty tuple of str or None, got {value!r}."
    )


def _check_bool(value: Any, what: str, owner: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {what} must be a bool, got {value!r}.")
    return value


def _leaf_keys(td: Any) -> set[NestedKey]:
    return {unravel_key(k) for k in td.keys(include_nested=True, leaves_only=True)}


class _MissingKeyError(KeyError):
    """A :class:`KeyError` whose message prints as written (not as a repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _missing_key(owner: str, what: str, key: NestedKey, present: Iterable[NestedKey]) -> KeyError:
    shown = ", ".join(repr(k) for k in sorted(present, key=str)) or "none"
    return _MissingKeyError(f"{owner}: {what}={key!r} is not in the data; keys present: {shown}.")


class _ObservedCounters:
    """Host-side counters, some fed by device values without a sync.

    ``add`` takes a host number. ``add_observed`` takes a 1-D integer tensor
    (one entry per counter): on CPU it is read at once; on CUDA it is copied
    without blocking to pinned memory and added by a later :meth:`poll` once
    its event has completed; on other devices it is read at :meth:`drain`.
    """

    __slots__ = ("values", "_pending")

    def __init__(self, names: Sequence[str]) -> None:
        self.values: dict[str, int] = dict.fromkeys(names, 0)
        self._pending: deque[tuple[tuple[str, ...], torch.Tensor, Any]] = deque()

    def add(self, name: str, amount: int) -> None:
        self.values[name] += amount

    def add_observed(self, names: tuple[str, ...], amounts: torch.Tensor) -> None:
        device = amounts.device
        if device.type == "cpu":
            self._apply(names, amounts)
            return
        if device.type == "cuda":
            host = torch.empty(amounts.shape, dtype=amounts.dtype, pin_memory=True)
            host.copy_(amounts, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._pending.append((names, host, event))
        else:
            self._pending.append((names, amounts, None))
        self.poll()

    def _apply(self, names: tuple[str, ...], amounts: torch.Tensor) -> None:
        values = self.values
        if not amounts.ndim:
            values[names[0]] += int(amounts)
            return
        for name, amount in zip(names, amounts.tolist()):
            values[name] += int(amount)

    def poll(self) -> dict[str, int]:
        """Adds every pending amount whose copy has completed; never waits."""
        pending = self._pending
        while pending:
            names, host, event = pending[0]
            if event is None or not event.query():
                break
            pending.popleft()
            self._apply(names, host)
        return self.values

    def drain(self) -> dict[str, int]:
        """Adds every pending amount, waiting for copies still in flight."""
        pending = self._pending
        while pending:
            names, host, event = pending.popleft()
            if event is not None:
                event.synchronize()
            self._apply(names, host)
        return self.values

    def load(self, values: dict[str, Any]) -> None:
        self._pending.clear()
        for name in self.values:
            self.values[name] = int(values.get(name, 0))


class MetricSet:
    """Base class of metric sets.

    A metric set defines the ``on_<event>`` methods of the events it folds
    (listed in :attr:`events`) and the non-event methods below. Event methods
    and :meth:`pull` hold one lock, so events from a prefetch thread and a
    pull from another thread do not interleave. A metric set pickles (for
    workers and actors) with its state.

    Examples:
        >>> from rl_observers.metrics import MetricSet, WriteMetrics
        >>> isinstance(WriteMetrics(), MetricSet)
        True
        >>> WriteMetrics.events
        ('post_add', 'post_extend')
    """

    #: Events this set folds; the observer subscribes to these only.
    events: tuple[str, ...] = ()
    #: Gauges of :meth:`pull` that are not cumulative counters (across workers, the newest
    #: value is kept instead of the sum).
    latest_gauges: tuple[str, ...] = ()
    #: Attributes rebuilt on demand (scratch buffers), not pickled.
    _transient: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def counters(self) -> dict[str, float]:
        """Cumulative host counters, read without a device sync."""
        raise NotImplementedError

    def pull(self) -> dict[str, float | Partial]:
        """Closes the window: window partials and cumulative gauges, one transfer."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Entries this set contributes to its target's ``stats()``. Defaults to none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counters and in-flight accumulators."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""
        raise NotImplementedError

    def _drain(self) -> None:
        counters = getattr(self, "_counters", None)
        if counters is not None:
            counters.drain()

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            self._drain()  # CUDA events do not pickle; pending amounts are applied first
            state = self.__dict__.copy()
        del state["_lock"]
        for name in self._transient:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()


class _CollectorPlan:
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


def _flags(value: torch.Tensor, rows: int, steps: int) -> torch.Tensor:
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


class _EpisodeRing:
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
        self._timelines: dict[int, _Timeline] = {}
        # Episodes closed in the used slots, when known on the host (CPU batches), else None.
        self.closed: int | None = self.empty_count()

    def empty_count(self) -> int | None:
        return 0 if self.closing.device.type == "cpu" and _CPU_SHORTCUTS else None

    def timeline(self, used: int) -> _Timeline:
        """The views and buffers a flush of ``used`` slots works with (made once per ``used``)."""
        timeline = self._timelines.get(used)
        if timeline is None:
            if len(self._timelines) >= 4:  # flushes come at a few fill levels at most
                self._timelines.pop(next(iter(self._timelines)))
            timeline = self._timelines[used] = _Timeline(self, used)
        return timeline

    def slot(self, buffer: torch.Tensor, name: str, shape: torch.Size) -> torch.Tensor:
        """The current slot of ``buffer`` viewed with a batch entry's ``shape`` (cached)."""
        key = (name, self.used, shape)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = buffer[:, self.used].view(shape)
        return view


class _Timeline:
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

    def __init__(self, ring: _EpisodeRing, used: int) -> None:
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


class CollectorBatchMetrics(MetricSet):
    """Reward, done and episode metrics of collector batches.

    Folds ``post_collect`` batches: TensorDicts of shape ``[T]``, or
    ``[*B, T]`` for batched environments (``SerialEnv``, ``ParallelEnv``, an
    env with ``batch_size=[n]``): time is the last batch dimension. Padded
    ``trajs_per_batch`` batches are supported: steps where ``mask_key`` is
    false count nowhere.

    An episode closes at a step where ``done``, ``terminated`` **or**
    ``truncated`` is set, so a time-limit reset never leaks a return into the
    next episode. Its return and length are taken from ``episode_reward_key``
    (:class:`~torchrl.envs.RewardSum`) and ``step_count_key``
    (:class:`~torchrl.envs.StepCounter`) at that step when the batch has them;
    otherwise from per-env running sums carried across batches (cumulative
    sums over the batches' steps plus the carry: vectorised, no loop over
    time, no sync; the batches are copied into a ring and summed 16 at a
    time, or when the window closes). Either way an episode spanning several
    batches is counted once,
    in the window where it ends, with its full return. When the batch has
    ``traj_ids_key``, a carry whose trajectory id does not continue in the
    next batch (``reset_at_each_iter``, a ``trajs_per_batch`` row) is
    dropped, never added to another episode. Limits of the running sums: an
    episode already under way when the set saw its first batch is counted
    from that batch on; ``split_trajs=True`` batches need ``RewardSum`` /
    ``StepCounter`` for episodes spanning batches.

    Metric names (what :meth:`pull` yields once finalized):

    ========================  ========  ==================================================
    name                      kind      meaning
    ========================  ========  ==================================================
    ``frames``                gauge     cumulative valid steps (``numel``, or mask sum)
    ``batches``               gauge     cumulative batches
    ``episodes_total``        gauge     cumulative completed episodes
    ``reward_mean``           window    mean of per-step rewards (every reward entry)
    ``reward_std``            window    population std of per-step rewards
    ``reward_min``            window    minimum per-step reward
    ``reward_max``            window    maximum per-step reward
    ``dones``                 window    steps with ``done_key`` set
    ``episodes``              window    episodes completed in the window
    ``episode_return_mean``   window    mean return of the episodes completed
    ``episode_return_std``    window    population std of those returns
    ``episode_return_min``    window    minimum of those returns
    ``episode_return_max``    window    maximum of those returns
    ``episode_length_mean``   window    mean length (steps) of the episodes completed
    ``episode_length_min``    window    minimum of those lengths
    ``episode_length_max``    window    maximum of those lengths
    ========================  ========  ==================================================

    A window with no reward (or no completed episode) omits the ``*_mean``,
    ``*_std``, ``*_min``, ``*_max`` entries; counts are then ``0``.
    :meth:`counters` gives ``frames``, ``batches`` and ``episodes``
    (cumulative; ``episodes`` is observed, not exact, on CUDA).

    Keyword Args:
        reward_key (NestedKey, optional): per-step reward. Required in the
            batch unless ``None`` (no reward metrics). Defaults to
            ``("next", "reward")``.
        done_key (NestedKey, optional): done flags. Required in the batch
            unless ``None``. Defaults to ``("next", "done")``.
        terminated_key (NestedKey, optional): also closes episodes, when
            present. Defaults to ``("next", "terminated")``.
        truncated_key (NestedKey, optional): also closes episodes, when
            present. Defaults to ``("next", "truncated")``.
        episode_return (bool, optional): emit ``episode_return_*``.
            Defaults to ``True``.
        episode_length (bool, optional): emit ``episode_length_*``.
            Defaults to ``True``.
        episode_reward_key (NestedKey, optional): cumulative episode reward,
            used at closing steps when present. Defaults to
            ``("next", "episode_reward")``.
        step_count_key (NestedKey, optional): steps since reset, used at
            closing steps when present. Defaults to ``("next", "step_count")``.
        mask_key (NestedKey, optional): valid-step mask of padded batches,
            used when present. Defaults to ``("collector", "mask")``.
        traj_ids_key (NestedKey, optional): trajectory ids, used when present
            to drop carries that do not continue. Defaults to
            ``("collector", "traj_ids")``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rl_observers.metrics import CollectorBatchMetrics
        >>> metrics = CollectorBatchMetrics()
        >>> def batch(rewards, dones):
        ...     n = len(rewards)
        ...     return TensorDict(
        ...         {"next": {"reward": torch.tensor(rewards).unsqueeze(-1),
        ...                   "done": torch.tensor(dones).unsqueeze(-1)}},
        ...         batch_size=[n],
        ...     )
        >>> metrics.on_post_collect(None, batch([1.0, 1.0, 1.0], [False, True, False]))
        >>> metrics.on_post_collect(None, batch([2.0, 2.0], [False, True]))  # spans 2 batches
        >>> metrics.counters()
        {'frames': 5, 'batches': 2, 'episodes': 2}
        >>> payload = metrics.pull()
        >>> payload["frames"], payload["episodes"].finalize()
        (5.0, {'episodes': 2.0})
        >>> payload["episode_return"].finalize()
        {'episode_return_mean': 3.5, 'episode_return_std': 1.5, 'episode_return_min': 2.0, 'episode_return_max': 5.0}
    """

    events = ("post_collect",)
    _transient = ("_ring", "_stacked")

    def __init__(
        self,
        *,
        reward_key: NestedKey | None = ("next", "reward"),
        done_key: NestedKey | None = ("next", "done"),
        terminated_key: NestedKey | None = ("next", "terminated"),
        truncated_key: NestedKey | None = ("next", "truncated"),
        episode_return: bool = True,
        episode_length: bool = True,
        episode_reward_key: NestedKey | None = ("next", "episode_reward"),
        step_count_key: NestedKey | None = ("next", "step_count"),
        mask_key: NestedKey | None = ("collector", "mask"),
        traj_ids_key: NestedKey | None = ("collector", "traj_ids"),
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.reward_key = _check_key(reward_key, "reward_key", owner)
        self.done_key = _check_key(done_key, "done_key", owner)
        self.terminated_key = _check_key(terminated_key, "terminated_key", owner)
        self.truncated_key = _check_key(truncated_key, "truncated_key", owner)
        self.episode_return = _check_bool(episode_return, "episode_return", owner)
        self.episode_length = _check_bool(episode_length, "episode_length", owner)
        self.episode_reward_key = _check_key(episode_reward_key, "episode_reward_key", owner)
        self.step_count_key = _check_key(step_count_key, "step_count_key", owner)
        self.mask_key = _check_key(mask_key, "mask_key", owner)
        self.traj_ids_key = _check_key(traj_ids_key, "traj_ids_key", owner)
        closing = (self.done_key, self.terminated_key, self.truncated_key)
        if (episode_return or episode_length) and all(k is None for k in closing):
            raise ValueError(
                f"{owner}: episode metrics need at least one of done_key, terminated_key or "
                f"truncated_key, got None for all three."
            )
        if episode_return and self.reward_key is None and self.episode_reward_key is None:
            raise ValueError(
                f"{owner}: episode_return=True needs reward_key or episode_reward_key, "
                f"got None for both."
            )

        bank = self._bank = ReducerBank()
        self._reward = bank.moments("reward") if self.reward_key is not None else None
        self._dones = bank.count("dones") if self.done_key is not None else None
        self._episodes = bank.count("episodes") if any(k is not None for k in closing) else None
        # Returns and lengths share their mask (the closing steps): folded together.
        specs = []
        if episode_return:
            specs.append(("episode_return", ("mean", "std", "min", "max")))
        if episode_length:
            specs.append(("episode_length", ("mean", "min", "max")))
        self._episode = bank.moments_group(specs) if specs else None
        self._counters = _ObservedCounters(("frames", "batches", "episodes"))
        self._plan: _CollectorPlan | None = None
        # In-flight episodes: [2, envs] float64, minus the (return, length) so far, and
        # [envs] trajectory ids.
        self._neg_carry: torch.Tensor | None = None
        self._carry_traj: torch.Tensor | None = None
        self._ring: _EpisodeRing | None = None
        self._stacked: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(reward_key={self.reward_key!r}, done_key={self.done_key!r}, "
            f"episode_return={self.episode_return}, episode_length={self.episode_length})"
        )

    # -- key resolution -------------------------------------------------------------

    def _resolve(self, batch: Any) -> _CollectorPlan:
        owner = type(self).__name__
        if not is_tensor_collection(batch):
            raise TypeError(f"{owner} expects TensorDict batches, got {type(batch).__name__}.")
        if not batch.batch_dims:
            raise ValueError(
                f"{owner} expects batches with a time dimension (batch_size [T] or [*B, T]), "
                f"got batch_size={list(batch.batch_size)}."
            )
        present = _leaf_keys(batch)

        def required(key: NestedKey | None, what: str) -> NestedKey | None:
            if key is not None and key not in present:
                raise _missing_key(owner, what, key, present)
            return key

        def optional(key: NestedKey | None) -> NestedKey | None:
            return key if key is not None and key in present else None

        reward = required(self.reward_key, "reward_key")
        done = required(self.done_key, "done_key")
        closing = tuple(
            k for k in (done, optional(self.terminated_key), optional(self.truncated_key)) if k
        )
        if not closing and self._episodes is not None:
            key = self.terminated_key or self.truncated_key
            raise _missing_key(owner, "terminated_key/truncated_key", key, present)
        episode_reward = optional(self.episode_reward_key) if self.episode_return else None
        step_count = optional(self.step_count_key) if self.episode_length else None
        running = (self.episode_return and episode_reward is None) or (
            self.episode_length and step_count is None
        )
        if self.episode_return and episode_reward is None and reward is None:
            raise _missing_key(owner, "episode_reward_key", self.episode_reward_key, present)
        per_step = [(episode_reward, "episode_reward_key"), (step_count, "step_count_key")]
        if self.episode_return and episode_reward is None:
            per_step.append((reward, "reward_key"))
        for key, what in per_step:
            if key is None:
                continue
            extra = batch.get(key).shape[batch.batch_dims :]
            if math.prod(extra) != 1:
                raise ValueError(
                    f"{owner}: episode metrics need one {what} value per step, got {key!r} with "
                    f"shape {list(batch.get(key).shape)} for batch_size {list(batch.batch_size)}."
                )
        # Per quantity of the episode group: its row of the running sums (0: return,
        # 1: length) and the batch key it is read from at closing steps, if any.
        episode_sources = []
        if self.episode_return:
            episode_sources.append((0, episode_reward))
        if self.episode_length:
            episode_sources.append((1, step_count))
        return _CollectorPlan(
            reward=reward,
            done=done,
            closing=closing,
            mask=optional(self.mask_key),
            episode_reward=episode_reward,
            step_count=step_count,
            traj_ids=optional(self.traj_ids_key),
            running=running,
            episode_sources=tuple(episode_sources),
        )

    # -- events ---------------------------------------------------------------------

    def on_post_collect(self, source: Any, batch: Any) -> None:
        """Folds one collector batch (no host-device sync)."""
        with self._lock:
            plan = self._plan
            if plan is None:
                plan = self._plan = self._resolve(batch)
            self._fold(plan, batch)

    def _fold(self, plan: _CollectorPlan, batch: Any) -> None:
        batch_size = batch.batch_size
        if not len(batch_size):
            raise ValueError(
                f"{type(self).__name__} expects batches with a time dimension, got batch_size=[]."
            )
        steps = batch_size[-1]
        rows = math.prod(batch_size[:-1])
        get = batch.get
        counters = self._counters
        counts = counters.values
        counts["batches"] += 1
        mask = None
        if plan.mask is not None:
            mask = _flags(get(plan.mask), rows, steps)

        reward = get(plan.reward) if plan.reward is not None else None
        if not plan.closing:
            if reward is not None:
                self._fold_reward(reward, mask, batch_size)
            if mask is None:
                counts["frames"] += batch_size.numel()
            else:
                counters.add_observed(("frames",), torch.count_nonzero(mask).reshape(1))
            return

        if plan.running:
            self._fold_into_ring(plan, batch, rows, steps, mask, reward)
            return
        if reward is not None:
            self._fold_reward(reward, mask, batch_size)
        closing = None
        for key in plan.closing:
            value = _flags(get(key), rows, steps)
            if mask is not None:
                value = value & mask
            if key == plan.done:
                self._dones.fold_true(value)
            closing = value if closing is None else closing | value
        n_closed = torch.count_nonzero(closing)
        self._count_frames_and_episodes(n_closed, mask, batch_size)
        self._episodes.add(n_closed)
        if self._episode is not None:
            # Read at the closing steps, stacked straight into float64 (exact step counts
            # whatever the reward's dtype).
            sources = plan.episode_sources
            values = self._stacked
            shape = (len(sources), rows, steps)
            if values is None or values.shape != shape or values.device != closing.device:
                values = self._stacked = closing.new_empty(shape, dtype=torch.float64)
            torch.stack([get(key).reshape(rows, steps) for _, key in sources], out=values)
            self._episode.fold(values, closing)

    def _fold_into_ring(
        self,
        plan: _CollectorPlan,
        batch: Any,
        rows: int,
        steps: int,
        mask: torch.Tensor | None,
        reward: torch.Tensor | None,
    ) -> None:
        """Copies what the episode sums need into the ring's next slot (a few copies)."""
        get = batch.get
        batch_size = batch.batch_size
        cells = rows * steps
        flags = []
        for key in plan.closing:
            value = get(key)
            if value.dtype is not torch.bool or value.numel() != cells:
                value = _flags(value, rows, steps)
            if mask is not None:
                value = value & mask.view(value.shape)
            flags.append(value)
        ring = self._ring_for(plan, batch, rows, steps, mask, flags[0].device)
        if reward is not None and ring.reward is None:
            self._fold_reward(reward, mask, batch_size)  # else folded from the ring
        if ring.done is not None:
            done = flags[plan.closing.index(plan.done)]
            ring.slot(ring.done, "done", done.shape).copy_(done)
        shape = flags[0].shape
        closing = ring.slot(ring.closing, "closing", shape)
        if len(flags) == 1:
            closing.copy_(flags[0])
        else:
            torch.bitwise_or(flags[0], flags[1].reshape(shape), out=closing)
            for value in flags[2:]:
                closing |= value.reshape(shape)
        n_closed = torch.count_nonzero(closing)
        if ring.closed is not None and mask is None:  # CPU: read at once, no device to wait for
            closed = int(n_closed)
            ring.closed += closed
            self._counters.values["frames"] += batch_size.numel()
            self._counters.values["episodes"] += closed
        else:
            ring.closed = None
            self._count_frames_and_episodes(n_closed, mask, batch_size)
        if ring.reward is not None:
            ring.slot(ring.reward, "reward", reward.shape).copy_(reward)
        if ring.mask is not None:
            ring.slot(ring.mask, "mask", mask.shape).copy_(mask)
        if ring.traj is not None:
            traj = get(plan.traj_ids)
            ring.slot(ring.traj, "traj", traj.shape).copy_(traj)
        for row, key in plan.episode_sources:
            if key is not None:
                value = get(key)
                ring.slot(ring.from_keys[row], f"from_keys_{row}", value.shape).copy_(value)
        ring.used += 1
        if ring.used == ring.size:
            self._flush()

    def _count_frames_and_episodes(
        self, n_closed: torch.Tensor, mask: torch.Tensor | None, batch_size: torch.Size
    ) -> None:
        counters = self._counters
        if mask is None:
            counters.values["frames"] += batch_size.numel()
            counters.add_observed(("episodes",), n_closed)
        else:
            counters.add_observed(
                ("frames", "episodes"), torch.stack((torch.count_nonzero(mask), n_closed))
            )

    def _fold_reward(
        self, reward: torch.Tensor, mask: torch.Tensor | None, batch_size: torch.Size
    ) -> None:
        if mask is None:
            self._reward.fold(reward)
        else:
            extra = (1,) * (reward.ndim - len(batch_size))
            self._reward.fold(reward, mask.reshape(*batch_size, *extra))

    def _ring_for(
        self,
        plan: _CollectorPlan,
        batch: Any,
        rows: int,
        steps: int,
        mask: torch.Tensor | None,
        device: torch.device,
    ) -> _EpisodeRing:
        """The ring for batches of this shape (a batch of another shape flushes the ring)."""
        ring = self._ring
        key = (rows, steps, device, mask is None)
        if ring is not None and ring.key == key:
            return ring
        self._flush()
        traj_dtype = None if plan.traj_ids is None else batch.get(plan.traj_ids).dtype
        ring = self._ring = _EpisodeRing(
            key,
            rows,
            steps,
            device,
            reward=plan.reward is not None
            and self.episode_return
            and plan.episode_reward is None,
            done=plan.done is not None and plan.closing != (plan.done,),
            mask=mask is not None,
            traj_dtype=traj_dtype,
            from_keys=[row for row, key in plan.episode_sources if key is not None],
        )
        return ring

    def _drain(self) -> None:
        self._flush()
        super()._drain()

    def _flush(self) -> None:
        """Sums the batches in the ring: episodes that closed, and the new carry.

        The used slots form one timeline per env, across batches. Within it,
        the cumulative sums of (reward, 1) are prefixed with minus the carry
        of the episode in flight; an episode closing at step ``t`` is the
        cumulative sum at ``t`` minus the one at the previous segment start
        (found with a running maximum of closing positions), or minus the
        prefix when none. Between two batches whose trajectory ids do not
        continue, the episode in flight is dropped (a segment start that
        closes no episode). What follows the last closing is the new carry.
        Off the CPU: tensor operations only, no host read, no data-dependent
        shape (on the CPU, see ``_CPU_SHORTCUTS``).
        """
        ring = self._ring
        if ring is None or not ring.used:
            return
        used, ring.used = ring.used, 0
        closed, ring.closed = ring.closed, ring.empty_count()
        line = ring.timeline(used)
        rows = ring.closing.shape[0]
        device = ring.closing.device
        length = line.length
        # The window's episode count is the count of the episode moments (see pull); done
        # steps are among the closing ones, so when none closed there is none to count.
        if line.done is not None and closed != 0:
            self._dones.add(torch.count_nonzero(line.done))  # type: ignore[union-attr]
        # The carry column: minus the episode in flight, unless its trajectory does not continue.
        neg_carry = self._neg_carry
        traj = ring.traj
        if neg_carry is None or neg_carry.shape != (2, rows):
            line.carry.zero_()
        else:
            if neg_carry.device != device:
                neg_carry = neg_carry.to(device)
            previous = self._carry_traj
            if traj is not None and previous is not None and previous.shape == (rows,):
                if previous.device != device:
                    previous = previous.to(device)
                continues = line.traj_first == previous
                torch.where(continues, neg_carry, ring.no_carry, out=line.carry)
            else:
                line.carry.copy_(neg_carry)
        cut = None
        if traj is not None:
            self._carry_traj = line.traj_last.clone()
            if used > 1:  # a trajectory that does not continue in the next batch is dropped
                cut = line.traj_next_first != line.traj_prev_last
                # (On the CPU, reading whether any was cut waits for no device.)
                if closed is not None and not cut.any():
                    cut = None
        if closed == 0 and cut is None:
            # CPU batches where no episode closed and every trajectory went on: nothing to
            # fold but the rewards; each env's carry grows by its totals.
            neg_carry = line.carry.clone()
            neg_carry[1].sub_(length)
            if line.reward is not None:
                if line.reward_copy is not None:
                    line.reward_copy[1].copy_(line.reward_copy[0])
                self._reward.fold(line.reward)
                neg_carry[0].sub_(line.reward.sum(-1))
            self._neg_carry = neg_carry
            return
        for source, target in line.copies:  # the used slots as one timeline per env
            target.copy_(source)
        closing, mask = line.closing, line.mask
        if line.reward is not None:
            self._reward.fold(line.reward, mask)  # per-step rewards: their moments are folded here
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
        self._neg_carry = line.at_end - line.sums_end
        values = torch.sub(line.sums_tail, line.at_head, out=line.values)
        sources = self._plan.episode_sources  # type: ignore[union-attr]
        for row, key in sources:
            if key is not None:
                values[row].copy_(line.from_keys[row])
        if len(sources) == 1:
            row = sources[0][0]
            values = values[row : row + 1]
        self._episode.fold(values, closing)

    # -- host side ------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """``frames``, ``batches``, ``episodes`` (cumulative; never waits for the device)."""
        with self._lock:
            return dict(self._counters.poll())

    def pull(self) -> dict[str, float | Partial]:
        """Gauges ``frames``, ``batches``, ``episodes_total`` and the window's partials.

        Partials are keyed ``"reward"``, ``"dones"``, ``"episodes"``,
        ``"episode_return"`` and ``"episode_length"`` (those configured). One
        device-to-host transfer; resets the window, not the episodes in flight.
        """
        with self._lock:
            self._flush()
            partials = self._bank.pull()
            plan = self._plan
            if plan is not None and plan.running:
                # Episodes closed in the ring's batches are the count of their moments (and
                # the dones, when done is the only closing key).
                counted = Count("episodes", partials[self._episode.prefixes[0]].count)  # type: ignore[union-attr,attr-defined]
                partials["episodes"] = counted
                if plan.closing == (plan.done,):
                    partials["dones"] = Count("dones", counted.n)
            values = self._counters.drain()  # copies are complete after the transfer
            out: dict[str, float | Partial] = {
                "frames": float(values["frames"]),
                "batches": float(values["batches"]),
                "episodes_total": float(values["episodes"]),
            }
            out.update(partials)
            return out

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counters and the per-env episodes in flight."""
        with self._lock:
            self._flush()
            values = self._counters.drain()
            neg_carry = self._neg_carry
            return {
                "counters": dict(values),
                "carry": None if neg_carry is None else neg_carry.neg().T.contiguous(),
                "carry_traj_ids": None if self._carry_traj is None else self._carry_traj.clone(),
            }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores counters and episodes in flight (the window starts empty)."""
        with self._lock:
            carry = state_dict["carry"]
            if carry is not None and (carry.ndim != 2 or carry.shape[-1] != 2):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict expects a carry of shape [envs, 2], "
                    f"got {list(carry.shape)}."
                )
            self._counters.load(state_dict["counters"])
            self._ring = None  # batches not summed yet belong to the replaced state
            self._neg_carry = None if carry is None else carry.to(torch.float64).T.neg()
            traj = state_dict.get("carry_traj_ids")
            self._carry_traj = None if traj is None else traj.clone()
            self._bank.reset()


def _storage_of(source: Any) -> Any:
    return getattr(source, "_storage", None)


def _dim0_slots(index: Any, storage: Any, *, per_item: bool = False) -> torch.Tensor | None:
    """The dim-0 storage slots of a replay-buffer index, as a 1-D int64 tensor.

    ``index`` is what ``add``/``extend`` return or ``info["index"]``: an int, a
    tensor of slots, a ``[N, ndim]`` tensor of cells (multi-dim storages), or
    a tuple of per-dim tensors. With ``per_item``, a write's cells are reduced
    to one slot per item written (their dim-0 slot, repeated consecutively).
    """
    if index is None:
        return None
    if isinstance(index, tuple):
        if not index:
            return None
        index = index[0]
    if not isinstance(index, torch.Tensor):
        index = torch.as_tensor(index)
    elif index.ndim == 1 and index.dtype is torch.int64:
        return index  # slots already (a cell index has two dimensions)
    ndim = getattr(storage, "ndim", 1) or 1
    if ndim > 1 and index.ndim >= 2 and index.shape[-1] == ndim:
        index = index[..., 0]
        if per_item:
            try:
                cells = math.prod(storage.shape[1:])
            except (AttributeError, TypeError, RuntimeError):
                cells = 1
            if cells > 1 and index.numel() % cells == 0:
                index = index.reshape(-1, cells)[:, 0]
    return index.reshape(-1).to(torch.int64)


def _storage_device(storage: Any, default: torch.device) -> torch.device:
    device = getattr(storage, "device", None)
    if isinstance(device, (str, torch.device)) and device != "auto":
        return torch.device(device)
    return default


def _dim0_capacity(storage: Any) -> int | None:
    try:
        capacity = storage._max_size_along_dim0()
    except Exception:
        capacity = getattr(storage, "max_size", None)
    return capacity if isinstance(capacity, int) and capacity > 0 else None


def _leading_size(data: Any) -> int:
    if is_tensor_collection(data):
        return data.batch_size.numel()
    if isinstance(data, torch.Tensor):
        return data.shape[0] if data.ndim else 1
    if isinstance(data, list):
        return len(data)
    leaves = tree_leaves(data)
    first = leaves[0] if leaves else None
    if isinstance(first, torch.Tensor) and first.ndim:
        return first.shape[0]
    return 1


def _info_get(info: Any, *keys: str) -> Any:
    for key in keys:
        value = info.get(key, None)
        if value is not None:
            return value
    return None


class SampleMetrics(MetricSet):
    """What a replay buffer's samples look like: calls, sizes, weights, age.

    Folds ``post_sample`` events, and ``post_add`` / ``post_extend`` events to
    stamp storage slots for the age of sampled data.

    ================================  ========  =========================================
    name                              kind      meaning
    ================================  ========  =========================================
    ``sample_calls``                  gauge     cumulative ``sample`` calls
    ``samples_returned``              gauge     cumulative sampled items (index entries)
    ``batch_size``                    gauge     items in the last sample
    ``priority_weight_mean``          window    mean importance weight sampled
    ``priority_weight_min``           window    minimum importance weight
    ``priority_weight_max``           window    maximum importance weight
    ``sample_age_mean``               window    mean age of sampled items, in items written
    ``sample_age_min``                window    minimum age
    ``sample_age_max``                window    maximum age
    ================================  ========  =========================================

    Weights come from the sampler's ``info["priority_weight"]`` (or
    ``info["_weight"]``), when present. **Age** is the number of items written
    to the buffer after the sampled item: ``0`` for the newest item. Every
    write stamps its dim-0 slots with the running item count (a
    ``scatter_reduce`` on the index's device, so a write that wraps around
    the storage keeps the latest stamp), and a sample reads the stamps of its
    ``info["index"]``. torchrl's ``info["index_generation"]`` counts rewrites
    *per slot*, not writes to the buffer, so it cannot give an age and is not
    used. Items written before this set saw any write have no stamp and are
    left out of the age statistics; stamps are kept for storages whose
    capacity is known (up to 2**24 slots) or whose indices live on the CPU.
    Writes from other processes sharing a storage are not seen.

    :meth:`counters` and :meth:`stats` give ``sample_calls`` and
    ``samples_returned``.

    Keyword Args:
        priority_weight (bool, optional): emit ``priority_weight_*``.
            Defaults to ``True``.
        age (bool, optional): stamp writes and emit ``sample_age_*``.
            Defaults to ``True``.

    Examples:
        >>> import torch
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from rl_observers.metrics import SampleMetrics
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(4))
        >>> metrics = SampleMetrics()
        >>> for chunk in (torch.arange(3), torch.arange(3, 6)):  # 6 items, slots 0, 1 rewritten
        ...     metrics.on_post_extend(rb, chunk, rb.extend(chunk))
        >>> batch, info = rb.sample(3, return_info=True)
        >>> metrics.on_post_sample(rb, batch, info)
        >>> payload = metrics.pull()
        >>> payload["sample_calls"], payload["samples_returned"]
        (1.0, 3.0)
        >>> ages = (6 - 1 - batch).tolist()  # item k was the (k+1)-th written
        >>> payload["sample_age"].finalize()["sample_age_max"] == max(ages)
        True
    """

    events = ("post_add", "post_extend", "post_sample")
    #: Gauges that are not cumulative counters: merged across workers by keeping the newest.
    latest_gauges: tuple[str, ...] = ("batch_size",)
    _transient = ("_sampled",)

    def __init__(self, *, priority_weight: bool = True, age: bool = True) -> None:
        super().__init__()
        owner = type(self).__name__
        self.priority_weight = _check_bool(priority_weight, "priority_weight", owner)
        self.age = _check_bool(age, "age", owner)
        bank = self._bank = ReducerBank()
        self._weights = (
            bank.moments("priority_weight", stats=("mean", "min", "max"))
            if priority_weight
            else None
        )
        self._ages = bank.moments("sample_age", stats=("mean", "min", "max")) if age else None
        self._counters = _ObservedCounters(("sample_calls", "samples_returned"))
        self._batch_size = 0
        self._written = 0  # items written while observed: the stamp of the latest item
        self._stamps: torch.Tensor | None = None  # per dim-0 slot; 0 = never seen written
        self._stamps_fixed = False  # sized to the storage's capacity
        self._stamps_off = False
        # Stamps of the last samples and the item count at each (see _stage_ages).
        self._sampled: torch.Tensor | None = None
        self._sampled_written: list[int] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority_weight={self.priority_weight}, age={self.age})"

    # -- writes: stamps ------------------------------------------------------------

    def on_post_add(self, source: Any, data: Any, index: Any) -> None:
        """Stamps the slot written by ``add``."""
        if self._ages is not None:
            with self._lock:
                self._stamp(source, index)

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        """Stamps the slots written by ``extend``."""
        if self._ages is not None:
            with self._lock:
                self._stamp(source, index)

    def _stamp(self, source: Any, index: Any) -> None:
        storage = _storage_of(source)
        slots = _dim0_slots(index, storage, per_item=True)
        if slots is None or not slots.numel():
            return
        n = slots.numel()
        stamps = self._stamps_for(storage, slots)
        if stamps is not None and isinstance(index, int) and 0 <= index < stamps.numel():
            # ``add`` on a 1-D storage: a fill, not a host-to-device copy of the slot.
            stamps.narrow(0, index, 1).fill_(self._written + 1)
        elif stamps is not None:
            new = torch.arange(
                self._written + 1, self._written + n + 1, dtype=torch.int64, device=stamps.device
            )
            slots = slots.to(stamps.device, non_blocking=True)
            stamps.scatter_reduce_(0, slots, new, reduce="amax")
        self._written += n

    def _stamps_for(self, storage: Any, slots: torch.Tensor) -> torch.Tensor | None:
        if self._stamps_off:
            return None
        stamps = self._stamps
        capacity = _dim0_capacity(storage)
        if capacity is not None and capacity <= _STAMPS_EAGER_LIMIT:
            size = capacity
            self._stamps_fixed = True
        elif slots.device.type == "cpu":
            # Unbounded storage, CPU indices: reading the largest slot is no device sync.
            needed = int(slots.max()) + 1
            current = 0 if stamps is None else stamps.numel()
            size = current if needed <= current else max(needed, 2 * current, _STAMPS_MIN_ALLOC)
        else:
            warnings.warn(
                f"{type(self).__name__}: cannot size per-slot stamps for a storage of capacity "
                f"{capacity!r} without a device sync; sample_age is disabled.",
                stacklevel=4,
            )
            self._stamps_off = True
            return None
        if stamps is None or stamps.numel() < size:
            # On the storage's device, where sampled indices live.
            device = slots.device if stamps is None else stamps.device
            grown = torch.zeros(size, dtype=torch.int64, device=_storage_device(storage, device))
            if stamps is not None:
                grown[: stamps.numel()] = stamps.to(grown.device)
            stamps = self._stamps = grown
        return stamps

    # -- samples --------------------------------------------------------------------

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        """Counts the sample and folds its weights and ages (no host-device sync)."""
        with self._lock:
            index = None if info is None else _info_get(info, "index")
            slots = _dim0_slots(index, _storage_of(source))
            n = slots.numel() if slots is not None else _leading_size(batch)
            counters = self._counters
            counters.add("sample_calls", 1)
            counters.add("samples_returned", n)
            self._batch_size = n
            if info is None:
                return
            if self._weights is not None:
                weights = _info_get(info, "priority_weight", "_weight")
                if weights is not None:
                    self._weights.fold(torch.as_tensor(weights))
            stamps = self._stamps
            if self._ages is not None and stamps is not None and slots is not None and n:
                if slots.device != stamps.device:
                    slots = slots.to(stamps.device)
                if self._stamps_fixed:  # sized to the storage: every sampled slot is inside
                    self._stage_ages(stamps, slots)
                else:
                    size = stamps.numel()
                    stamp = stamps.index_select(0, slots.clamp(0, size - 1))
                    valid = (stamp > 0) & (slots < size)
                    self._ages.fold(self._written - stamp, valid)

    def _stage_ages(self, stamps: torch.Tensor, slots: torch.Tensor) -> None:
        """Keeps the stamps of a sample (one gather) until _AGE_SAMPLES samples of its size."""
        sampled = self._sampled
        n = slots.numel()
        if sampled is None or sampled.shape[1] != n or sampled.device != stamps.device:
            self._fold_ages()
            rows = max(1, min(_AGE_SAMPLES, _AGE_ENTRIES // n))
            sampled = self._sampled = stamps.new_empty((rows, n))
        written = self._sampled_written
        torch.index_select(stamps, 0, slots, out=sampled[len(written)])
        written.append(self._written)
        if len(written) == sampled.shape[0]:
            self._fold_ages()

    def _fold_ages(self) -> None:
        """Folds the ages of the staged samples: items written since each sampled item."""
        written = self._sampled_written
        if not written:
            return
        stamp = self._sampled[: len(written)]  # type: ignore[index]
        counts = torch.tensor(written, dtype=torch.int64)
        device = stamp.device
        if device.type == "cuda":  # pinned and asynchronous: no wait for the device
            counts = counts.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            counts = counts.to(device, non_blocking=True)
        self._sampled_written = []
        # A stamp of 0: written before this set saw any write, no age.
        self._ages.fold(counts.unsqueeze(1) - stamp, stamp > 0)  # type: ignore[union-attr]

    # -- host side ------------------------------------------------------------------

    def _drain(self) -> None:
        self._fold_ages()
        super()._drain()

    def counters(self) -> dict[str, float]:
        """``sample_calls`` and ``samples_returned`` (cumulative)."""
        with self._lock:
            return dict(self._counters.poll())

    def stats(self) -> dict[str, float]:
        """``sample_calls`` and ``samples_returned``, for the target's ``stats()``."""
        return self.counters()

    def pull(self) -> dict[str, float | Partial]:
        """Gauges ``sample_calls``, ``samples_returned``, ``batch_size``; partials
        ``"priority_weight"`` and ``"sample_age"`` (those configured)."""
        with self._lock:
            self._fold_ages()
            partials = self._bank.pull()
            values = self._counters.drain()
            out: dict[str, float | Partial] = {
                "sample_calls": float(values["sample_calls"]),
                "samples_returned": float(values["samples_returned"]),
                "batch_size": float(self._batch_size),
            }
            out.update(partials)
            return out

    def state_dict(self) -> dict[str, Any]:
        """Counters, the running item count and the per-slot stamps."""
        with self._lock:
            self._fold_ages()
            return {
                "counters": dict(self._counters.drain()),
                "batch_size": self._batch_size,
                "written": self._written,
                "stamps": None if self._stamps is None else self._stamps.clone(),
                "stamps_fixed": self._stamps_fixed,
            }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (the window starts empty)."""
        with self._lock:
            self._counters.load(state_dict["counters"])
            self._batch_size = int(state_dict.get("batch_size", 0))
            self._written = int(state_dict["written"])
            stamps = state_dict.get("stamps")
            self._stamps = None if stamps is None else stamps.clone()
            self._stamps_fixed = bool(state_dict.get("stamps_fixed", False))
            self._sampled, self._sampled_written = None, []
            self._bank.reset()


class WriteMetrics(MetricSet):
    """What is written to a replay buffer: calls, items, rewards.

    Folds ``post_add`` and ``post_extend`` events.

    =========================  ========  ==============================================
    name                       kind      meaning
    =========================  ========  ==============================================
    ``writes``                 gauge     cumulative ``add`` / ``extend`` calls
    ``items_written``          gauge     cumulative items written (torchrl's write count)
    ``reward_mean``            window    mean reward of the written data
    ``reward_std``             window    population std of those rewards
    ``reward_min``             window    minimum of those rewards
    ``reward_max``             window    maximum of those rewards
    =========================  ========  ==============================================

    Items are counted like torchrl's ``write_count``: one per dim-0 slot
    written. :meth:`counters` gives ``write_count`` (= ``items_written``, as
    observed), ``writes`` and ``items_written``; :meth:`stats` gives
    ``writes``, ``items_written`` and ``seconds_since_last_write``.

    Keyword Args:
        reward_key (NestedKey, optional): reward entry of the written
            TensorDicts; required in the data when given. Defaults to
            ``None`` (no reward metrics).
        mask_key (NestedKey, optional): valid-step mask, used when present
            (padded trajectories). Defaults to ``("collector", "mask")``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> from rl_observers.metrics import WriteMetrics
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
        >>> metrics = WriteMetrics(reward_key=("next", "reward"))
        >>> data = TensorDict({"next": {"reward": torch.tensor([[1.0], [3.0]])}}, batch_size=[2])
        >>> metrics.on_post_extend(rb, data, rb.extend(data))
        >>> metrics.counters()
        {'write_count': 2, 'writes': 1, 'items_written': 2}
        >>> metrics.pull()["reward"].finalize()
        {'reward_mean': 2.0, 'reward_std': 1.0, 'reward_min': 1.0, 'reward_max': 3.0}
    """

    events = ("post_add", "post_extend")

    def __init__(
        self,
        *,
        reward_key: NestedKey | None = None,
        mask_key: NestedKey | None = ("collector", "mask"),
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.reward_key = _check_key(reward_key, "reward_key", owner)
        self.mask_key = _check_key(mask_key, "mask_key", owner)
        self._bank = ReducerBank()
        self._reward = self._bank.moments("reward") if self.reward_key is not None else None
        self._counters = _ObservedCounters(("writes", "items_written"))
        self._last_write: float | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reward_key={self.reward_key!r})"

    def on_post_add(self, source: Any, data: Any, index: Any) -> None:
        """Counts one item and folds its reward."""
        with self._lock:
            self._write(data, 1)

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        """Counts the items written and folds their rewards."""
        with self._lock:
            slots = _dim0_slots(index, _storage_of(source), per_item=True)
            self._write(data, _leading_size(data) if slots is None else slots.numel())

    def _write(self, data: Any, items: int) -> None:
        counters = self._counters
        counters.add("writes", 1)
        counters.add("items_written", items)
        self._last_write = time.monotonic()
        if self._reward is None:
            return
        owner = type(self).__name__
        if not is_tensor_collection(data):
            raise TypeError(
                f"{owner}: reward_key={self.reward_key!r} needs TensorDict data, "
                f"got {type(data).__name__}."
            )
        reward = data.get(self.reward_key, None)
        if reward is None:
            raise _missing_key(owner, "reward_key", self.reward_key, _leaf_keys(data))
        mask = data.get(self.mask_key, None) if self.mask_key is not None else None
        if mask is not None:
            mask = mask.reshape(*mask.shape, *(1,) * (reward.ndim - mask.ndim))
        self._reward.fold(reward, mask)

    def counters(self) -> dict[str, float]:
        """``write_count``, ``writes``, ``items_written`` (cumulative)."""
        values = self._counters.values
        return {
            "write_count": values["items_written"],
            "writes": values["writes"],
            "items_written": values["items_written"],
        }

    def stats(self) -> dict[str, float]:
        """``writes``, ``items_written`` and, after a write, ``seconds_since_last_write``."""
        values = self._counters.values
        out = {"writes": values["writes"], "items_written": values["items_written"]}
        if self._last_write is not None:
            out["seconds_since_last_write"] = time.monotonic() - self._last_write
        return out

    def pull(self) -> dict[str, float | Partial]:
        """Gauges ``writes``, ``items_written``; partial ``"reward"`` (when configured)."""
        with self._lock:
            partials = self._bank.pull()
            values = self._counters.values
            out: dict[str, float | Partial] = {
                "writes": float(values["writes"]),
                "items_written": float(values["items_written"]),
            }
            out.update(partials)
            return out

    def state_dict(self) -> dict[str, Any]:
        """The cumulative counters."""
        with self._lock:
            return {"counters": dict(self._counters.values)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the counters (the window starts empty)."""
        with self._lock:
            self._counters.load(state_dict["counters"])
            self._bank.reset()
