"""WorkerHealth: throughput and health per worker, merged by their declared rules."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel, WorkerHealth
from rl_observers.metrics.health import resident_memory_mb
from rl_observers.remote.aggregate import Aggregate
from tests.helpers import scalars, small_env


def test_a_window_counts_its_frames_and_batches_and_reads_the_clock_once_per_window(monkeypatch):
    env = small_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=30, total_frames=300)
    health = WorkerHealth()
    health.bind(collector)
    real_time = time.time
    try:
        windows = []
        for i, batch in enumerate(collector):
            health.on_post_collect(collector, batch)
            if i % 4 == 3:
                windows.append(health.pull())
    finally:
        collector.shutdown()
    assert [w["frames_per_second"].amount for w in windows] == [120.0, 120.0]
    assert [w["batches_per_second"].amount for w in windows] == [4.0, 4.0]
    assert windows[0]["frames_per_second"].end == windows[1]["frames_per_second"].start  # windows tile
    # per event, the set never reads the clock; once per window it does
    health_reads = []
    monkeypatch.setattr(time, "time", lambda: health_reads.append(1) or real_time())
    for _ in range(100):
        health.on_post_collect(None, torch.zeros(5, 2))
    assert health_reads == []
    assert health.pull()["frames_per_second"].amount == 60.0 + 1_000.0  # 2 batches left + these
    assert len(health_reads) == 1


def test_rows_of_a_local_collector(tmp_path):
    env = small_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=400)
    logger = CSVLogger(exp_name="health", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 100), metrics=[CollectorBatchMetrics(), WorkerHealth()])
    )
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert channel.close(timeout=30)
    steps = [s for s, _ in scalars(logger, "collector/frames_per_second")]
    assert steps == [100, 200, 300, 400]
    assert all(v > 0 for _, v in scalars(logger, "collector/frames_per_second"))
    fps = [v for _, v in scalars(logger, "collector/frames_per_second")]
    bps = [v for _, v in scalars(logger, "collector/batches_per_second")]
    assert [f / b for f, b in zip(fps, bps)] == pytest.approx([50.0] * 4)  # same window, 50 frames a batch
    rss = psutil.Process(os.getpid()).memory_info().rss / 2**20
    assert [v for _, v in scalars(logger, "collector/resident_memory_mb")][-1] == pytest.approx(rss, rel=0.2)
    assert [v for _, v in scalars(logger, "collector/seconds_since_last_heard")] == [0.0] * 4
    assert resident_memory_mb() == pytest.approx(psutil.Process().memory_info().rss / 2**20, rel=0.05)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_per_worker_and_aggregate_rows_follow_the_declared_merge_rules(tmp_path):
    logger = CSVLogger(exp_name="workers", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector = MultiSyncCollector([small_env, small_env], RandomPolicy(small_env().action_spec), frames_per_batch=100, total_frames=1_000)
    collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 200), metrics=[WorkerHealth()], scope="both")
    )
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert channel.close(timeout=60)
    for worker in (0, 1):
        rows = scalars(logger, f"collector/worker_{worker}/frames_per_second")
        assert rows and all(v > 0 for _, v in rows)
        memory = scalars(logger, f"collector/worker_{worker}/resident_memory_mb")
        assert memory and all(0 < v < psutil.virtual_memory().total / 2**20 for _, v in memory)
    aggregate_memory = dict(scalars(logger, "collector/resident_memory_mb"))
    workers_memory = [dict(scalars(logger, f"collector/worker_{w}/resident_memory_mb")) for w in (0, 1)]
    for value in aggregate_memory.values():  # max, never a sum: below the largest worker's ever
        assert value <= max(max(m.values()) for m in workers_memory)
    assert max(aggregate_memory.values()) == max(max(m.values()) for m in workers_memory)
    staleness = [v for _, v in scalars(logger, "collector/seconds_since_last_heard")]
    assert staleness and all(v >= 0 for v in staleness)


def test_the_owner_measures_how_long_a_silent_worker_has_been_silent():
    """A stuck worker sends nothing: the owner's row says since when (here: 0.2 s at least)."""
    from rl_observers.stats import PerSecond, Scalar

    agg = Aggregate("collector", schedule=Every.counter("frames", 100), step_key="frames")

    def window(frames, start):
        return {
            "frames": float(frames),
            "frames_per_second": PerSecond("frames_per_second", frames, start, start + 1.0),
            "resident_memory_mb": Scalar("resident_memory_mb", "max", 100.0 + frames),
            # what a worker's WorkerHealth sends: a partial that declares the owner measures it
            "seconds_since_last_heard": WorkerHealth().pull()["seconds_since_last_heard"],
        }

    assert agg.contribute(0, window(40, 0.0), {"frames": 40}) == []
    time.sleep(0.2)  # worker 0 stays silent from here on
    (row,) = agg.contribute(1, window(60, 0.0), {"frames": 60})
    namespace, metrics, step = row
    assert (namespace, step) == ("collector", 100)
    assert metrics["seconds_since_last_heard"] >= 0.2
    assert metrics["frames_per_second"].finalize() == {"frames_per_second": 100.0}  # rates add
    assert metrics["resident_memory_mb"].finalize() == {"resident_memory_mb": 160.0}  # max
