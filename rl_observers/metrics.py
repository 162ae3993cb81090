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

from .reducers import Partial, ReducerBank

__all__ = ["CollectorBatchMetrics", "MetricSet", "SampleMetrics", "WriteMetrics"]

NestedKey = str | tuple[str, ...]

# Stamps for storages up to this many slots are allocated in one go; larger or
# unbounded storages grow on demand (which reads the largest index on the host,
# so it is only done for indices that live on the CPU).
_STAMPS_EAGER_LIMIT = 2**24
_STAMPS_MIN_ALLOC = 1024


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
    otherwise from per-env running sums carried across batches (a segmented
    sum over each batch plus the carry: vectorised, no loop over time, no
    sync). Either way an episode spanning several batches is counted once,
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
        self._episode_return = (
            bank.moments("episode_return", stats=("mean", "std", "min", "max"))
            if episode_return
            else None
        )
        self._episode_length = (
            bank.moments("episode_length", stats=("mean", "min", "max")) if episode_length else None
        )
        self._counters = _ObservedCounters(("frames", "batches", "episodes"))
        self._plan: _CollectorPlan | None = None
        # In-flight episodes: [envs, 2] float64 (return, length) and [envs] trajectory ids.
        self._carry: torch.Tensor | None = None
        self._carry_traj: torch.Tensor | None = None

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
        return _CollectorPlan(
            reward=reward,
            done=done,
            closing=closing,
            mask=optional(self.mask_key),
            episode_reward=episode_reward,
            step_count=step_count,
            traj_ids=optional(self.traj_ids_key),
            running=running,
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
        counters = self._counters
        counters.add("batches", 1)
        mask = None
        if plan.mask is not None:
            mask = _flags(batch.get(plan.mask), rows, steps)

        if plan.reward is not None:
            reward = batch.get(plan.reward)
            reward_mask = None
            if mask is not None:
                reward_mask = mask.reshape(*batch_size, *(1,) * (reward.ndim - len(batch_size)))
            self._reward.fold(reward, reward_mask)

        if not plan.closing:
            if mask is None:
                counters.add("frames", batch_size.numel())
            else:
                counters.add_observed(("frames",), mask.sum().reshape(1))
            return

        closing = None
        for key in plan.closing:
            flags = _flags(batch.get(key), rows, steps)
            if mask is not None:
                flags = flags & mask
            if key == plan.done:
                self._dones.fold_true(flags)
            closing = flags if closing is None else closing | flags
        n_closed = closing.sum()
        self._episodes.add(n_closed)
        if mask is None:
            counters.add("frames", batch_size.numel())
            counters.add_observed(("episodes",), n_closed.reshape(1))
        else:
            counters.add_observed(("frames", "episodes"), torch.stack((mask.sum(), n_closed)))

        if plan.episode_reward is not None:
            returns = batch.get(plan.episode_reward).reshape(rows, steps)
            self._episode_return.fold(returns, closing)
        if plan.step_count is not None:
            lengths = batch.get(plan.step_count).reshape(rows, steps)
            self._episode_length.fold(lengths, closing)
        if plan.running:
            self._fold_running(plan, batch, closing, mask, rows, steps)

    def _fold_running(
        self,
        plan: _CollectorPlan,
        batch: Any,
        closing: torch.Tensor,
        mask: torch.Tensor | None,
        rows: int,
        steps: int,
    ) -> None:
        device = closing.device
        f64 = torch.float64
        # Per-step (reward, 1), zero on padded steps.
        if plan.reward is not None and self.episode_return and plan.episode_reward is None:
            reward = batch.get(plan.reward).reshape(rows, steps).to(device, f64)
        else:
            reward = torch.zeros((rows, steps), dtype=f64, device=device)
        if mask is None:
            ones = torch.ones((rows, steps), dtype=f64, device=device)
        else:
            reward = torch.where(mask, reward, 0.0)
            ones = mask.to(f64)
        # Segment of each step: closings strictly before it, in [0, steps - 1].
        closes = closing.to(torch.int64)
        segment = closes.cumsum(-1) - closes
        sums = torch.zeros((rows, steps + 1, 2), dtype=f64, device=device)
        sums.scatter_add_(
            1, segment.unsqueeze(-1).expand(rows, steps, 2), torch.stack((reward, ones), -1)
        )
        carry = self._carry
        if carry is None or carry.shape != (rows, 2):
            carry = torch.zeros((rows, 2), dtype=f64, device=device)
        else:
            carry = carry.to(device)
        if plan.traj_ids is not None:
            traj = batch.get(plan.traj_ids).reshape(rows, steps)
            previous = self._carry_traj
            if previous is not None and previous.shape == (rows,):
                continues = traj[:, 0] == previous.to(device)
                carry = torch.where(continues.unsqueeze(-1), carry, 0.0)
            self._carry_traj = traj[:, -1].clone()
        # The first segment of each row continues the episode in flight.
        sums[:, 0] += carry
        n_closed = closes.sum(-1)
        closed = torch.arange(steps + 1, device=device) < n_closed.unsqueeze(-1)
        if self._episode_return is not None and plan.episode_reward is None:
            self._episode_return.fold(sums[..., 0], closed)
        if self._episode_length is not None and plan.step_count is None:
            self._episode_length.fold(sums[..., 1], closed)
        # The segment after the last closing is the new carry.
        self._carry = sums.gather(1, n_closed.view(rows, 1, 1).expand(rows, 1, 2)).squeeze(1)

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
            partials = self._bank.pull()
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
            values = self._counters.drain()
            return {
                "counters": dict(values),
                "carry": None if self._carry is None else self._carry.clone(),
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
            self._carry = None if carry is None else carry.clone()
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
                    stamp = stamps.index_select(0, slots)
                    valid = stamp > 0
                else:
                    size = stamps.numel()
                    stamp = stamps.index_select(0, slots.clamp(0, size - 1))
                    valid = (stamp > 0) & (slots < size)
                self._ages.fold(self._written - stamp, valid)

    # -- host side ------------------------------------------------------------------

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
