"""What a new user meets on day one: quiet defaults, RFC namespaces, aligned steps, sets failing alone.

The mistakes themselves (and their exact messages) are in
``tests/test_common_mistakes.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    Mean,
    MetricsChannel,
    MetricSet,
    SampleMetrics,
    WriteMetrics,
    default_schedule,
)
from tests.helpers import RecordingLogger, scalars


@pytest.fixture
def logger(tmp_path):
    return CSVLogger(exp_name="day_one", log_dir=str(tmp_path))


def collector(frames_per_batch=100, total_frames=1000):
    env = CountingEnv(max_steps=7)
    return Collector(env, RandomPolicy(env.action_spec), frames_per_batch=frames_per_batch, total_frames=total_frames)


# -- defaults that do not flood ------------------------------------------------------------------


def test_default_buffer_schedule_does_not_write_a_row_per_sample(logger):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000))
    handle = rb.attach_logger(logger)
    rb.extend(TensorDict(obs=torch.arange(100.0), batch_size=[100]))
    for _ in range(1000):
        rb.sample(8)
    handle.remove()  # log_on_close: the last partial window (none left here)
    assert MetricsChannel.for_logger(logger).close(timeout=10)
    steps = [s for s, _ in scalars(logger, "replay_buffer/sample_calls")]
    assert steps == [100 * (i + 1) for i in range(10)]  # 10 rows for 1,000 samples, not 1,001
    assert not any(name.startswith("channel/") for name in logger.experiment.scalars)


def test_default_collector_schedule_is_every_1000_frames(logger):
    source = collector(frames_per_batch=100, total_frames=2500)
    source.attach_logger(logger)
    for _ in source:
        pass
    source.shutdown()
    assert MetricsChannel.for_logger(logger).close(timeout=10)
    assert [s for s, _ in scalars(logger, "collector/frames")] == [1000, 2000, 2500]  # last: at shutdown


def test_default_schedule_per_kind_and_metric_sets():
    rb = ReplayBuffer(storage=LazyTensorStorage(4))
    assert default_schedule(rb) == Every.counter("sample_calls", 100)
    assert default_schedule(rb, [WriteMetrics()]) == Every.counter("items_written", 1000)
    source = collector()
    assert default_schedule(source) == Every.counter("frames", 1000)
    source.shutdown()


def test_channel_health_is_quiet_until_something_is_wrong():
    sink = RecordingLogger()
    channel = MetricsChannel(sink, background=False, health_interval=0.0)
    channel.submit_metrics({"x": 1.0}, namespace="a")
    channel.step()
    assert channel.close()
    assert sink.health_calls() == []
    sink = RecordingLogger()
    channel = MetricsChannel(sink, background=False, health_interval=0.0, on_error="ignore")
    sink.broken = True
    channel.submit_metrics({"x": 1.0}, namespace="a")
    channel.step()
    sink.broken = False
    channel.submit_metrics({"x": 2.0}, namespace="a")
    channel.step()
    ((health, _),) = sink.health_calls()
    assert health["channel/sink_errors"] == 1
    assert not channel.close()  # an entry failed since the last flush


def test_flush_and_close_never_say_true_when_the_sink_failed():
    sink = RecordingLogger()
    sink.broken = True
    channel = MetricsChannel(sink, health_interval=None)
    channel.submit_metrics({"x": 1.0})
    assert channel.flush(timeout=10) is False
    assert channel.health()["logged"] == 0 and channel.health()["sink_errors"] == 1
    sink.broken = False
    channel.submit_metrics({"x": 2.0})
    assert channel.flush(timeout=10) is True  # recovered: nothing failed since the last flush
    sink.broken = True
    channel.submit_metrics({"x": 3.0})
    assert channel.close(timeout=10) is False


# -- namespaces -----------------------------------------------------------------------------------


def test_namespaces_follow_the_kind_not_the_torchrl_class(logger):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    rb.attach_logger(logger, schedule=Every.counter("sample_calls", 1))
    rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
    rb.sample(4)
    assert MetricsChannel.for_logger(logger).close(timeout=10)
    assert scalars(logger, "replay_buffer/sample_calls") == [(1, 1.0)]


def test_a_name_is_free_again_once_its_observer_is_removed(logger):
    first, second = ReplayBuffer(storage=LazyTensorStorage(10)), ReplayBuffer(storage=LazyTensorStorage(10))
    handle = first.attach_logger(logger)
    with pytest.raises(ValueError, match="pass name= to tell them apart"):
        second.attach_logger(logger)
    assert second.observers == ()
    second.attach_logger(logger, name="replay_buffer_2")
    handle.remove()
    first.attach_logger(logger)  # "replay_buffer" is free again


# -- steps ----------------------------------------------------------------------------------------


def test_buffer_metrics_logged_against_the_collector_frames(logger):
    channel = MetricsChannel(logger, health_interval=None)
    source = collector(frames_per_batch=100, total_frames=300)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    source.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 100)))
    rb.add_observer(LoggerObserver(channel, schedule=Every.counter("sample_calls", 2), step=source))
    for batch in source:
        rb.extend(batch)
        rb.sample(8)
        rb.sample(8)
    source.shutdown()
    assert channel.close(timeout=10)
    assert [v for _, v in scalars(logger, "collector/frames")] == [100.0, 200.0, 300.0]
    assert [s for s, _ in scalars(logger, "replay_buffer/sample_calls")] == [100, 200, 300]


def test_step_from_a_callable_the_user_owns(logger):
    channel = MetricsChannel(logger, health_interval=None)
    optimizer_steps = [0]
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    rb.add_observer(
        LoggerObserver(channel, schedule=Every.counter("sample_calls", 1), step=lambda: optimizer_steps[0])
    )
    rb.extend(torch.arange(10))
    for _ in range(3):
        rb.sample(4)
        optimizer_steps[0] += 5
    assert channel.close(timeout=10)
    assert [s for s, _ in scalars(logger, "replay_buffer/sample_calls")] == [0, 5, 10]


def test_a_bad_step_is_refused(logger):
    with pytest.raises(TypeError, match="step must be a counter name"):
        LoggerObserver(logger, step=3)


# -- metric sets fail alone -----------------------------------------------------------------------


class Broken(MetricSet):
    counter_names = ("broken_calls",)

    def on_post_collect(self, source, batch):
        self.add_to_counter("broken_calls", 1)
        raise RuntimeError("a bug in a custom set")


def test_a_failing_metric_set_does_not_silence_the_others(logger, caplog):
    channel = MetricsChannel(logger, health_interval=None)
    source = collector(frames_per_batch=100, total_frames=300)
    healthy = Mean("obs_mean", lambda batch: batch["observation"].float())
    source.add_observer(
        LoggerObserver(
            channel, metrics=[Broken(), CollectorBatchMetrics(reward_key="nope"), healthy], schedule=None
        )
    )
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        assert sum(b.numel() for b in source) == 300
    source.shutdown()
    assert channel.close(timeout=10)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    broken = [w for w in warnings if "a bug in a custom set" in w]
    missing = [w for w in warnings if "reward_key='nope'" in w]
    assert len(broken) == 1 and len(missing) == 1  # once each
    # a key the first batch lacks stops only the metrics that need it, named
    assert "CollectorBatchMetrics" in missing[0] and "These metrics stopped: reward_mean" in missing[0]
    assert "frames, batches, episodes and the others keep counting" in missing[0]
    assert "MissingKeyError" not in missing[0]
    # the healthy set logs every window; the failing one logs no rows of zeros; the set
    # missing its reward key still counts frames and episodes
    assert len(scalars(logger, "collector/obs_mean")) == 3
    assert not scalars(logger, "collector/broken_calls")
    assert [v for _, v in scalars(logger, "collector/frames")] == [100.0, 200.0, 300.0]
    assert len(scalars(logger, "collector/episodes")) == 3
    assert not scalars(logger, "collector/reward_mean")


class FailsOnce(MetricSet):
    """Counts batches, but raises on the second one before counting it."""

    counter_names = ("calls",)

    def __init__(self):
        super().__init__()
        self.seen = 0

    def on_post_collect(self, source, batch):
        self.seen += 1
        if self.seen == 2:
            raise RuntimeError("a transient bug")
        self.add_to_counter("calls", 1)


def test_a_failing_set_skips_its_windows_and_logs_them_once_it_recovers(logger):
    channel = MetricsChannel(logger, health_interval=None)
    source = collector(frames_per_batch=100, total_frames=300)
    source.add_observer(LoggerObserver(channel, metrics=[FailsOnce()], schedule=None), on_error="ignore")
    assert sum(b.numel() for b in source) == 300
    source.shutdown()
    assert channel.close(timeout=10)
    # window 1 logged; window 2 (failing) skipped, not logged as a stale row; window 3 logged
    assert [v for _, v in scalars(logger, "collector/calls")] == [1.0, 2.0]


def test_a_failing_metric_set_reaches_the_caller_under_raise(logger):
    source = collector()
    source.add_observer(LoggerObserver(logger, metrics=[Broken()], schedule=None), on_error="raise")
    with pytest.raises(RuntimeError, match="a bug in a custom set"):
        next(iter(source))
    source.shutdown()


def test_sample_metrics_alone_on_a_collector_is_refused(logger):
    source = collector()
    with pytest.raises(TypeError, match="SampleMetrics folds post_add"):
        source.add_observer(LoggerObserver(logger, metrics=[CollectorBatchMetrics(), SampleMetrics()]))
    assert source.observers == ()
    source.shutdown()
