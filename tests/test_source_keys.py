"""Default keys follow the source: reward and done keys from the collector's env specs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import (
    CountingEnv,
    HeterogeneousCountingEnv,
    MultiAgentCountingEnv,
    MultiKeyCountingEnv,
    NestedCountingEnv,
)

import rl_observers  # noqa: F401  (adds add_observer)
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    default_metrics,
)
from rl_observers.metrics.keys import keys_from_source

from .helpers import scalars

ENVS = {
    "nested": (
        lambda: NestedCountingEnv(max_steps=4),
        ("next", "data", "reward"),
        ("next", "data", "done"),
    ),
    "nested_reward_only": (
        lambda: NestedCountingEnv(max_steps=4, nest_done=False, nest_reward=True),
        ("next", "data", "reward"),
        ("next", "done"),
    ),
    "multi_key": (lambda: MultiKeyCountingEnv(max_steps=4), ("next", "reward"), ("next", "done")),
    "heterogeneous": (
        lambda: HeterogeneousCountingEnv(max_steps=4),
        ("next", "lazy", "reward"),
        ("next", "lazy", "done"),
    ),
    "multi_agent": (
        lambda: MultiAgentCountingEnv(n_agents=2, max_steps=4),
        ("next", "agents", "agent_0", "reward"),
        ("next", "agents", "agent_0", "done"),
    ),
    "counting": (lambda: CountingEnv(max_steps=4), ("next", "reward"), ("next", "done")),
}


def _collector(make_env, frames=40):
    env = make_env()
    return Collector(
        env, RandomPolicy(env.full_action_spec), frames_per_batch=10, total_frames=frames
    )


def _closing(batch, metrics, entries):
    """``[T, entries]``: where an episode of each entry closes (the ground truth)."""
    present = set(batch.keys(True, True))
    closing = torch.zeros(batch.numel(), entries, dtype=torch.bool)
    for key in (metrics.done_key, metrics.terminated_key, metrics.truncated_key):
        if key is not None and key in present:
            flags = batch.get(key).reshape(batch.numel(), -1)
            closing |= flags.any(-1, keepdim=True) if entries == 1 else flags.expand(-1, entries)
    return closing


@pytest.mark.parametrize("case", list(ENVS))
def test_default_keys_come_from_the_env_specs(case):
    make_env, reward_key, done_key = ENVS[case]
    collector = _collector(make_env)
    try:
        (metrics,) = default_metrics(collector)
        assert (metrics.reward_key, metrics.done_key) == (reward_key, done_key)
        explicit = CollectorBatchMetrics(reward_key=("next", "reward"), done_key=None)
        explicit.bind(collector)
        assert (explicit.reward_key, explicit.done_key) == (("next", "reward"), None)
        rewards, frames, episodes = [], 0, 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for batch in collector:
                metrics.on_post_collect(collector, batch)
                reward = batch.get(reward_key).reshape(batch.numel(), -1)
                rewards += reward.reshape(-1).tolist()
                frames += batch.numel()
                episodes += int(_closing(batch, metrics, reward.shape[-1]).sum())
        payload = metrics.pull()
        assert payload["frames"] == frames
        assert payload["reward"].count == len(rewards)
        assert payload["reward"].mean == pytest.approx(sum(rewards) / len(rewards))
        assert payload["episodes"].n == payload["episode_return"].count == episodes > 0
    finally:
        collector.shutdown()


def test_unbound_sets_and_sources_without_an_env_keep_the_usual_keys():
    metrics = CollectorBatchMetrics()
    assert metrics.reward_key == ("next", "reward")
    metrics.bind(object())  # no env here: nothing changes
    assert metrics.done_key == ("next", "done")
    assert keys_from_source(object()) is None


def test_an_observer_binds_its_sets_when_attached(tmp_path):
    logger = CSVLogger(exp_name="keys", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector = _collector(ENVS["nested"][0])
    try:
        collector.add_observer(
            LoggerObserver(
                channel, schedule=Every.counter("frames", 20), metrics=CollectorBatchMetrics()
            ),
            on_error="raise",
        )
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert channel.close()
    assert [step for step, _ in scalars(logger, "collector/reward_mean")] == [20, 40]
    assert scalars(logger, "collector/episodes")


@pytest.mark.real_collector
@pytest.mark.slow
def test_multiprocessing_workers_bind_their_copies(tmp_path):
    logger = CSVLogger(exp_name="keys_mp", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    env = NestedCountingEnv(max_steps=4)
    collector = MultiSyncCollector(
        [lambda: NestedCountingEnv(max_steps=4)] * 2,
        RandomPolicy(env.full_action_spec),
        frames_per_batch=20,
        total_frames=80,
    )
    try:
        collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 40)))
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert channel.flush(timeout=20)
    assert channel.close()
    means = scalars(logger, "collector/reward_mean")
    assert means and all(torch.isfinite(torch.tensor(v)) for _, v in means)
