"""Counters going backwards: ``empty()``, restored buffers and collectors, collector resets.

An observer's counters are its own and cumulative: torchrl's ``write_count``
going back to 0 on ``empty()`` or a restored buffer does not move them, so a
counter schedule neither repeats nor skips an emission. What can go back is
the observer's own state (``load_state_dict``): the schedule then
re-baselines (see ``tests/test_logger_observer.py``), and the pull monitor's
rates derived from the observer's ``stats()`` entries never go negative.
"""

from __future__ import annotations

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers.monitoring import LoggerMonitor

from rl_observers import Every, LoggerObserver, SampleMetrics, WriteMetrics
from tests.helpers import RecordingLogger, sync_channel


def steps_and_values(logger: RecordingLogger, name: str) -> tuple[list[int], list[float]]:
    series = logger.series(name)
    return [s for s, _ in series], [v for _, v in series]


def assert_increasing_and_non_negative(logger: RecordingLogger, prefix: str) -> None:
    names = {k for m, _ in logger.calls for k in m if k.startswith(prefix)}
    assert names
    for name in names:
        steps, values = steps_and_values(logger, name)
        assert all(v >= 0 for v in values), (name, values)
        if name.endswith(("items_written", "writes", "sample_calls", "samples_returned", "frames")):
            assert values == sorted(values), (name, values)  # cumulative gauges never go down


def _write_sample(rb, times: int) -> None:
    for _ in range(times):
        rb.extend(torch.arange(7))
        rb.sample()


@pytest.mark.parametrize("reset", ["empty", "empty_keep_write_count", "load_state_dict"])
def test_a_buffer_reset_neither_repeats_nor_skips_an_emission(reset):
    logger = RecordingLogger()
    channel = sync_channel(logger)
    rb = ReplayBuffer(storage=LazyTensorStorage(50), batch_size=8)
    rb.add_observer(LoggerObserver(channel, schedule=Every.counter("write_count", 10), name="rb"))
    _write_sample(rb, 3)
    saved = rb.state_dict()
    _write_sample(rb, 3)
    if reset == "empty":
        rb.empty()
        assert rb.write_count == 0
    elif reset == "empty_keep_write_count":
        rb.empty(empty_write_count=False)
    else:
        rb.load_state_dict(saved)
        assert rb.write_count == 21
    _write_sample(rb, 6)
    channel.step()
    # the observer counted 12 writes of 7 items; it emits at each crossing of a multiple of 10
    steps, items = steps_and_values(logger, "rb/items_written")
    assert steps == [14, 21, 35, 42, 56, 63, 70, 84]
    assert items == [float(s) for s in steps]
    assert steps_and_values(logger, "rb/sample_calls")[1] == [1.0, 2.0, 4.0, 5.0, 7.0, 8.0, 9.0, 11.0]
    assert_increasing_and_non_negative(logger, "rb/")
    stats = rb.stats()
    assert stats["items_written"] == 84 and stats["sample_calls"] == 12


def test_sample_age_after_empty_only_covers_what_was_written_since():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    rb = ReplayBuffer(storage=LazyTensorStorage(50), batch_size=16)
    rb.add_observer(LoggerObserver(channel, metrics=SampleMetrics(), name="rb", schedule=None))  # emits per sample
    rb.extend(torch.arange(40))
    rb.sample()
    rb.empty()
    rb.extend(torch.arange(5))
    rb.sample()
    channel.step()
    ages_max = steps_and_values(logger, "rb/sample_age_max")[1]
    ages_min = steps_and_values(logger, "rb/sample_age_min")[1]
    assert ages_max[-1] <= 4 and ages_min[-1] >= 0  # only the 5 items written after empty()


def test_a_buffer_restored_with_its_observer_state_gives_the_ages_of_an_uninterrupted_run():
    def run(restore: bool) -> list[float]:
        logger = RecordingLogger()
        channel = sync_channel(logger)
        rb = ReplayBuffer(storage=LazyTensorStorage(50), batch_size=8)
        rb.set_rng(torch.Generator().manual_seed(0))
        observer = LoggerObserver(channel, metrics=[WriteMetrics(), SampleMetrics()], name="rb", schedule=None)
        rb.add_observer(observer)
        for _ in range(3):
            rb.extend(torch.arange(7))
        if restore:
            saved_rb, saved_observer = rb.state_dict(), observer.state_dict()
            for _ in range(4):
                rb.extend(torch.arange(7))
                rb.sample()
            rb.load_state_dict(saved_rb)
            observer.load_state_dict(saved_observer)  # checkpointed together
            rb.set_rng(torch.Generator().manual_seed(0))
        for _ in range(3):
            rb.sample()
        channel.step()
        names = ("rb/sample_age_min", "rb/sample_age_mean", "rb/sample_age_max")
        return [[v for _, v in logger.series(name)][-3:] for name in names]  # the last 3 samples

    assert run(restore=True) == run(restore=False)


def test_a_buffer_restored_without_its_observer_state_keeps_ages_non_negative():
    """Documented limit: the observer cannot see a restore, ages then count the writes it saw."""
    logger = RecordingLogger()
    channel = sync_channel(logger)
    rb = ReplayBuffer(storage=LazyTensorStorage(50), batch_size=8)
    rb.add_observer(LoggerObserver(channel, metrics=SampleMetrics(), name="rb", schedule=None))
    rb.extend(torch.arange(21))
    saved = rb.state_dict()
    for _ in range(10):
        rb.extend(torch.arange(7))
    rb.load_state_dict(saved)
    for _ in range(5):
        rb.sample()
    channel.step()
    for name in ("rb/sample_age_min", "rb/sample_age_mean", "rb/sample_age_max"):
        assert all(0 <= v <= 21 + 70 for _, v in logger.series(name))


def _episodes_per_batch(batches) -> list[list[int]]:
    """Ground truth: lengths of the episodes ending in each batch; a new trajectory id starts over."""
    out, length, previous = [], 0, None
    for batch in batches:
        ended = []
        traj = batch["collector", "traj_ids"].reshape(-1).tolist()
        done = batch["next", "done"].reshape(-1).tolist()
        for t, d in zip(traj, done):
            if previous is not None and t != previous:
                length = 0  # a trajectory that did not finish: dropped, never merged
            length += 1
            previous = t
            if d:
                ended.append(length)
                length, previous = 0, None
        out.append(ended)
    return out


@pytest.mark.timeout(60)
def test_collector_reset_and_restore_leave_no_garbage_episode():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    torch.manual_seed(0)
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=20, total_frames=-1)
    collector.add_observer(LoggerObserver(channel, name="c", schedule=None))  # one window per batch
    batches = []
    it = iter(collector)
    try:

        def take(n):
            for _ in range(n):
                batches.append(next(it).clone())

        take(3)
        saved = collector.state_dict()
        take(1)
        collector.reset()  # mid-episode: the episode in flight is abandoned
        take(3)
        collector.load_state_dict(saved, strict=False)  # torchrl's frames count goes back
        take(3)
    finally:
        collector.shutdown()
    channel.step()
    assert_increasing_and_non_negative(logger, "c/")
    steps, frames = steps_and_values(logger, "c/frames")
    assert steps == list(range(20, 201, 20)) and frames == [float(s) for s in steps]
    truth = _episodes_per_batch(batches)
    assert [int(v) for _, v in logger.series("c/episodes")] == [len(e) for e in truth]
    logged_max = [v for _, v in logger.series("c/episode_length_max")]
    logged_min = [v for _, v in logger.series("c/episode_length_min")]
    assert logged_max == [float(max(e)) for e in truth if e]
    assert logged_min == [float(min(e)) for e in truth if e]


def test_the_pull_monitor_rates_from_observer_stats_never_go_negative():
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), batch_size=4)
    channel = sync_channel(RecordingLogger())
    observer = LoggerObserver(channel, schedule=Every.counter("sample_calls", 1000), metrics=SampleMetrics())
    rb.add_observer(observer)
    monitor_logger = RecordingLogger()
    monitor = LoggerMonitor(monitor_logger, background=False)
    monitor.watch(rb, name="rb", rate_keys=("sample_calls",), log_on_start=True)
    rb.extend(torch.arange(100))
    saved = observer.state_dict()
    for round_ in range(3):
        for _ in range(20):
            rb.sample()
        monitor.step()
        if round_ == 1:
            observer.load_state_dict(saved)  # sample_calls goes back to 0
    rates = [v for m, _ in monitor_logger.calls for k, v in m.items() if k.endswith("samples_per_second")]
    assert rates and all(r >= 0 for r in rates)
