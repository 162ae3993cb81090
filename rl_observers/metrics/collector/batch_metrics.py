"""CollectorBatchMetrics: reward, done and episode metrics of collector batches (fold paths: see the package)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torchrl._utils import logger as torchrl_logger

from rl_observers.metrics.base import MetricSet
from rl_observers.metrics.collector.from_keys import FromKeysFold
from rl_observers.metrics.collector.interleaved import InterleavedFold
from rl_observers.metrics.collector.plan import (
    CollectorPlan,
    EpisodeCarry,
    flags,
    per_entry,
    resolve_plan,
)
from rl_observers.metrics.collector.reducers import BatchReducers
from rl_observers.metrics.collector.ring import RingFold, plain_stage
from rl_observers.metrics.collector.window import EpisodeWindow
from rl_observers.metrics.keys import (
    FROM_SOURCE,
    MissingKeyError,
    NestedKey,
    absent_key,
    check_bool,
    check_key,
    closest_key,
    keys_from_source,
    leaf_keys,
    missing_key,
    spec_keys,
)
from rl_observers.sources.observed import observers_of
from rl_observers.stats import Count, Partial

__all__ = ["CollectorBatchMetrics"]

# The keys a source may decide, each the argument ``<name>_key``.
_KEYS = ("reward", "done", "terminated", "truncated", "episode_reward", "step_count")


class CollectorBatchMetrics(MetricSet):
    """Reward, done and episode metrics of collector batches.

    Batches are ``[T]`` or ``[*B, T]`` (time last), padded, or
    ``AsyncBatchedCollector``'s interleaved ``[N]``. An episode spanning
    batches counts once, with its full return, in the window where it ends.
    Keys left to their default follow the bound collector's env specs.
    Layouts and key checks: :ref:`metric-names` and the FAQ.

    Keyword Args:
        reward_key (NestedKey, optional): per-step reward; ``None``: no reward
            metrics. Defaults to the source's, ``("next", "reward")`` unbound.
        done_key (NestedKey, optional): done flags; ``None`` allowed. Defaults
            to the source's, ``("next", "done")`` unbound.
        terminated_key, truncated_key (NestedKey, optional): also close
            episodes, when present. Default to the source's.
        episode_return (bool, optional): emit ``episode_return_*``. Defaults
            to ``True``.
        episode_length (bool, optional): emit ``episode_length_*``. Defaults
            to ``True``.
        episode_reward_key (NestedKey, optional): ``RewardSum``'s entry.
            Defaults to ``"episode_reward"`` next to the reward key.
        step_count_key (NestedKey, optional): ``StepCounter``'s entry.
            Defaults to ``"step_count"`` next to the done key.
        mask_key (NestedKey, optional): valid-step mask of padded batches.
            Defaults to ``("collector", "mask")``.
        traj_ids_key (NestedKey, optional): trajectory ids, to drop carries
            that do not continue. Defaults to ``("collector", "traj_ids")``.
        env_index_key (NestedKey, optional): the env of each step of
            interleaved batches. Defaults to ``"env_index"``.
        episode_window (int, optional): also report the last ``N`` episodes
            (``*_last_<N>``). Defaults to ``None``.
        quantiles (sequence of float, optional): also report these quantiles
            of returns and lengths. Defaults to ``None``.

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

        The last two episodes, across windows:

        >>> rolling = CollectorBatchMetrics(episode_window=2, episode_length=False)
        >>> for rewards, dones in (([1.0, 1.0], [False, True]), ([4.0], [True]), ([2.0], [True])):
        ...     rolling.on_post_collect(None, batch(rewards, dones))
        ...     window = rolling.pull()["episode_window"]
        >>> window.finalize()["episode_return_mean_last_2"], window.values("episode_return")
        (3.0, [4.0, 2.0])
    """

    counter_names = ("frames", "batches", "episodes")
    _episodes_stopped = False  # no closing key in the batches: episodes_total is not logged
    _config: dict[str, Any] = {}  # noqa: RUF012 (replaced per instance in __init__)
    _lock_folds = False  # on_post_collect takes the lock itself
    _transient = ("_delivery",)  # the source's observer list stays with the source

    def __init__(
        self,
        *,
        reward_key: NestedKey | None = FROM_SOURCE,
        done_key: NestedKey | None = FROM_SOURCE,
        terminated_key: NestedKey | None = FROM_SOURCE,
        truncated_key: NestedKey | None = FROM_SOURCE,
        episode_return: bool = True,
        episode_length: bool = True,
        episode_reward_key: NestedKey | None = FROM_SOURCE,
        step_count_key: NestedKey | None = FROM_SOURCE,
        mask_key: NestedKey | None = ("collector", "mask"),
        traj_ids_key: NestedKey | None = ("collector", "traj_ids"),
        env_index_key: NestedKey | None = "env_index",
        episode_window: int | None = None,
        quantiles: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self._delivery: Any = None  # the source's observer list, where it counts dropped rollouts
        self._discarded_pulled = 0  # frames_discarded as last pulled
        owner = type(self).__name__
        self._config = {"episode_window": episode_window, "quantiles": quantiles}
        self._episodes_stopped = False
        given = dict(zip(_KEYS, (reward_key, done_key, terminated_key, truncated_key)))
        given.update(episode_reward=episode_reward_key, step_count=step_count_key)
        given.update(mask=mask_key, traj_ids=traj_ids_key, env_index=env_index_key)
        # Keys left to the source: ("next", <name>) until bound to one.
        self._from_source = tuple(name for name, key in given.items() if key is FROM_SOURCE)
        for name, key in given.items():
            key = ("next", name) if key is FROM_SOURCE else key
            setattr(self, f"{name}_key", check_key(key, f"{name}_key", owner))
        self.episode_return = check_bool(episode_return, "episode_return", owner)
        self.episode_length = check_bool(episode_length, "episode_length", owner)
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
        reward = self.moments("reward") if self.reward_key is not None else None
        dones = self.count("dones") if self.done_key is not None else None
        self._episodes = self.count("episodes") if any(k is not None for k in closing) else None
        # Returns and lengths share their mask (the closing steps): folded together.
        specs = []
        if episode_return:
            specs.append(("episode_return", ("mean", "std", "min", "max")))
        if episode_length:
            specs.append(("episode_length", ("mean", "min", "max")))
        self._episode = self.moments_group(specs) if specs else None
        # per instance: a set reconfigured at its first batch (_stop_missing) may stop its episodes
        self.episode_arguments = "episode_return=False, episode_length=False" if specs else None
        size = episode_window
        if size is not None and (type(size) is bool or not isinstance(size, int) or size < 1):
            raise ValueError(f"{owner}: episode_window must be a positive int or None, got {size!r}.")
        for what, value in (("quantiles", quantiles), ("episode_window", size)):
            if value is not None and not specs:
                raise ValueError(f"{owner}: {what} needs episode_return=True or episode_length=True.")
        # Opt-in: a quantile sketch per episode quantity, folded where its moments are.
        q = quantiles
        sketches = tuple(self.quantiles(p, q=q) for p, _ in specs) if q is not None else ()
        self._plan: CollectorPlan | None = None
        names = tuple(prefix for prefix, _ in specs)
        self._window = None if size is None else EpisodeWindow(self._bank, size, names, sketches)
        reducers = self._batch_reducers = BatchReducers(
            self._counters,
            reward=reward,
            dones=dones,
            episodes=self._episodes,
            episode=self._episode,
            quantiles=sketches,
            window=self._window,
        )
        self._carry = EpisodeCarry()  # the episodes in flight, of the ring or interleaved path
        self._ring_fold = RingFold(reducers, self._carry)
        self._interleaved_fold = InterleavedFold(reducers, self._carry, self._ring_fold, owner)
        self._from_keys_fold = FromKeysFold(reducers)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(reward_key={self.reward_key!r}, done_key={self.done_key!r}, "
            f"episode_return={self.episode_return}, episode_length={self.episode_length})"
        )

    # -- key resolution -------------------------------------------------------------

    def bind(self, source: Any) -> None:
        """Takes the keys left to the source from its env's specs (a collector in this process); before the first batch."""
        if self._window is not None:
            self._window.bind(source)
        # A worker's rollouts delivered at its hand-over: drops counted apart.
        observers = observers_of(source)
        self._delivery = observers if getattr(observers, "defers_delivery", False) else None
        envs = getattr(source, "_num_envs", None)  # AsyncBatchedCollector: one env per index
        with self._lock:
            if isinstance(envs, int) and not isinstance(envs, bool) and envs > 0:
                self._interleaved_fold.bind_envs(envs)
            self._ring_fold.reset_at_each_batch(
                getattr(source, "reset_at_each_iter", False) is True
            )
        found = keys_from_source(source) if self._from_source else None
        if found is None:
            return
        with self._lock:
            for name in self._from_source:
                setattr(self, f"{name}_key", found[name])
            self._plan = None  # resolved again at the next batch

    def check_keys(self, source: Any) -> None:
        """Raises a ``ValueError`` for an explicit ``reward_key`` or ``done_key`` the env specs prove absent."""
        known = spec_keys(source)
        if known is None:
            return
        where = "the env's specs and the policy's out_keys"
        for name in ("reward", "done"):
            key = getattr(self, f"{name}_key")
            if name not in self._from_source and key is not None and known.proves_absent(key):
                raise absent_key(type(self).__name__, f"{name}_key", key, known.keys, where)

    def _stop_missing(self, source: Any, batch: Any, error: KeyError) -> None:
        """The first batch lacks a required key: reconfigures without what needs it and warns which metrics stop (else re-raises)."""
        if type(self) is not CollectorBatchMetrics:
            raise error
        present = leaf_keys(batch)
        names = (*(f"{n}_key" for n in _KEYS), "mask_key", "traj_ids_key", "env_index_key")
        kwargs = {n: getattr(self, n) for n in (*names, "episode_return", "episode_length")}
        kwargs.update(self._config)
        asked = {w: kwargs[w] for w in ("reward_key", "done_key") if kwargs[w] is not None}
        missing = [(what, key) for what, key in asked.items() if key not in present]
        if not missing:
            raise error
        for what, _ in missing:
            kwargs[what] = None
        if kwargs["reward_key"] is None and kwargs["episode_reward_key"] not in present:
            kwargs["episode_return"] = False  # it was to be summed from the rewards
        closing = [kwargs[f"{n}_key"] for n in ("done", "terminated", "truncated")]
        if not any(k is not None and k in present for k in closing):
            kwargs.update(episode_return=False, episode_length=False)
            kwargs.update(done_key=None, terminated_key=None, truncated_key=None)
        if not (kwargs["episode_return"] or kwargs["episode_length"]):
            kwargs.update(episode_window=None, quantiles=None)
        before = self.metric_names()
        replacement = CollectorBatchMetrics(**kwargs)
        # The schedule reads this set's counters object: it keeps it, going on from its values
        # in the dict the replacement's fold paths count into; bound again to the source.
        values = replacement._counters.values
        values.update(self._counters.poll())
        self._counters.values = values
        lock, counters = self._lock, self._counters
        self.__dict__.update(replacement.__dict__)
        self._lock, self._counters = lock, counters
        self._episodes_stopped = self._episodes is None
        self.bind(source)
        internal = ("reward", "episode_return", "episode_length", "episode_window")
        kept = {*self.metric_names(), *internal}
        stopped = [n for n in before if n not in kept and not n.endswith("_quantiles")]
        going_on = ["frames", "batches"] + ([] if self._episodes_stopped else ["episodes"])
        shown = ", ".join(repr(k) for k in sorted(present, key=str))
        told = "; ".join(
            f"{what}={key!r} (closest: {closest_key(key, present)!r})" for what, key in missing
        )
        torchrl_logger.warning(
            f"rl_observers: CollectorBatchMetrics: not in the first batch: {told}; keys present: "
            f"{shown}. These metrics stopped: {', '.join(stopped) or 'none'}; "
            f"{', '.join(going_on)} and the others keep counting. Pass one of the keys present "
            "(or None) to log them."
        )

    # -- events: each batch goes to its fold path ---------------------------------------

    def on_post_collect(self, source: Any, batch: Any) -> None:
        """Folds one collector batch (no host-device sync)."""
        with self._lock:
            plan = self._plan
            ring_fold = self._ring_fold
            ring = ring_fold.ring
            if ring is not None:
                # A batch laid out as the ring's last ones: staged with what was resolved then.
                stage = ring.plain
                if stage and stage.plan is plan:  # type: ignore[union-attr]
                    values = stage.read(batch)  # type: ignore[union-attr]
                    if values is not None and values[0].is_cpu:
                        ring_fold.fold_plain(ring, stage, values, batch.batch_size)  # type: ignore[arg-type]
                        return
            if plan is None:
                try:
                    plan = resolve_plan(self, batch)
                except MissingKeyError as error:
                    self._stop_missing(source, batch, error)
                    plan = resolve_plan(self, batch)
                self._plan = plan
            self._fold(plan, batch)
            if self._window is not None:
                self._window.advance(batch.batch_size)
            ring = ring_fold.ring
            if ring is not None and ring.plain is None and plan.running:
                ring.plain = plain_stage(ring, plan, batch)

    def _fold(self, plan: CollectorPlan, batch: Any) -> None:
        batch_size = batch.batch_size
        if not len(batch_size):
            raise ValueError(
                f"{type(self).__name__} expects batches with a time dimension, got batch_size=[]."
            )
        steps = batch_size[-1]
        rows = math.prod(batch_size[:-1])
        # Every entry the plan reads, before anything is folded: a key resolved at the first
        # batch and missing from this one fails as it would have there.
        read = {}
        for key, what in plan.reads:
            value = batch.get(key, None)
            if value is None:
                raise missing_key(type(self).__name__, what, key, leaf_keys(batch))
            read[key] = value
        get = read.__getitem__
        counters = self._counters
        counts = counters.values
        counts["batches"] += 1
        mask = None
        if plan.mask is not None:
            mask = flags(get(plan.mask), rows, steps)

        reward = get(plan.reward) if plan.reward is not None else None
        if not plan.closing:
            if reward is not None:
                self._batch_reducers.fold_reward(reward, mask, batch_size)
            if mask is None:
                counts["frames"] += batch_size.numel()
            else:
                counters.add_observed(("frames",), torch.count_nonzero(mask).reshape(1))
            return

        # The episode kernel works on [rows, steps]: with several entries per step, one row
        # per env and entry.
        episode_mask = mask
        if plan.entries:
            entries, dims = plan.entries, batch.batch_dims

            def get(key: Any) -> torch.Tensor:
                return per_entry(read[key], dims, entries)

            rows *= math.prod(entries)
            if mask is not None:
                episode_mask = per_entry(mask.reshape(batch_size), dims, entries)
        closing_flags = []
        cells = rows * steps
        for key in plan.closing:
            value = get(key)
            # The ring copies flags of any layout; the other path needs [rows, steps].
            if not plan.running or value.dtype is not torch.bool or value.numel() != cells:
                value = flags(value, rows, steps)
            if episode_mask is not None:
                value = value & episode_mask.view(value.shape)
            closing_flags.append(value)
        if plan.env_index is not None:
            self._interleaved_fold.fold(
                plan, read, get, rows, steps, closing_flags, mask, episode_mask, batch_size
            )
            return
        if plan.running:
            self._ring_fold.fold(
                plan, batch, read, get, rows, steps, closing_flags, mask, episode_mask
            )
            return
        self._from_keys_fold.fold(plan, get, rows, steps, closing_flags, reward, mask, batch_size)

    def _fold_staged(self) -> None:
        self._ring_fold.flush()

    # -- host side ------------------------------------------------------------------

    def gauges(self, counters: dict[str, int]) -> dict[str, float]:
        """``frames``, ``batches``, ``episodes_total`` (left out once episodes stopped), and ``frames_discarded`` where rollouts are dropped."""
        out = {"frames": float(counters["frames"]), "batches": float(counters["batches"])}
        if self._delivery is not None:
            self._discarded_pulled = self._delivery.frames_discarded
            out["frames_discarded"] = float(self._discarded_pulled)
        if not self._episodes_stopped:
            out["episodes_total"] = float(counters["episodes"])
        return out

    def changed_since_pull(self) -> bool:
        """Whether rollouts were dropped since the last pull (at shutdown: no event follows)."""
        delivery = self._delivery
        return delivery is not None and delivery.frames_discarded != self._discarded_pulled

    def pull(self) -> dict[str, float | Partial]:
        """Gauges and the window's partials, in one transfer; resets the window, not the episodes in flight."""
        with self._lock:
            out = super().pull()
            plan = self._plan
            if plan is not None and plan.running:
                # Episodes closed in the ring's batches are the count of their moments (and
                # the dones, when done is the only closing key).
                counted = Count("episodes", out[self._episode.prefixes[0]].count)  # type: ignore[union-attr,attr-defined]
                out["episodes"] = counted
                if plan.closing == (plan.done,):
                    out["dones"] = Count("dones", counted.n)
            if self._window is not None:
                self._window.pulled(out)
            return out

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counters and the per-env episodes in flight."""
        with self._lock:
            state = super().state_dict()
            state.update(self._carry.state_dict())
            if self._window is not None:
                state["episode_window"] = self._window.state()
            return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores counters and episodes in flight (the window starts empty)."""
        with self._lock:
            self._carry.load_state_dict(state_dict, type(self).__name__)
            super().load_state_dict(state_dict)
            self._ring_fold.discard()  # batches not summed yet belong to the replaced state
            if self._window is not None:
                self._window.load(state_dict.get("episode_window"), type(self).__name__)
