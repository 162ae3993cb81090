"""CollectorBatchMetrics: reward, done and episode metrics of collector batches."""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import is_tensor_collection

from rl_observers.metrics.base import MetricSet
from rl_observers.metrics.episodes import CollectorPlan, EpisodeRing, flags
from rl_observers.metrics.keys import NestedKey, check_bool, check_key, leaf_keys, missing_key
from rl_observers.stats import Count, ObservedCounters, Partial, ReducerBank

__all__ = ["CollectorBatchMetrics"]


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
        self.reward_key = check_key(reward_key, "reward_key", owner)
        self.done_key = check_key(done_key, "done_key", owner)
        self.terminated_key = check_key(terminated_key, "terminated_key", owner)
        self.truncated_key = check_key(truncated_key, "truncated_key", owner)
        self.episode_return = check_bool(episode_return, "episode_return", owner)
        self.episode_length = check_bool(episode_length, "episode_length", owner)
        self.episode_reward_key = check_key(episode_reward_key, "episode_reward_key", owner)
        self.step_count_key = check_key(step_count_key, "step_count_key", owner)
        self.mask_key = check_key(mask_key, "mask_key", owner)
        self.traj_ids_key = check_key(traj_ids_key, "traj_ids_key", owner)
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
        self._counters = ObservedCounters(("frames", "batches", "episodes"))
        self._plan: CollectorPlan | None = None
        # In-flight episodes: [2, envs] float64, minus the (return, length) so far, and
        # [envs] trajectory ids.
        self._neg_carry: torch.Tensor | None = None
        self._carry_traj: torch.Tensor | None = None
        self._ring: EpisodeRing | None = None
        self._stacked: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(reward_key={self.reward_key!r}, done_key={self.done_key!r}, "
            f"episode_return={self.episode_return}, episode_length={self.episode_length})"
        )

    # -- key resolution -------------------------------------------------------------

    def _resolve(self, batch: Any) -> CollectorPlan:
        owner = type(self).__name__
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

        reward = required(self.reward_key, "reward_key")
        done = required(self.done_key, "done_key")
        closing = tuple(
            k for k in (done, optional(self.terminated_key), optional(self.truncated_key)) if k
        )
        if not closing and self._episodes is not None:
            key = self.terminated_key or self.truncated_key
            raise missing_key(owner, "terminated_key/truncated_key", key, present)
        episode_reward = optional(self.episode_reward_key) if self.episode_return else None
        step_count = optional(self.step_count_key) if self.episode_length else None
        running = (self.episode_return and episode_reward is None) or (
            self.episode_length and step_count is None
        )
        if self.episode_return and episode_reward is None and reward is None:
            raise missing_key(owner, "episode_reward_key", self.episode_reward_key, present)
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
        return CollectorPlan(
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

    def _fold(self, plan: CollectorPlan, batch: Any) -> None:
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
            mask = flags(get(plan.mask), rows, steps)

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
            value = flags(get(key), rows, steps)
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
        plan: CollectorPlan,
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
                value = flags(value, rows, steps)
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
        plan: CollectorPlan,
        batch: Any,
        rows: int,
        steps: int,
        mask: torch.Tensor | None,
        device: torch.device,
    ) -> EpisodeRing:
        """The ring for batches of this shape (a batch of another shape flushes the ring)."""
        ring = self._ring
        key = (rows, steps, device, mask is None)
        if ring is not None and ring.key == key:
            return ring
        self._flush()
        traj_dtype = None if plan.traj_ids is None else batch.get(plan.traj_ids).dtype
        ring = self._ring = EpisodeRing(
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
