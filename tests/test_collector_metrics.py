"""CollectorBatchMetrics and its episode kernel against ground truth computed from real batches."""

from __future__ import annotations

import math
import pickle
import statistics

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict
from torchrl.collectors import Collector
from torchrl.data import (
    Bounded,
    Composite,
    Unbounded,
)
from torchrl.envs import EnvBase, GymEnv, RewardSum, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import RandomPolicy

from rl_observers.metrics import (
    CollectorBatchMetrics,
    MetricSet,
    SampleMetrics,
    WriteMetrics,
)
from rl_observers.metrics.collector import ring as episodes_module
from rl_observers.metrics.keys import MissingKeyError
from rl_observers.stats import Count, Moments, ObservedCounters
from rl_observers.stats import reducers as reducers_module

# -- a real torchrl env with random rewards and random terminations ------------------


class RandomRewardEnv(EnvBase):
    """Gaussian rewards; each step terminates with probability ``p_done``."""

    def __init__(self, p_done: float = 0.12, batch_size=(), seed: int = 0) -> None:
        super().__init__(batch_size=torch.Size(batch_size))
        bs = self.batch_size
        self.observation_spec = Composite(observation=Unbounded(shape=(*bs, 1)), shape=bs)
        self.action_spec = Bounded(-1.0, 1.0, shape=(*bs, 1))
        self.reward_spec = Unbounded(shape=(*bs, 1))
        self.p_done = p_done
        self.rng = torch.Generator().manual_seed(seed)

    def _reset(self, tensordict):
        bs = self.batch_size
        false = torch.zeros(*bs, 1, dtype=torch.bool)
        return TensorDict(
            {"observation": torch.zeros(*bs, 1), "done": false, "terminated": false.clone()}, bs
        )

    def _step(self, tensordict):
        bs = self.batch_size
        reward = torch.randn(*bs, 1, generator=self.rng)
        terminated = torch.rand(*bs, 1, generator=self.rng) < self.p_done
        return TensorDict(
            {
                "observation": tensordict["observation"] + 1,
                "reward": reward,
                "done": terminated.clone(),
                "terminated": terminated,
            },
            bs,
        )

    def _set_seed(self, seed):
        self.rng.manual_seed(seed)


def make_env(batch_size=(), max_steps=7, reward_sum=False, seed=0):
    env = TransformedEnv(RandomRewardEnv(batch_size=batch_size, seed=seed), StepCounter(max_steps))
    if reward_sum:
        env.append_transform(RewardSum())
    return env


def collect(env, frames_per_batch, total_frames, **kwargs) -> list[TensorDict]:
    collector = Collector(
        env,
        RandomPolicy(env.action_spec),
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        **kwargs,
    )
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


# -- ground truth: a step-by-step python loop over the batches ------------------------


def _rows(batch, key, default=None):
    """``[*B, T, ...]`` -> python list of rows of per-step values."""
    value = batch.get(key, None)
    if value is None:
        return default
    steps = batch.batch_size[-1]
    return value.reshape(-1, steps, value[(0,) * batch.batch_dims].numel()).tolist()


class Truth:
    """Episodes completed per batch, computed one step at a time.

    An episode is a trajectory (``("collector", "traj_ids")``, or the row when
    the batch has no ids; with ``by_env``, the env of ``"env_index"`` in
    interleaved batches): its return and length add up every valid step of
    that trajectory, in whatever batch and row it appears, and it completes
    at a step where done, terminated or truncated is set. A trajectory that
    never reaches such a step (interrupted by a reset) never completes.
    ``reset_each_batch``: every batch starts new trajectories.
    """

    def __init__(self, batches, *, by_env=False, reset_each_batch=False):
        self.rewards: list[list[float]] = []  # valid per-step rewards, per batch
        self.episodes: list[list[tuple[float, int]]] = []  # (return, length) per batch
        self.spanning = 0  # episodes that ended in a later batch than they started
        self.truncations = 0  # closed by truncated, not terminated
        self.dones = []
        running: dict[object, tuple[float, int, int]] = {}  # trajectory -> (return, length, start)
        for b_index, batch in enumerate(batches):
            steps = batch.batch_size[-1]
            rows = math.prod(batch.batch_size[:-1])
            reward = _rows(batch, ("next", "reward"))
            done, terminated, truncated = (
                _rows(batch, ("next", key), [[[False]] * steps] * rows)
                for key in ("done", "terminated", "truncated")
            )
            mask = _rows(batch, ("collector", "mask"), [[[True]] * steps] * rows)
            traj = _rows(batch, "env_index" if by_env else ("collector", "traj_ids"))
            if reset_each_batch:
                running.clear()
            kept, closed, dones = [], [], 0
            for e in range(rows):
                for t in range(steps):
                    if not mask[e][t][0]:
                        continue
                    key = traj[e][t][0] if traj is not None else ("row", e)
                    ret, length, start = running.get(key, (0.0, 0, b_index))
                    ret += reward[e][t][0]
                    length += 1
                    kept.append(reward[e][t][0])
                    dones += bool(done[e][t][0])
                    if done[e][t][0] or terminated[e][t][0] or truncated[e][t][0]:
                        closed.append((ret, length))
                        self.spanning += start != b_index
                        self.truncations += bool(truncated[e][t][0] and not terminated[e][t][0])
                        running.pop(key, None)
                    else:
                        running[key] = (ret, length, start)
            self.rewards.append(kept)
            self.episodes.append(closed)
            self.dones.append(dones)

    def window(self, start: int, stop: int) -> dict[str, float]:
        rewards = [r for b in self.rewards[start:stop] for r in b]
        episodes = [e for b in self.episodes[start:stop] for e in b]
        out = {"dones": float(sum(self.dones[start:stop])), "episodes": float(len(episodes))}
        if rewards:
            out.update(
                reward_mean=statistics.fmean(rewards),
                reward_std=statistics.pstdev(rewards),
                reward_min=min(rewards),
                reward_max=max(rewards),
            )
        if episodes:
            returns = [r for r, _ in episodes]
            lengths = [n for _, n in episodes]
            out.update(
                episode_return_mean=statistics.fmean(returns),
                episode_return_std=statistics.pstdev(returns),
                episode_return_min=min(returns),
                episode_return_max=max(returns),
                episode_length_mean=statistics.fmean(lengths),
                episode_length_min=float(min(lengths)),
                episode_length_max=float(max(lengths)),
            )
        return out


def finalized(payload) -> dict[str, float]:
    out = {}
    for key, value in payload.items():
        if key in ("frames", "batches", "episodes_total"):
            continue
        out.update(value.finalize())
    return out


def assert_window(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        # float32 rewards (and RewardSum's float32 running sums) vs python floats
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def run_per_batch(metrics, batches, truth):
    for i, batch in enumerate(batches):
        metrics.on_post_collect(None, batch)
        assert_window(finalized(metrics.pull()), truth.window(i, i + 1))


# -- CollectorBatchMetrics: exactness --------------------------------------------------


ENV_CASES = {
    "single": dict(batch_size=()),
    "single_one_step_batches": dict(batch_size=(), steps=1),
    "single_rewardsum": dict(batch_size=(), reward_sum=True),
    "batched_3": dict(batch_size=(3,)),
    "batched_2x2_rewardsum": dict(batch_size=(2, 2), reward_sum=True),
}


@pytest.mark.parametrize("case", list(ENV_CASES))
def test_episodes_exact_across_batches(case):
    kwargs = dict(ENV_CASES[case])
    steps = kwargs.pop("steps", 5)
    env = make_env(**kwargs)
    n_envs = max(1, math.prod(kwargs["batch_size"]))
    batches = collect(env, frames_per_batch=steps * n_envs, total_frames=160 * n_envs)
    assert batches[0].batch_size[-1] == steps
    truth = Truth(batches)
    assert truth.spanning > 5 and truth.truncations > 2  # the test exercises both
    has_sum = ("next", "episode_reward") in batches[0].keys(True)
    assert has_sum == kwargs.get("reward_sum", False)
    run_per_batch(CollectorBatchMetrics(), batches, truth)


def test_rewardsum_and_running_sums_agree_and_match_truth():
    batches = collect(make_env(batch_size=(2,), reward_sum=True), 6, 240)
    truth = Truth(batches)
    with_keys = CollectorBatchMetrics()
    running = CollectorBatchMetrics(episode_reward_key=None, step_count_key=None)
    for batch in batches:
        with_keys.on_post_collect(None, batch)
        running.on_post_collect(None, batch)
    want = truth.window(0, len(batches))
    assert_window(finalized(with_keys.pull()), want)
    assert_window(finalized(running.pull()), want)


def test_serial_env():
    env = SerialEnv(2, lambda: TransformedEnv(RandomRewardEnv(), StepCounter(6)))
    batches = collect(env, frames_per_batch=8, total_frames=200)
    assert batches[0].batch_size == torch.Size([2, 4])
    truth = Truth(batches)
    assert truth.spanning > 0
    run_per_batch(CollectorBatchMetrics(), batches, truth)


@pytest.mark.filterwarnings("ignore:split_trajs=True produces:UserWarning")
def test_split_trajs_with_rewardsum_and_stepcounter():
    # split_trajs rows are trajectory fragments, not envs: RewardSum/StepCounter
    # give the full return and length of episodes that span batches.
    batches = collect(make_env(batch_size=(2,), reward_sum=True), 10, 200, split_trajs=True)
    assert ("collector", "mask") in batches[0].keys(True)
    truth = Truth(batches)
    assert truth.spanning > 5
    run_per_batch(CollectorBatchMetrics(), batches, truth)


@pytest.mark.filterwarnings("ignore:split_trajs=True produces:UserWarning")
@pytest.mark.parametrize("entries", [False, True])
def test_split_trajs_with_running_sums(shortcuts, entries):
    # split_trajs rows are trajectory fragments: an episode spanning batches continues in a
    # row of the next batch with the same trajectory id, whatever its row, and its carry
    # follows the id.
    env = make_env(batch_size=(2,), max_steps=40)
    batches = collect(env, 10, 400, split_trajs=True)
    assert ("collector", "mask") in batches[0].keys(True)
    assert ("next", "episode_reward") not in batches[0].keys(True)
    if entries:  # two entries per step (agents): each has its own episodes, ids repeat
        batches = [_two_entries(b) for b in batches]
    truth = Truth(batches)
    assert truth.spanning > 5
    if entries:
        truth = _entry_truth(batches)
    run_per_batch(CollectorBatchMetrics(step_count_key=None), batches, truth)


def _two_entries(batch):
    """Per-step rewards and flags of ``batch`` given two entries: the reward and 3 x it."""
    batch = batch.clone()
    reward = batch["next", "reward"]
    batch["next", "reward"] = torch.stack([reward, 3 * reward], -2)  # [*B, T, 2, 1]
    for key in ("done", "terminated", "truncated"):
        flag = batch.get(("next", key), None)
        if flag is not None:
            batch["next", key] = torch.stack([flag, flag], -2)
    return batch


def _entry_truth(batches):
    """``Truth`` of ``_two_entries`` batches: each entry's episodes, per batch, merged."""
    plain = []
    for batch in batches:
        one = batch.clone()
        for key in ("reward", "done", "terminated", "truncated"):
            value = one.get(("next", key), None)
            if value is not None:
                one["next", key] = value[..., 0, :]
        plain.append(one)
    tripled = [b.clone() for b in plain]
    for b in tripled:
        b["next", "reward"] = 3 * b["next", "reward"]
    first, second = Truth(plain), Truth(tripled)
    for i in range(len(batches)):
        first.rewards[i] += second.rewards[i]
        first.episodes[i] += second.episodes[i]
        first.dones[i] += second.dones[i]
    return first


# -- AsyncBatchedCollector: steps of several envs interleaved in one [N] batch -------------


def _async_batched(make_envs, frames_per_batch, total_frames):
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import AsyncBatchedCollector

    policy = TensorDictModule(
        lambda obs: torch.tanh(obs), in_keys=["observation"], out_keys=["action"]
    )
    return AsyncBatchedCollector(
        make_envs,
        policy=policy,
        env_backend="threading",
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
    )


def _interleaving_env(seed, reward_sum=False):
    # Long episodes, cut by StepCounter at 40 steps: most span several 30-step batches.
    env = TransformedEnv(RandomRewardEnv(p_done=0.04, seed=seed), StepCounter(40))
    if reward_sum:
        env.append_transform(RewardSum())
    return env


@pytest.mark.parametrize(
    "reward_sum, metric_kwargs",
    [(False, {}), (False, {"step_count_key": None}), (True, {})],
    ids=["running_return", "running_both", "rewardsum_stepcounter"],
)
def test_async_batched_collector_episodes_per_env(reward_sum, metric_kwargs):
    # AsyncBatchedCollector yields flat [N] batches of steps of several envs interleaved in
    # arrival order, each with its "env_index": an episode is the steps of one env index.
    import functools

    makers = [functools.partial(_interleaving_env, s, reward_sum) for s in (1, 2, 3)]
    collector = _async_batched(makers, 30, 900)
    metrics = CollectorBatchMetrics(episode_window=7, **metric_kwargs)
    try:
        metrics.bind(collector)  # as an observer binds its sets: the env count is known
        collector.add_observer(lambda batch: metrics.on_post_collect(collector, batch))
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    assert batches[0].batch_size == torch.Size([30])
    envs = torch.cat([b["env_index"].reshape(-1) for b in batches])
    assert set(envs.tolist()) == {0, 1, 2}
    interleaved = Truth(batches)  # one time series: what the batches look like
    truth = Truth(batches, by_env=True)
    assert truth.spanning > 5 and truth.truncations > 0
    assert interleaved.episodes != truth.episodes  # the test tells the two apart
    fresh = CollectorBatchMetrics(**metric_kwargs)
    run_per_batch(fresh, batches, truth)
    # Bound to the collector and folding in its observer: the same numbers, and the last 7
    # episodes in the order they ended.
    want = truth.window(0, len(batches))
    payload = metrics.pull()
    got = finalized({k: v for k, v in payload.items() if k != "episode_window"})
    assert_window(got, want)
    last = [ret for b in truth.episodes for ret, _ in b][-7:]
    assert payload["episode_window"].values("episode_return") == pytest.approx(last, rel=1e-5)
    assert metrics._interleaved_fold.envs in (None, 3)  # from the collector when running


def test_interleaved_batches_carry_envs_absent_from_a_batch(shortcuts):
    # Env 2 has no step in some batches: its episode in flight waits for its next step.
    batches = []
    rng = torch.Generator().manual_seed(0)
    for i in range(12):
        envs = torch.tensor([0, 1, 0, 1, 2, 0] if i % 3 == 0 else [1, 0, 0, 1, 1, 0])
        steps = len(envs)
        reward = torch.randint(0, 10, (steps, 1), generator=rng).float()
        done = torch.rand((steps, 1), generator=rng) < 0.2
        batches.append(
            TensorDict(
                {"env_index": envs, "next": {"reward": reward, "done": done}}, batch_size=[steps]
            )
        )
    truth = Truth(batches, by_env=True)
    assert truth.spanning > 3
    run_per_batch(CollectorBatchMetrics(), batches, truth)
    # The per-env carries survive a state_dict round trip.
    first = CollectorBatchMetrics()
    for batch in batches[:5]:
        first.on_post_collect(None, batch)
    first.pull()
    resumed = CollectorBatchMetrics()
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    for batch in batches[5:]:
        resumed.on_post_collect(None, batch)
    assert_window(finalized(resumed.pull()), truth.window(5, len(batches)))


def test_interleaved_batches_off_the_cpu_need_the_env_count():
    batch = TensorDict(
        {
            "env_index": torch.tensor([0, 1, 0, 1]),
            "next": {"reward": torch.ones(4, 1), "done": torch.zeros(4, 1, dtype=torch.bool)},
        },
        batch_size=[4],
    ).to("meta")
    with pytest.raises(ValueError, match=r"RewardSum\(\) and StepCounter\(\)"):
        CollectorBatchMetrics().on_post_collect(None, batch)


def test_reset_at_each_iter_without_traj_ids():
    # Bound to a collector that resets at each batch, episodes in flight are dropped even
    # without trajectory ids to say so.
    env = make_env(max_steps=50)
    collector = Collector(
        env,
        RandomPolicy(env.action_spec),
        frames_per_batch=6,
        total_frames=360,
        reset_at_each_iter=True,
        track_traj_ids=False,
    )
    metrics = CollectorBatchMetrics(step_count_key=None)
    metrics.bind(collector)
    try:
        batches = []
        for batch in collector:
            metrics.on_post_collect(collector, batch)
            batches.append(batch.clone())
    finally:
        collector.shutdown()
    assert ("collector", "traj_ids") not in batches[0].keys(True)
    truth = Truth(batches, reset_each_batch=True)
    assert truth.window(0, len(batches)) != pytest.approx(Truth(batches).window(0, len(batches)))
    assert_window(finalized(metrics.pull()), truth.window(0, len(batches)))


@pytest.mark.parametrize("traj_format", ["padded", "cat"])
def test_trajs_per_batch(traj_format):
    env = make_env(batch_size=(2,), max_steps=9)
    batches = collect(env, 8, 300, trajs_per_batch=3, traj_format=traj_format)
    if traj_format == "padded":
        assert ("collector", "mask") in batches[0].keys(True)
        assert any(not b["collector", "mask"].all() for b in batches)  # real padding
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    run_per_batch(metrics, batches, truth)
    assert metrics.counters()["frames"] == sum(len(r) for r in truth.rewards)
    assert metrics.counters()["episodes"] == 3 * len(batches)


def test_reset_at_each_iter_drops_interrupted_episodes():
    env = make_env(max_steps=50)  # long episodes: most are interrupted by the reset
    batches = collect(env, 6, 180, reset_at_each_iter=True)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    run_per_batch(metrics, batches, truth)
    # Without the trajectory ids the carry would leak into the next episode.
    leaky = CollectorBatchMetrics(traj_ids_key=None)
    for batch in batches:
        leaky.on_post_collect(None, batch)
    assert finalized(leaky.pull()) != pytest.approx(truth.window(0, len(batches)))


@pytest.fixture(params=["cpu_shortcuts", "device_path"])
def shortcuts(request, monkeypatch):
    """Runs a test with the CPU-only shortcuts, then with the path other devices take."""
    enabled = request.param == "cpu_shortcuts"
    monkeypatch.setattr(episodes_module, "_CPU_SHORTCUTS", enabled)
    monkeypatch.setattr(reducers_module, "_CPU_MASK_SHORTCUTS", enabled)
    return enabled


WINDOW_CASES = {
    # name: (env kwargs, frames per batch, total frames, collector kwargs, metric set kwargs)
    "single": (dict(), 5, 400, {}, {}),
    "batched_3": (dict(batch_size=(3,)), 15, 600, {}, {}),
    "batched_long_episodes": (dict(batch_size=(2,), max_steps=40), 6, 600, {}, {}),
    "rewardsum_keys": (dict(batch_size=(2,), reward_sum=True), 6, 480, {}, {}),
    "rewardsum_running_return": (
        dict(batch_size=(2,), reward_sum=True), 6, 480, {}, dict(episode_reward_key=None)
    ),
    "stepcounter_running_length": (
        dict(batch_size=(2,), reward_sum=True), 6, 480, {}, dict(step_count_key=None)
    ),
    "return_only": (dict(batch_size=(2,)), 6, 480, {}, dict(episode_length=False)),
    "reset_at_each_iter": (dict(max_steps=50), 6, 360, dict(reset_at_each_iter=True), {}),
    "trajs_padded": (
        dict(batch_size=(2,), max_steps=9), 8, 400, dict(trajs_per_batch=3, traj_format="padded"), {}
    ),
    "trajs_cat": (
        dict(batch_size=(2,), max_steps=9), 8, 400, dict(trajs_per_batch=3, traj_format="cat"), {}
    ),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_windows_of_many_batches(case, shortcuts):
    # Windows of 4, 16 (a full ring of running sums) and 23 batches, and a last partial one:
    # episodes are exact whatever the window, across rings and trajectory cuts.
    env_kwargs, frames, total, collector_kwargs, metric_kwargs = WINDOW_CASES[case]
    batches = collect(make_env(**env_kwargs), frames, total, **collector_kwargs)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics(**metric_kwargs)
    start = 0
    for window in (4, 16, 23, len(batches)):
        stop = min(start + window, len(batches))
        for batch in batches[start:stop]:
            metrics.on_post_collect(None, batch)
        got = finalized(metrics.pull())
        want = truth.window(start, stop)
        for missing in ("episode_length", "episode_return"):
            if not getattr(metrics, missing):
                want = {k: v for k, v in want.items() if not k.startswith(missing)}
        assert_window(got, want)
        start = stop
    assert start == len(batches)
    assert metrics.counters()["episodes"] == sum(len(e) for e in truth.episodes)


@pytest.mark.parametrize("step_counter", [True, False])
def test_episodes_that_span_many_rings(shortcuts, step_counter):
    # Episodes of hundreds of steps over 2-step batches: most rings of 16 batches see no
    # episode close, and an episode's return (and length) is carried across several of them.
    env = RandomRewardEnv(p_done=0.003, batch_size=(2,))
    if step_counter:
        env = TransformedEnv(env, StepCounter(300))
    batches = collect(env, 4, 2400)
    truth = Truth(batches)
    assert truth.spanning > 5 and sum(map(len, truth.episodes)) < 20
    metrics = CollectorBatchMetrics()
    for start in range(0, len(batches), 37):
        for batch in batches[start : start + 37]:
            metrics.on_post_collect(None, batch)
        assert_window(finalized(metrics.pull()), truth.window(start, start + 37))


def test_a_trajectory_cut_in_a_ring_where_no_episode_closed(shortcuts):
    # The collector's reset between two batches starts a new trajectory without closing the
    # one in flight: a ring summed with no episode closed still drops what came before the
    # cut, so the episode that closes in the next window counts only its own steps.
    env = make_env(max_steps=7)
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=3, total_frames=-1)
    try:
        batches = []
        for index, batch in enumerate(collector):
            batches.append(batch.clone())
            if index == 0:
                collector.reset()
            if len(batches) == 6:
                break
    finally:
        collector.shutdown()
    ids = [b["collector", "traj_ids"].flatten().tolist() for b in batches]
    assert ids[0][-1] != ids[1][0] and not batches[0]["next", "done"].any()  # cut, not closed
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    for start, stop in ((0, 2), (2, 6)):
        for batch in batches[start:stop]:
            metrics.on_post_collect(None, batch)
        assert_window(finalized(metrics.pull()), truth.window(start, stop))
    assert truth.window(0, 2)["episodes"] == 0 and truth.window(2, 6)["episodes"] >= 1


def test_a_ring_is_summed_early_once_an_episode_closed_in_it(shortcuts, monkeypatch):
    # A host ring (here of 2 batches: _RING_STEPS) that filled up with no episode closed is
    # replaced by one of up to _RING_STEPS_OPEN steps (16 batches), summed as soon as it has
    # 2 batches and one of them closed an episode; a ring off the host stays at _RING_STEPS.
    # Windows stay exact at every fill.
    monkeypatch.setattr(episodes_module, "_RING_STEPS", 8)
    batches = collect(RandomRewardEnv(p_done=0.05, batch_size=(2,)), 4, 1200)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    held = []  # (batches staged, episodes closed in them) after each batch
    for start in range(0, len(batches), 13):
        for batch in batches[start : start + 13]:
            metrics.on_post_collect(None, batch)
            ring = metrics._ring_fold.ring
            held.append((ring.used, ring.closed))
        assert_window(finalized(metrics.pull()), truth.window(start, start + 13))
    assert ring.closing_size == 2
    assert ring.size == (16 if shortcuts else 2)
    if shortcuts:
        assert max(used for used, _ in held) > 2  # open: batches with no closing piled up
        assert all(used < 2 for used, closed in held if closed)  # summed at 2 once one closed
        assert any(closed for _, closed in held)
    else:
        assert all(used < 2 for used, _ in held)


def test_plain_batches_and_others_share_the_ring(shortcuts):
    # TensorDict batches laid out as the ring's first one are staged by dictionary look-ups;
    # others in between (flags of another dtype, a lazily stacked "next") take the general
    # path into the same ring, and every window stays exact.
    batches = collect(make_env(batch_size=(3,), max_steps=9), 12, 720)
    truth = Truth(batches)

    def variant(i, batch):
        batch = batch.clone()
        if i % 3 == 1:
            batch.set(("next", "done"), batch.get(("next", "done")).to(torch.uint8))
        elif i % 3 == 2:
            batch.set("next", LazyStackedTensorDict.lazy_stack(batch.get("next").unbind(0), 0))
        return batch

    metrics = CollectorBatchMetrics()
    for start in range(0, len(batches), 7):
        for i in range(start, min(start + 7, len(batches))):
            metrics.on_post_collect(None, variant(i, batches[i]))
        assert_window(finalized(metrics.pull()), truth.window(start, start + 7))
    assert metrics.counters()["episodes"] == sum(len(e) for e in truth.episodes)


def test_gym_cartpole_and_pendulum():
    cartpole = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    cartpole.set_seed(0)
    batches = collect(cartpole, 64, 1024)
    truth = Truth(batches)
    assert truth.spanning > 0
    metrics = CollectorBatchMetrics()
    for batch in batches:
        metrics.on_post_collect(None, batch)
    payload = metrics.pull()
    assert_window(finalized(payload), truth.window(0, len(batches)))
    assert payload["frames"] == 1024 and payload["batches"] == 16

    pendulum = TransformedEnv(GymEnv("Pendulum-v1"), StepCounter(max_steps=13))
    pendulum.set_seed(0)
    batches = collect(pendulum, 10, 200)
    truth = Truth(batches)
    assert truth.truncations == 15
    run_per_batch(CollectorBatchMetrics(), batches, truth)


def test_counters_and_gauges():
    batches = collect(make_env(batch_size=(3,)), 12, 240)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    for i, batch in enumerate(batches):
        metrics.on_post_collect(None, batch)
        completed = sum(len(e) for e in truth.episodes[: i + 1])
        assert metrics.counters() == {
            "frames": 12 * (i + 1),
            "batches": i + 1,
            "episodes": completed,
        }
    payload = metrics.pull()
    assert payload["frames"] == 240.0 and payload["batches"] == 20.0
    assert payload["episodes_total"] == sum(len(e) for e in truth.episodes)
    assert isinstance(payload["episodes"], Count) and isinstance(payload["reward"], Moments)
    # pull resets the window, never the cumulative gauges
    again = metrics.pull()
    assert again["frames"] == 240.0 and finalized(again) == {"dones": 0.0, "episodes": 0.0}


def test_resume_from_state_dict_neither_loses_nor_double_counts():
    batches = collect(make_env(batch_size=(2,)), 6, 300)
    truth = Truth(batches)
    cut = 17
    first = CollectorBatchMetrics()
    for batch in batches[:cut]:
        first.on_post_collect(None, batch)
    head = first.pull()
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = CollectorBatchMetrics()
    resumed.load_state_dict(state)
    for batch in batches[cut:]:
        resumed.on_post_collect(None, batch)
    tail = resumed.pull()
    merged = {k: head[k].merge(tail[k]) for k in head if not isinstance(head[k], float)}
    assert_window(finalized(merged), truth.window(0, len(batches)))
    assert tail["frames"] == 300 and tail["batches"] == 50
    assert tail["episodes_total"] == sum(len(e) for e in truth.episodes)
    # episodes in flight at the cut were carried over, with their full return
    assert_window(finalized(tail), truth.window(cut, len(batches)))


def test_a_state_loaded_into_a_busy_set_replaces_what_it_folded(shortcuts):
    # A set that folded other batches (some still staged in its ring, episodes in flight)
    # and then loads a state goes on from the loaded episodes in flight alone: the staged
    # batches go with the state they belonged to, and the ring path and the interleaved
    # path both sum on from the loaded carry.
    def interleave(rows):  # [3, 4] -> [12], the envs' steps interleaved
        flat = [batch.transpose(0, 1).reshape(-1) for batch in rows]
        for batch in flat:
            batch["env_index"] = torch.arange(3).repeat(4)
        return flat

    rows = collect(make_env(batch_size=(3,)), 12, 360)
    other = collect(make_env(batch_size=(3,), seed=5), 12, 84)
    truth = Truth(rows)  # the interleaved batches hold the same episodes
    cut = 11
    for batches, busy_with in ((rows, other), (interleave(rows), interleave(other))):
        first = CollectorBatchMetrics(step_count_key=None)
        for batch in batches[:cut]:
            first.on_post_collect(None, batch)
        first.pull()
        state = pickle.loads(pickle.dumps(first.state_dict()))
        busy = CollectorBatchMetrics(step_count_key=None)
        for batch in busy_with:
            busy.on_post_collect(None, batch)
        busy.load_state_dict(state)
        for batch in batches[cut:]:
            busy.on_post_collect(None, batch)
        assert_window(finalized(busy.pull()), truth.window(cut, len(batches)))
        assert busy.counters()["batches"] == len(batches)


def test_pickled_set_continues_where_it_was():
    batches = collect(make_env(), 5, 100)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    for batch in batches[:7]:
        metrics.on_post_collect(None, batch)
    clone = pickle.loads(pickle.dumps(metrics))
    for batch in batches[7:]:
        clone.on_post_collect(None, batch)
    assert_window(finalized(clone.pull()), truth.window(0, len(batches)))


def test_workers_merge_to_the_union():
    worker_batches = [collect(make_env(seed=s), 7, 140) for s in (1, 2)]
    payloads = []
    for batches in worker_batches:
        metrics = CollectorBatchMetrics()
        for batch in batches:
            metrics.on_post_collect(None, batch)
        payloads.append(metrics.pull())
    merged = {
        k: v.merge(payloads[1][k]) for k, v in payloads[0].items() if not isinstance(v, float)
    }
    truths = [Truth(b) for b in worker_batches]
    union = Truth([])
    for t in truths:
        union.rewards += [[r for b in t.rewards for r in b]]
        union.episodes += [[e for b in t.episodes for e in b]]
        union.dones += [sum(t.dones)]
    assert_window(finalized(merged), union.window(0, 2))


def test_options_disable_metrics():
    batches = collect(make_env(), 10, 40)
    metrics = CollectorBatchMetrics(episode_return=False, episode_length=False, done_key=None)
    for batch in batches:
        metrics.on_post_collect(None, batch)
    payload = metrics.pull()
    assert set(payload) == {"frames", "batches", "episodes_total", "reward", "episodes"}
    only_reward = CollectorBatchMetrics(
        done_key=None,
        terminated_key=None,
        truncated_key=None,
        episode_return=False,
        episode_length=False,
    )
    only_reward.on_post_collect(None, batches[0])
    assert set(only_reward.pull()) == {"frames", "batches", "episodes_total", "reward"}


def test_missing_key_at_the_first_batch_stops_only_the_metrics_needing_it(warnings_seen):
    batches = collect(make_env(), 4, 8)
    metrics = CollectorBatchMetrics(reward_key=("next", "rwd"))
    for batch in batches:
        metrics.on_post_collect(None, batch)  # no error: the rewards' metrics stop, the rest goes on
    (message,) = [m for m in warnings_seen if "('next', 'rwd')" in m]
    assert "reward_key=('next', 'rwd') (closest: ('next', 'reward'))" in message
    assert "('next', 'reward')" in message.split("keys present:")[1]
    assert "These metrics stopped: reward_mean, reward_std, reward_min, reward_max, episode_return_mean" in message
    reference = CollectorBatchMetrics(reward_key=None, episode_return=False)
    for batch in batches:
        reference.on_post_collect(None, batch)
    assert metrics.counters() == reference.counters()  # frames, batches, episodes: all counted
    pulled, expected = metrics.pull(), reference.pull()
    assert "reward" not in pulled and "episode_return" not in pulled
    assert pulled["episode_length"].finalize() == expected["episode_length"].finalize()
    # without any closing key, episodes stop too (and episodes_total is not logged as 0)
    later = batches[0].clone()
    del later["next", "done"], later["next", "terminated"], later["next", "truncated"]
    metrics = CollectorBatchMetrics()
    metrics.on_post_collect(None, later)
    (message,) = [m for m in warnings_seen if "done_key=('next', 'done')" in m]
    assert "dones" in message and "episode_length_mean" in message and "frames, batches and" in message
    assert set(metrics.pull()) == {"frames", "batches", "reward"}
    assert metrics.episode_arguments is None  # it follows no episode any more


@pytest.mark.parametrize(
    ("reward_sum", "key", "what"),
    [
        # running sums: plain CPU batches take the staged fast path after the first one
        (False, ("next", "truncated"), "truncated_key"),
        (False, ("next", "terminated"), "terminated_key"),
        (False, ("next", "done"), "done_key"),
        (False, ("next", "step_count"), "step_count_key"),
        (False, ("collector", "traj_ids"), "traj_ids_key"),
        # RewardSum / StepCounter entries, read at closing steps
        (True, ("next", "truncated"), "truncated_key"),
        (True, ("next", "episode_reward"), "episode_reward_key"),
        (True, ("next", "reward"), "reward_key"),
    ],
)
def test_a_key_of_the_first_batch_missing_from_a_later_one(reward_sum, key, what, warnings_seen):
    # Keys are resolved at the first batch; a later batch without one of them fails with
    # the missing-key error of the first batch, and folds nothing.
    batches = collect(make_env(reward_sum=reward_sum), 10, 30)
    assert all(key in b.keys(include_nested=True) for b in batches)
    later = batches[2].clone()
    del later[key]
    metrics = CollectorBatchMetrics()
    for batch in batches[:2]:
        metrics.on_post_collect(None, batch)
    if not reward_sum:  # the later batch is not plain: the fast path hands it to the generic one
        assert isinstance(metrics._ring_fold.ring.plain, episodes_module.PlainStage)
    counters = metrics.counters()
    with pytest.raises(MissingKeyError) as info:
        metrics.on_post_collect(None, later)
    message = str(info.value)
    present = sorted(later.keys(include_nested=True, leaves_only=True), key=str)
    assert message.startswith(f"CollectorBatchMetrics: {what}={key!r} is not in the data; ")
    assert ", ".join(repr(k) for k in present) in message
    assert f"Pass CollectorBatchMetrics({what}=...)" in message
    if what in ("done_key", "reward_key"):  # required: the first batch stops what needs it, loudly
        CollectorBatchMetrics().on_post_collect(None, later)
        assert [m for m in warnings_seen if f"{what}={key!r} (closest: " in m]
    # Nothing of the failed batch was folded: the set goes on as if it had not been given.
    assert metrics.counters() == counters
    metrics.on_post_collect(None, batches[2])
    reference = CollectorBatchMetrics()
    for batch in batches:
        reference.on_post_collect(None, batch)
    assert metrics.counters() == reference.counters()
    assert _finalized(metrics.pull()) == _finalized(reference.pull())


def _finalized(payload):
    return {
        name: value.finalize() if hasattr(value, "finalize") else value
        for name, value in payload.items()
    }


def test_configuration_is_validated():
    with pytest.raises(TypeError, match="reward_key must be"):
        CollectorBatchMetrics(reward_key=["next", "reward"])
    with pytest.raises(TypeError, match="episode_return must be a bool"):
        CollectorBatchMetrics(episode_return=1)
    with pytest.raises(ValueError, match="at least one of done_key"):
        CollectorBatchMetrics(done_key=None, terminated_key=None, truncated_key=None)
    with pytest.raises(ValueError, match="needs reward_key or episode_reward_key"):
        CollectorBatchMetrics(reward_key=None, episode_reward_key=None)
    with pytest.raises(TypeError, match="priority_weight must be a bool"):
        SampleMetrics(priority_weight="yes")
    with pytest.raises(TypeError, match="reward_key must be"):
        WriteMetrics(reward_key=3)


@pytest.mark.parametrize("running", [True, False])
def test_steps_with_several_entries_have_episodes_per_entry(running):
    # Two entries per step (agents, nested envs): each has its own episodes. A done with one
    # value per step closes every entry's episode; one per entry closes that entry's only.
    reward = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]).unsqueeze(-1)
    done = torch.tensor([[False, False], [True, False], [False, False], [False, True]])
    batch = TensorDict({"next": {"reward": reward, "done": done.unsqueeze(-1)}}, [4])
    if not running:  # RewardSum / StepCounter entries, read at closing steps
        since = torch.tensor([[1.0, 10.0], [3.0, 30.0], [3.0, 60.0], [7.0, 100.0]]).unsqueeze(-1)
        batch["next", "episode_reward"] = since
        batch["next", "step_count"] = torch.tensor([[1, 1], [2, 2], [1, 3], [2, 4]]).unsqueeze(-1)
    metrics = CollectorBatchMetrics()
    metrics.on_post_collect(None, batch)
    payload = metrics.pull()
    assert payload["reward"].count == 8  # every entry of every step
    assert payload["episodes"].finalize() == {"episodes": 2.0}
    assert sorted([payload["episode_return"].min, payload["episode_return"].max]) == [3.0, 100.0]
    assert payload["episode_length"].finalize()["episode_length_max"] == 4.0
    assert payload["frames"] == 4.0
    shared = batch.clone()
    shared["next", "done"] = done[:, :1].unsqueeze(-1)  # one done per step: closes both
    metrics = CollectorBatchMetrics(episode_reward_key=None, step_count_key=None)
    metrics.on_post_collect(None, shared)
    assert metrics.pull()["episode_return"].finalize()["episode_return_max"] == 30.0
    mismatched = batch.clone()
    mismatched["next", "done"] = torch.zeros(4, 3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="entries of one step to agree"):
        CollectorBatchMetrics().on_post_collect(None, mismatched)


def test_collector_fold_never_reads_a_value_on_the_host():
    # Meta tensors have no data: .item(), bool(), .tolist(), nonzero and boolean
    # indexing all raise. Folding real batches moved to meta must still work.
    plain = collect(make_env(batch_size=(2,)), 6, 24)
    padded = collect(make_env(batch_size=(2,)), 8, 120, trajs_per_batch=2, traj_format="padded")
    for batches, kwargs in ((plain, {}), (plain, {"episode_reward_key": None}), (padded, {})):
        metrics = CollectorBatchMetrics(**kwargs)
        for batch in batches:
            metrics.on_post_collect(None, batch.to("meta"))
        assert metrics.counters()["batches"] == len(batches)
        with pytest.raises((NotImplementedError, RuntimeError)):
            metrics.pull()  # the one place values are read


@pytest.mark.filterwarnings("ignore:split_trajs=True produces:UserWarning")
def test_split_and_interleaved_folds_never_read_a_value_on_the_host():
    import types

    split = collect(make_env(batch_size=(2,), max_steps=40), 10, 100, split_trajs=True)
    rows = collect(make_env(batch_size=(3,)), 12, 120)
    interleaved = []
    for batch in rows:  # [3, 4] -> [12], the envs' steps interleaved
        flat = batch.transpose(0, 1).reshape(-1)
        flat["env_index"] = torch.arange(3).repeat(4)
        interleaved.append(flat)
    on_cpu = CollectorBatchMetrics(step_count_key=None)
    for batch in interleaved:
        on_cpu.on_post_collect(None, batch)
    assert_window(finalized(on_cpu.pull()), Truth(rows).window(0, len(rows)))
    for batches, source in ((split, None), (interleaved, types.SimpleNamespace(_num_envs=3))):
        metrics = CollectorBatchMetrics(step_count_key=None)
        if source is not None:
            metrics.bind(source)
        for batch in batches:
            metrics.on_post_collect(None, batch.to("meta"))
        assert metrics.counters()["batches"] == len(batches)
        with pytest.raises((NotImplementedError, RuntimeError)):
            metrics.pull()


def test_rings_of_batches_never_read_a_value_on_the_host():
    # More batches than a ring holds: the running sums of full rings are computed inside
    # on_post_collect, for plain, padded and RewardSum/StepCounter batches, on meta tensors.
    plain = collect(make_env(batch_size=(2,)), 6, 240)
    padded = collect(make_env(batch_size=(2,)), 8, 320, trajs_per_batch=2, traj_format="padded")
    summed = collect(make_env(batch_size=(2,), reward_sum=True), 6, 240)
    cases = ((plain, {}), (padded, {}), (summed, {"episode_reward_key": None}), (summed, {}))
    for batches, kwargs in cases:
        assert len(batches) > episodes_module._RING_BATCHES
        metrics = CollectorBatchMetrics(**kwargs)
        for batch in batches:
            metrics.on_post_collect(None, batch.to("meta"))
        assert metrics.counters()["batches"] == len(batches)
        with pytest.raises((NotImplementedError, RuntimeError)):
            metrics.pull()


def test_observed_counters_lag_until_the_copy_completes():
    class Event:  # stands in for torch.cuda.Event on a CPU-only machine
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    counters = ObservedCounters(("frames", "episodes"))
    first, second = Event(), Event()
    counters._pending.append((("episodes",), torch.tensor([3]), first))
    counters._pending.append((("frames", "episodes"), torch.tensor([10, 1]), second))
    counters.add("frames", 5)
    assert counters.poll() == {"frames": 5, "episodes": 0}
    second.done = True
    assert counters.poll() == {"frames": 5, "episodes": 0}  # in order: waits for the first
    first.done = True
    assert counters.poll() == {"frames": 15, "episodes": 4}
    counters._pending.append((("episodes",), torch.tensor([2]), Event()))
    assert counters.drain() == {"frames": 15, "episodes": 6}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_fold_without_sync():
    batches = collect(make_env(batch_size=(4,)), 16, 320)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics()
    cuda_batches = [b.to("cuda") for b in batches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in cuda_batches:
            metrics.on_post_collect(None, batch)
        counters = metrics.counters()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counters["frames"] == 320 and counters["batches"] == 20
    assert counters["episodes"] <= sum(len(e) for e in truth.episodes)  # observed, may lag
    assert_window(finalized(metrics.pull()), truth.window(0, len(batches)))
    assert metrics.counters()["episodes"] == sum(len(e) for e in truth.episodes)


def test_metric_sets_declare_their_events():
    assert CollectorBatchMetrics.events == ("post_collect",)
    assert SampleMetrics.events == ("post_add", "post_extend", "post_sample")
    assert WriteMetrics.events == ("post_add", "post_extend")
    for cls in (CollectorBatchMetrics, SampleMetrics, WriteMetrics):
        assert issubclass(cls, MetricSet)
        defined = {name[3:] for name in dir(cls) if name.startswith("on_")}
        assert defined - {"empty"} == set(cls.events)  # on_empty: a hook, not a folded event


def test_terminated_or_truncated_close_an_episode_even_without_done():
    def batch(reward, done, terminated, truncated):
        flag = lambda v: torch.tensor(v).unsqueeze(-1)  # noqa: E731
        return TensorDict(
            {
                "next": {
                    "reward": flag(reward).float(),
                    "done": flag(done),
                    "terminated": flag(terminated),
                    "truncated": flag(truncated),
                }
            },
            [len(reward)],
        )

    metrics = CollectorBatchMetrics()
    f, t = False, True
    metrics.on_post_collect(
        None, batch([1.0, 2.0, 4.0, 8.0], [f, f, f, f], [f, t, f, f], [f, f, f, t])
    )
    metrics.on_post_collect(None, batch([16.0, 32.0], [f, t], [f, f], [f, f]))
    got = finalized(metrics.pull())
    assert got["episodes"] == 3 and got["dones"] == 1
    assert (got["episode_return_min"], got["episode_return_max"]) == (3.0, 48.0)
    assert got["episode_return_mean"] == pytest.approx((3.0 + 12.0 + 48.0) / 3)
    assert (got["episode_length_min"], got["episode_length_max"]) == (2.0, 2.0)
