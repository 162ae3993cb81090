"""Memory stays flat over a long run: RSS after warm-up grows by less than a small bound.

Two long runs with every metric set attached and emitting often, through a
:class:`~rl_observers.MetricsChannel` into a ``CSVLogger``:

* a collector, ``CountingEnv(batch_size=[100])`` (5-step episodes, so the
  episode metrics work at every batch), 10**6 frames in 1000-frame batches,
  ``CollectorBatchMetrics`` (reward, dones, episode return and length)
  emitting every 10,000 frames (100 windows);
* a ``TensorDictReplayBuffer(LazyTensorStorage(100_000))`` with
  ``WriteMetrics(reward_key=...)`` and ``SampleMetrics()`` (sample age
  included), 10**6 items sampled (``sample(256)``, an ``extend(256)`` every 4
  samples, wrapping the storage several times), emitting every 10 samples
  (~390 windows).

RSS (``psutil``) is read after a warm-up of 10 % of the run (the first
windows: reducers, staging buffers, the channel's queue and the logger's files
are made by then) and at the end; the growth must stay below
``GROWTH_BOUND_MIB``. The numbers are in ``benchmarks/README.md``.

No time is asserted: this holds on any machine, busy or not, so ``make
test`` asserts it too.
"""

from __future__ import annotations

import gc

import psutil
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)

FRAMES = 10**6
SAMPLED_ITEMS = 10**6
GROWTH_BOUND_MIB = 4.0


def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def _report(benchmark, label: str, warm: float, end: float) -> None:
    benchmark.extra_info.update({f"{label}_rss_warm_mib": warm, f"{label}_rss_growth_mib": end - warm})
    print(f"\n{label}: RSS after warm-up {warm:.1f} MiB, at the end {end:.1f} MiB, growth {end - warm:+.2f} MiB")


@pytest.mark.timeout(600)
def test_collector_memory_is_flat(benchmark, tmp_path):
    logger = CSVLogger("collector", log_dir=str(tmp_path))
    channel = MetricsChannel.for_logger(logger)
    env = CountingEnv(batch_size=[100])
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=1000, total_frames=FRAMES)
    collector.add_observer(
        LoggerObserver(logger, schedule=Every.counter("frames", 10_000), metrics=CollectorBatchMetrics())
    )
    warm = None
    try:
        for i, _ in enumerate(collector):
            if i == FRAMES // 1000 // 10:
                assert channel.flush(timeout=30)
                warm = _rss_mib()
        assert channel.flush(timeout=30)
        end = _rss_mib()
    finally:
        collector.shutdown()
        channel.close(timeout=30)
    assert warm is not None
    _report(benchmark, "collector", warm, end)
    assert end - warm < GROWTH_BOUND_MIB, (warm, end)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


@pytest.mark.timeout(600)
def test_replay_buffer_memory_is_flat(benchmark, tmp_path):
    logger = CSVLogger("buffer", log_dir=str(tmp_path))
    channel = MetricsChannel.for_logger(logger)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000))
    rb.add_observer(
        LoggerObserver(
            logger,
            schedule=Every.counter("sample_calls", 10),
            metrics=[WriteMetrics(reward_key=("next", "reward")), SampleMetrics()],
        )
    )
    data = TensorDict(
        {"observation": torch.randn(256, 4), "next": {"reward": torch.randn(256, 1)}}, batch_size=[256]
    )
    for _ in range(400):  # the storage is full before the warm-up ends
        rb.extend(data)
    calls = SAMPLED_ITEMS // 256
    warm = None
    try:
        for i in range(calls):
            rb.sample(256)
            if i % 4 == 0:
                rb.extend(data)
            if i == calls // 10:
                assert channel.flush(timeout=30)
                warm = _rss_mib()
        assert channel.flush(timeout=30)
        end = _rss_mib()
    finally:
        channel.close(timeout=30)
    _report(benchmark, "replay_buffer", warm, end)
    assert end - warm < GROWTH_BOUND_MIB, (warm, end)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
