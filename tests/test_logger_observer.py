"""LoggerObserver end to end: real collectors and buffers, real loggers, values checked against the data."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger, TensorboardLogger
from torchrl.record.loggers.monitoring import LoggerMonitor

from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)
from tests.helpers import scalars


@pytest.fixture
def logger(tmp_path):
    return CSVLogger(exp_name="test", log_dir=str(tmp_path))


@pytest.fixture
def channel(logger):
    channel = MetricsChannel(logger, health_interval=None)
    yield channel
    channel.close(timeout=10)


def pendulum_collector(frames_per_batch=150, total_frames=900):
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    return Collector(env, RandomPolicy(env.action_spec), frames_per_batch=frames_per_batch, total_frames=total_frames)


def episodes_of(batches):
    """Ground truth: every completed episode's (return, length), walking frames in order."""
    episodes, running, length = [], 0.0, 0
    for batch in batches:
        rewards = batch["next", "reward"].reshape(-1).tolist()
        dones = batch["next", "done"].reshape(-1).tolist()
        for reward, done in zip(rewards, dones):
            running += reward
            length += 1
            if done:
                episodes.append((running, length))
                running, length = 0.0, 0
    return episodes


def test_collector_metrics_match_the_batches(logger, channel):
    collector = pendulum_collector()
    collector.add_observer(LoggerObserver(channel, metrics=CollectorBatchMetrics(), schedule=None))  # every batch
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert channel.flush(timeout=30)
    frames = [step for step, _ in scalars(logger, "collector/frames")]
    assert frames == [150 * (i + 1) for i in range(6)]
    reward_means = [value for _, value in scalars(logger, "collector/reward_mean")]
    expected = [batch["next", "reward"].double().mean().item() for batch in batches]
    assert reward_means == pytest.approx(expected, rel=1e-6)
    reward_max = [value for _, value in scalars(logger, "collector/reward_max")]
    assert reward_max == pytest.approx([b["next", "reward"].max().item() for b in batches], rel=1e-6)
    # Pendulum truncates at 200 steps: episodes span batches (150 frames each)
    truth = episodes_of(batches)
    assert [length for _, length in truth] == [200, 200, 200, 200]
    logged_returns = [value for _, value in scalars(logger, "collector/episode_return_mean")]
    logged_counts = [value for _, value in scalars(logger, "collector/episodes")]
    assert sum(logged_counts) == len(truth) == 4
    assert sorted(logged_returns) == pytest.approx(sorted(r for r, _ in truth), rel=1e-6)
    assert {v for _, v in scalars(logger, "collector/episode_length_mean")} == {200.0}


def test_counter_schedule_and_log_on_close(logger, channel):
    collector = pendulum_collector(frames_per_batch=100, total_frames=1000)
    observer = LoggerObserver(channel, schedule=Every.counter("frames", 300))
    collector.add_observer(observer)
    batches = [batch.clone() for batch in collector]
    collector.shutdown()  # log_on_close: the last partial window (frames 901..1000)
    assert channel.flush(timeout=30)
    steps = [step for step, _ in scalars(logger, "collector/frames")]
    assert steps == [300, 600, 900, 1000]
    # every batch was folded: the windows' reward means weighted by frames give the overall mean
    means = [v for _, v in scalars(logger, "collector/reward_mean")]
    overall = sum(m * n for m, n in zip(means, [300, 300, 300, 100])) / 1000
    truth = torch.cat([b["next", "reward"].reshape(-1) for b in batches]).double().mean().item()
    assert overall == pytest.approx(truth, rel=1e-6)


def test_schedule_none_emits_every_write_and_sample(logger, channel):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    rb.add_observer(LoggerObserver(channel, metrics=[WriteMetrics(), SampleMetrics()], schedule=None))
    for _ in range(3):
        rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
        rb.sample(4)
    assert channel.flush(timeout=10)
    assert [s for s, _ in scalars(logger, "replay_buffer/items_written")] == [10, 10, 20, 20, 30, 30]
    assert [v for _, v in scalars(logger, "replay_buffer/samples_returned")] == [0, 4, 4, 8, 8, 12]


def test_namespaces_keep_their_own_steps(logger, channel):
    collector = pendulum_collector(frames_per_batch=100, total_frames=300)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 100)))
    rb.add_observer(LoggerObserver(channel, schedule=Every.counter("sample_calls", 2), metrics=SampleMetrics()))
    rb.add_observer(
        LoggerObserver(channel, schedule=Every.counter("write_count", 100), metrics=WriteMetrics(), name="rb_writes")
    )
    for batch in collector:
        rb.extend(batch)
        for _ in range(2):
            rb.sample(8)
    collector.shutdown()
    assert channel.flush(timeout=30)
    assert [s for s, _ in scalars(logger, "collector/frames")] == [100, 200, 300]
    assert [s for s, _ in scalars(logger, "replay_buffer/sample_calls")] == [2, 4, 6]
    assert [s for s, _ in scalars(logger, "rb_writes/items_written")] == [100, 200, 300]


def test_seconds_schedule_and_log_on_start(logger, channel, monkeypatch):
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    observer = LoggerObserver(
        channel, schedule=Every.seconds(3600), metrics=WriteMetrics(), log_on_start=True, log_on_close=False
    )
    rb.add_observer(observer)
    for _ in range(5):
        rb.extend(torch.arange(4))
    assert channel.flush(timeout=10)
    # log_on_start emitted once (the step is write_count); the hour has not passed since
    assert scalars(logger, "replay_buffer/writes") == [(4, 1.0)]
    observer._clock.last_time -= 3601  # an hour later
    rb.extend(torch.arange(4))
    assert channel.flush(timeout=10)
    assert scalars(logger, "replay_buffer/writes") == [(4, 1.0), (24, 6.0)]


def test_removal_and_channel_close_emit_the_last_window(logger):
    channel = MetricsChannel(logger, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    first = rb.add_observer(LoggerObserver(channel, schedule=Every.counter("write_count", 1000), metrics=WriteMetrics(), name="a"))
    rb.add_observer(LoggerObserver(channel, schedule=Every.counter("write_count", 1000), metrics=WriteMetrics(), name="b"))
    rb.extend(torch.arange(7))
    first.remove()
    rb.extend(torch.arange(3))
    channel.close(timeout=10)
    assert scalars(logger, "a/items_written") == [(7, 7.0)]
    assert scalars(logger, "b/items_written") == [(10, 10.0)]


def test_a_write_folded_during_another_threads_emission_is_logged_at_removal():
    # Thread B's write is due and pulls (slowly); the main thread's write folds meanwhile
    # (it waits on the set's lock) and is not due: removal still logs its window.
    import threading
    import time

    from rl_observers import MetricSet

    started, slow = threading.Event(), threading.Event()

    class Items(MetricSet):
        counter_names = ("n",)

        def on_post_extend(self, source, data, index):
            self.add_to_counter("n", 1)
            self.count("items").add(len(data))

        def pull(self):
            with self._lock:
                if slow.is_set():
                    slow.clear()
                    started.set()
                    time.sleep(0.3)
                return super().pull()

    calls = []

    class Recorder:
        def log_metrics(self, metrics, step=None):
            calls.append(dict(metrics))

    channel = MetricsChannel(Recorder(), background=False, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    handle = rb.add_observer(LoggerObserver(channel, schedule=Every.counter("n", 2), metrics=Items()))
    rb.extend(torch.arange(1))
    slow.set()
    writer = threading.Thread(target=rb.extend, args=(torch.arange(2),))  # n=2: due, pulls
    writer.start()
    assert started.wait(10)
    rb.extend(torch.arange(3))  # n=3 while the pull runs
    writer.join()
    handle.remove()
    channel.close(timeout=10)
    assert sum(m.get("replay_buffer/items", 0) for m in calls) == 6


def test_counter_going_backwards_rebaselines(logger, channel):
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    observer = LoggerObserver(channel, schedule=Every.counter("write_count", 10), metrics=WriteMetrics(), log_on_close=False)
    rb.add_observer(observer)
    rb.extend(torch.arange(25))  # 25 crosses 10 (primed at 0 when attached)
    rb.extend(torch.arange(6))  # 31 crosses 30
    saved = observer.state_dict()
    rb.extend(torch.arange(10))  # 41 crosses 40
    observer.load_state_dict(saved)  # counters go back to 31
    # 33 observed, but the buffer itself is at 43: the counters follow the source's own axis
    # (write_count), no garbage emission and no step below the last one
    rb.extend(torch.arange(2))
    rb.extend(torch.arange(8))  # 51 crosses 50
    assert channel.flush(timeout=10)
    steps = [s for s, _ in scalars(logger, "replay_buffer/items_written")]
    assert steps == [25, 31, 41, 51]
    assert all(v >= 0 for _, v in scalars(logger, "replay_buffer/items_written"))


def test_checkpoint_resume_neither_loses_nor_double_counts_an_episode(tmp_path):
    """A run split in two with state_dict/load_state_dict logs the same episodes as one run."""

    def run(split):
        torch.manual_seed(0)
        logger = CSVLogger(exp_name=f"split{split}", log_dir=str(tmp_path))
        channel = MetricsChannel(logger, health_interval=None)
        collector = pendulum_collector(frames_per_batch=150, total_frames=900)
        observer = LoggerObserver(channel, metrics=CollectorBatchMetrics(), schedule=None)
        handle = collector.add_observer(observer)
        for i, _ in enumerate(collector):
            if split and i == 1:  # mid-episode: 300 frames in, episode 2 has 100 steps
                state = observer.state_dict()
                handle.remove()
                # the removed observer freed its namespace: the resumed one goes on in it
                observer = LoggerObserver(channel, metrics=CollectorBatchMetrics(), schedule=None)
                handle = collector.add_observer(observer)
                observer.load_state_dict(state)
        collector.shutdown()
        channel.close(timeout=10)
        counts = [v for _, v in scalars(logger, "collector/episodes")]
        returns = [v for _, v in scalars(logger, "collector/episode_return_mean")]
        return sum(counts), sorted(returns)

    whole, split = run(False), run(True)
    assert whole[0] == split[0] == 4
    assert split[1] == pytest.approx(whole[1], rel=1e-9)


def test_missing_key_error_names_the_key(logger, channel, caplog):
    collector = pendulum_collector(frames_per_batch=50, total_frames=100)
    observer = LoggerObserver(channel, metrics=CollectorBatchMetrics(reward_key=("next", "rewrd")), schedule=None)
    # the env's specs prove it absent: refused when attached, the closest key named
    with pytest.raises(ValueError, match=r"rewrd.*closest: \('next', 'reward'\)"):
        collector.add_observer(observer, on_error="raise")
    assert collector.observers == ()
    collector.shutdown()
    collector = pendulum_collector(frames_per_batch=50, total_frames=100)
    # the first collector is still alive with its observer: this one needs its own name
    collector.add_observer(
        LoggerObserver(channel, metrics=CollectorBatchMetrics(reward_key="nope"), schedule=None, name="other")
    )
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        assert sum(b.numel() for b in collector) == 100  # warn: collection goes on
    assert len([r for r in caplog.records if "nope" in r.getMessage()]) == 1
    collector.shutdown()


def test_bad_arguments_fail_early(logger):
    with pytest.raises(TypeError, match="schedule must be an Every"):
        LoggerObserver(logger, schedule=10)
    with pytest.raises(ValueError, match="scope must be one of"):
        LoggerObserver(logger, scope="global", schedule=None)
    with pytest.raises(TypeError, match="metrics must be a MetricSet"):
        LoggerObserver(logger, metrics=[42], schedule=None)
    with pytest.raises(TypeError, match="expects a torchrl Logger"):
        LoggerObserver("runs/", schedule=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(ValueError, match="names the counter 'frames', which none of its metric sets"):
        rb.add_observer(LoggerObserver(logger, schedule=Every.counter("frames", 10)))
    assert rb.observers == ()


def test_one_observer_per_source(logger):
    observer = LoggerObserver(logger, metrics=WriteMetrics(), schedule=None)
    first = ReplayBuffer(storage=LazyTensorStorage(10))
    first.add_observer(observer)
    other = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(ValueError, match="one LoggerObserver per"):
        other.add_observer(observer)
    assert other.observers == () and first.observers == (observer,)


def test_attach_logger_is_add_observer(logger):
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    handle = rb.attach_logger(logger, schedule=Every.counter("sample_calls", 1))
    (observer,) = rb.observers
    assert isinstance(observer, LoggerObserver) and handle.observer is observer
    assert [type(m).__name__ for m in observer.metrics] == ["WriteMetrics", "SampleMetrics"]
    collector = pendulum_collector(frames_per_batch=50, total_frames=50)
    collector.attach_logger(logger, schedule=None)
    assert [type(m).__name__ for m in collector.observers[0].metrics] == ["CollectorBatchMetrics"]
    collector.shutdown()


def test_pull_monitor_and_observers_share_one_logger(logger):
    """LoggerMonitor derives samples_per_second from the observer's stats() entries."""
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    rb.attach_logger(logger, schedule=Every.counter("sample_calls", 10))
    collector = pendulum_collector(frames_per_batch=100, total_frames=300)
    collector.attach_logger(logger, schedule=None)
    monitor = LoggerMonitor(logger, background=False)
    monitor.watch(rb, name="rb_monitor", log_on_start=True)
    monitor.watch(collector, name="collector_monitor", log_on_start=True)
    monitor.step()
    for batch in collector:
        rb.extend(batch)
        for _ in range(10):
            rb.sample(16)
    logged = monitor.step()
    collector.shutdown()
    MetricsChannel.for_logger(logger).flush(timeout=30)
    assert logged["rb_monitor"]["rb_monitor/sample_calls"] == 30
    assert logged["rb_monitor"]["rb_monitor/samples_per_second"] > 0
    assert "rb_monitor/seconds_since_last_write" in logged["rb_monitor"]
    assert [s for s, _ in scalars(logger, "replay_buffer/sample_calls")] == [10, 20, 30]
    assert scalars(logger, "collector/frames")[-1][0] == 300


def test_tensorboard_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorboardLogger(exp_name="tb", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    collector = pendulum_collector(frames_per_batch=200, total_frames=600)
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 200)))
    for _ in collector:
        pass
    collector.shutdown()
    channel.close(timeout=10)
    logger.experiment.flush()
    accumulator = EventAccumulator(str(logger.experiment.log_dir))
    accumulator.Reload()
    events = accumulator.Scalars("collector/episode_return_mean")
    assert [e.step for e in events] == [200, 400, 600]
    assert all(math.isfinite(e.value) and e.value < 0 for e in events)  # Pendulum rewards are negative


def test_one_namespace_is_refused_on_one_logger_through_two_channels(tmp_path):
    logger = CSVLogger(exp_name="two_channels", log_dir=str(tmp_path))
    first = ReplayBuffer(storage=LazyTensorStorage(10))
    second = ReplayBuffer(storage=LazyTensorStorage(10))
    first.add_observer(LoggerObserver(logger))  # the logger's own channel
    other = MetricsChannel(logger)
    with pytest.raises(ValueError, match="namespace 'replay_buffer'.* is already used on this logger"):
        second.add_observer(LoggerObserver(other))
    second.add_observer(LoggerObserver(other, name="second"))
    other.close(10)
    MetricsChannel.for_logger(logger).close(10)
