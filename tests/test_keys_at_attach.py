"""Keys checked when an observer is attached: a typo the specs prove absent is refused there.

Where the specs cannot tell (a ``postproc``, a policy without declared
``out_keys`` for a root key), the first batch checks the key, loudly, and
only the metrics that need it stop: every row of what keeps counting is
compared with a truth computed here from the collected batches.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel, WriteMetrics
from tests.helpers import scalars


@pytest.fixture
def logger(tmp_path):
    return CSVLogger(exp_name="keys", log_dir=str(tmp_path))


def test_a_reward_key_typo_is_refused_at_attach_on_cartpole(logger):
    env = GymEnv("CartPole-v1")
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=100)
    observer = LoggerObserver(logger, metrics=CollectorBatchMetrics(reward_key=("next", "rewardz")))
    with pytest.raises(ValueError) as refused:
        collector.add_observer(observer)
    message = str(refused.value)
    assert message.startswith("CollectorBatchMetrics: reward_key=('next', 'rewardz') is not in the data")
    assert "('next', 'reward'), ('next', 'terminated')" in message  # the keys present
    assert "closest: ('next', 'reward')" in message
    assert collector.observers == ()
    collector.shutdown()


def test_a_root_key_is_refused_when_the_policy_declares_its_out_keys(logger):
    env = CountingEnv(max_steps=7)
    policy = TensorDictModule(lambda obs: torch.ones_like(obs), in_keys=["observation"], out_keys=["action"])
    collector = Collector(env, policy, frames_per_batch=20, total_frames=40)
    with pytest.raises(ValueError, match=r"done_key='don' .* closest: 'done'"):
        collector.add_observer(LoggerObserver(logger, metrics=CollectorBatchMetrics(done_key="don")))
    # the same root key with a RandomPolicy (no out_keys declared): the specs cannot tell
    other = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=20, total_frames=40)
    other.add_observer(LoggerObserver(logger, metrics=CollectorBatchMetrics(done_key="don"), name="other"))
    collector.shutdown()
    other.shutdown()
    assert MetricsChannel.for_logger(logger).close(timeout=30)


def test_where_specs_cannot_tell_the_first_batch_stops_only_what_needs_the_key(logger, warnings_seen):
    env = CountingEnv(max_steps=7)
    collector = Collector(
        env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=300,
        postproc=lambda batch: batch,  # a postproc may add keys: nothing is provable at attach
    )
    collector.add_observer(
        LoggerObserver(
            logger,
            schedule=Every.counter("frames", 100),
            metrics=CollectorBatchMetrics(reward_key=("next", "rewardz")),
        )
    )
    truth = []  # (frames, dones) of each batch, from the data itself
    collector.add_observer(lambda batch: truth.append((batch.numel(), int(batch["next", "done"].sum()))))
    for _ in collector:
        pass
    collector.shutdown()
    assert MetricsChannel.for_logger(logger).close(timeout=30)
    (told,) = [m for m in warnings_seen if "rewardz" in m]
    assert "closest: ('next', 'reward')" in told
    assert "These metrics stopped: reward_mean, reward_std, reward_min, reward_max, " in told
    assert "episode_return_mean" in told and "frames, batches, episodes and the others keep counting" in told
    frames = [sum(n for n, _ in truth[: 2 * (i + 1)]) for i in range(3)]
    episodes = [sum(d for _, d in truth[: 2 * (i + 1)]) for i in range(3)]
    assert scalars(logger, "collector/frames") == [(f, float(f)) for f in frames]
    assert scalars(logger, "collector/episodes_total") == [(f, float(e)) for f, e in zip(frames, episodes)]
    assert scalars(logger, "collector/batches") == [(f, float(2 * (i + 1))) for i, f in enumerate(frames)]
    assert not [name for name in logger.experiment.scalars if "reward" in name or "return" in name]
    assert len(scalars(logger, "collector/episode_length_mean")) == 3


def test_a_replay_buffer_checks_its_storage_once_it_holds_data(logger):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    rb.extend(TensorDict({"obs": torch.zeros(4), "next": {"reward": torch.ones(4, 1)}}, batch_size=[4]))
    with pytest.raises(ValueError, match=r"reward_key='reward' .* closest: \('next', 'reward'\)"):
        rb.add_observer(LoggerObserver(logger, metrics=[WriteMetrics(reward_key="reward")]))
    assert rb.observers == ()
    # an empty-string key is a key like any other: refused here, not at the first write
    with pytest.raises(ValueError, match=r"reward_key='' is not in the data"):
        rb.add_observer(LoggerObserver(logger, metrics=[WriteMetrics(reward_key="")]))
    assert rb.observers == ()
    # an empty storage cannot tell yet: attached, the first write checks the key
    empty = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    empty.add_observer(LoggerObserver(logger, metrics=[WriteMetrics(reward_key=("next", "reward"))], name="empty"))
    assert len(empty.observers) == 1
    assert MetricsChannel.for_logger(logger).close(timeout=30)
