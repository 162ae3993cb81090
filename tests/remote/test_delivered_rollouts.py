"""A multiprocessing worker's rollout is counted when the worker writes it into the shared buffer.

torchrl's worker drops a rollout that finished while a control message
arrived (``async_shutdown``, pause, an attribute set, an observer attached).
The observers of a worker writing into a shared replay buffer fold a rollout
at that write, so their totals are what the buffer holds, and a dropped
rollout's frames are counted apart (``frames_discarded``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyMemmapStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from tests.helpers import local_ray, scalars, start_method

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

PER_WORKER = 250


def _cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


@pytest.mark.real_collector
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_started_collector_counts_what_its_workers_wrote_and_the_dropped_rollouts_apart(tmp_path, method):
    rb = ReplayBuffer(storage=LazyMemmapStorage(200_000))  # memory the workers write and the test reads
    logger = CSVLogger(exp_name="written", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    with start_method(method):
        collector = MultiSyncCollector(
            [_cartpole, _cartpole],
            RandomPolicy(_cartpole().action_spec),
            frames_per_batch=2 * PER_WORKER,
            total_frames=-1,
            replay_buffer=rb,
        )
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=CollectorBatchMetrics())
        )
        collector.start()
        time.sleep(2.0)
        collector.async_shutdown(timeout=60)
    assert channel.close(timeout=60)
    written = rb.write_count
    stored = rb.storage.get(torch.arange(written))
    assert written > 0 and written % PER_WORKER == 0
    frames = scalars(logger, "collector/frames")
    assert frames[-1] == (written, float(written))  # what the buffer holds, not what was collected
    assert [value for _, value in scalars(logger, "collector/episodes_total")][-1] == int(stored["next", "done"].sum())
    steps = [step for step, _ in frames]
    discarded = scalars(logger, "collector/frames_discarded")
    if len(steps) > 1 and steps[-1] == steps[-2]:
        # a last window that only carries rollouts dropped at shutdown: same step, more discarded
        assert discarded[-1][1] > discarded[-2][1], (frames[-2:], discarded[-2:])
        steps_before_the_drop = steps[:-1]
    else:
        steps_before_the_drop = steps
    assert steps_before_the_drop == sorted(set(steps_before_the_drop)), (frames, discarded)
    # each row holds whole written rollouts; the dropped ones are counted apart, whole rollouts too
    assert all(value % PER_WORKER == 0 for _, value in frames)
    assert [step for step, _ in discarded] == steps, (frames, discarded)
    assert discarded[-1][1] % PER_WORKER == 0
    assert [value for _, value in discarded] == sorted(value for _, value in discarded)


@pytest.mark.real_collector
@pytest.mark.parametrize("metrics", [{}, {"reward_key": "nope"}], ids=["all_keys", "a_missing_reward_key"])
def test_an_iterated_collector_writing_a_buffer_drops_nothing(tmp_path, metrics):
    """Iterated, every rollout is written: frames_discarded stays 0 and frames is the write count.

    Also once the set stopped what needs a key the first batch lacks (it is rebuilt then).
    """
    rb = ReplayBuffer(storage=LazyMemmapStorage(10_000))
    logger = CSVLogger(exp_name="iterated", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    with start_method("fork"):
        collector = MultiSyncCollector(
            [_cartpole, _cartpole],
            RandomPolicy(_cartpole().action_spec),
            frames_per_batch=2 * PER_WORKER,
            total_frames=3000,
            replay_buffer=rb,
        )
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=CollectorBatchMetrics(**metrics))
        )
        for _ in collector:
            pass
        collector.shutdown()
    assert channel.close(timeout=60)
    stored = rb.storage.get(torch.arange(rb.write_count))
    assert scalars(logger, "collector/frames") == [(1000, 1000.0), (2000, 2000.0), (3000, 3000.0)]
    assert scalars(logger, "collector/frames_discarded") == [(1000, 0.0), (2000, 0.0), (3000, 0.0)]
    assert scalars(logger, "collector/episodes_total")[-1][1] == int(stored["next", "done"].sum())


@pytest.mark.real_collector
def test_a_slow_consumer_of_a_multiasync_collector_counts_what_it_received(tmp_path):
    """Training that holds a batch for over a second: the other worker's put times out and it rolls out
    again, dropping the older rollout; at the end, the rollouts the driver never took are dropped too.
    Only the batches the driver received are counted; the others' frames are counted apart."""
    logger = CSVLogger(exp_name="slow", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    per_rollout = 50
    with start_method("fork"):
        collector = MultiAsyncCollector(
            [_cartpole, _cartpole],
            RandomPolicy(_cartpole().action_spec),
            frames_per_batch=per_rollout,
            total_frames=6 * per_rollout,
        )
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", per_rollout), metrics=CollectorBatchMetrics())
        )
        received = []
        for batch in collector:
            received.append(batch.clone())
            time.sleep(1.3)  # longer than torchrl's 1 s put timeout
        collector.shutdown()
    assert channel.close(timeout=60)
    frames = sum(batch.numel() for batch in received)
    frames_rows = scalars(logger, "collector/frames")
    assert frames_rows[-1][1] == frames == 6 * per_rollout
    # every row holds whole rollouts the driver took, at most what it had taken
    assert all(value % per_rollout == 0 and value <= frames for _, value in frames_rows)
    _batches_are_the_drivers(logger, received)
    dones = sum(int(batch["next", "done"].sum()) for batch in received)
    assert scalars(logger, "collector/episodes_total")[-1][1] == dones
    discarded = scalars(logger, "collector/frames_discarded")[-1][1]
    assert discarded > 0 and discarded % per_rollout == 0  # re-rollouts and the rollouts never taken


def _batches_are_the_drivers(logger: CSVLogger, received: list) -> None:
    """Every row's ``batches`` is the number of the driver's batches its ``frames`` hold."""
    (size,) = {batch.numel() for batch in received}
    frames, batches = scalars(logger, "collector/frames"), scalars(logger, "collector/batches")
    assert [step for step, _ in batches] == [step for step, _ in frames]
    assert [value for _, value in batches] == [value / size for _, value in frames], (batches, frames)
    assert batches[-1][1] == len(received)


def _async_ray_collector(total_frames: int, **kwargs: Any) -> Any:
    """An asynchronous ``RayCollector`` of two CartPole actors, as torchrl's IMPALA example builds it."""
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector

    return RayCollector(
        [_cartpole, _cartpole],
        RandomPolicy(_cartpole().action_spec),
        collector_class=Collector,
        frames_per_batch=PER_RAY_BATCH,
        total_frames=total_frames,
        sync=False,
        remote_configs={"num_cpus": 0.5},
        **kwargs,
    )


def _ray_async_run(
    tmp: str, *, stop_after: int | None, ray_init_config: dict | None = None
) -> tuple[list, CSVLogger, MetricsChannel]:
    """An asynchronous 2-actor ``RayCollector``: iterated to its end, or left with a ``break``;
    then ``shutdown()`` and ``close()``, as torchrl's IMPALA example ends."""
    collector = _async_ray_collector(6 * PER_RAY_BATCH, ray_init_config=ray_init_config)
    logger = CSVLogger(exp_name="ray", log_dir=tmp)
    channel = MetricsChannel(logger)
    collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", PER_RAY_BATCH), metrics=CollectorBatchMetrics())
    )
    received = []
    for batch in collector:
        received.append(batch.clone())
        if len(received) == stop_after:
            break
    collector.shutdown()
    assert channel.close(timeout=60)
    return received, logger, channel


def _rows_are_the_drivers(received: list, logger: CSVLogger, in_flight: int) -> None:
    frames = sum(batch.numel() for batch in received)
    frames_rows = scalars(logger, "collector/frames")
    assert frames_rows[-1][1] == frames, (frames_rows, frames)
    assert all(value % PER_RAY_BATCH == 0 and value <= frames for _, value in frames_rows)
    _batches_are_the_drivers(logger, received)
    dones = sum(int(batch["next", "done"].sum()) for batch in received)
    assert scalars(logger, "collector/episodes_total")[-1][1] == dones
    discarded = scalars(logger, "collector/frames_discarded")
    assert discarded[-1][1] == in_flight * PER_RAY_BATCH, (discarded, frames_rows)


PER_RAY_BATCH = 50


@pytest.mark.real_collector
@pytest.mark.timeout(300)
def test_an_async_ray_collector_counts_what_its_driver_took(tmp_path, monkeypatch):
    """Each actor collects its next batch before the driver asks: the batches in flight when the
    driver stops (the other actor's after a ``break``) are counted apart, and each row's
    ``batches`` are those the driver received (counted as torchrl delivers them). (Iterated to
    its end, one batch per actor is in flight: the next test's run.)"""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import sys

    with local_ray(sys.modules[__name__]):
        received, logger, _ = _ray_async_run(str(tmp_path), stop_after=3)
    _rows_are_the_drivers(received, logger, in_flight=1)


@pytest.mark.real_collector
@pytest.mark.timeout(300)
def test_an_async_ray_collector_that_starts_ray_logs_every_window_before_shutting_it_down(
    tmp_path, monkeypatch, told
):
    """torchrl's ``RayCollector`` starts Ray itself and shuts it down at the end of iteration (its
    runtime lease), before the user can close the channel: every window is logged all the same,
    and nobody is told that something may be lost."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import sys

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        config = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
        received, logger, channel = _ray_async_run(str(tmp_path), stop_after=None, ray_init_config=config)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()  # a no-op when the collector shut it down
    _rows_are_the_drivers(received, logger, in_flight=2)
    health = channel.health()
    assert health["submitted"] == health["logged"] + health["coalesced"] > 0, health
    assert health["copies_lost"] == health["dropped"] == 0
    assert not [message for message in told if "Ray was shut down" in message or "lost" in message], told


@pytest.mark.real_collector
@pytest.mark.timeout(300)
def test_ray_shut_down_by_the_user_under_running_copies_warns_and_counts_them_lost(
    tmp_path, monkeypatch, told
):
    """``ray.shutdown()`` while an observed ``RayCollector`` still runs (left with a ``break``)
    and the channel is open: its copies go with Ray. Said once, counted, and no new Ray starts."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import sys

    with local_ray(sys.modules[__name__]) as ray:
        collector = _async_ray_collector(100 * PER_RAY_BATCH)
        try:
            logger = CSVLogger(exp_name="ray", log_dir=str(tmp_path))
            channel = MetricsChannel(logger, name="user_shutdown")
            observer = LoggerObserver(channel, schedule=Every.counter("frames", PER_RAY_BATCH), metrics=CollectorBatchMetrics())
            collector.add_observer(observer)
            for received, _ in enumerate(collector, 1):
                if received == 3:
                    break
            ray.shutdown()
            assert not channel.close(timeout=60)  # at once: the channel notices Ray is gone itself
            # this channel's own warning: another test's channel in this process may say it too
            said = [m for m in told if "'user_shutdown'" in m and "Ray was shut down in this process while" in m]
            assert len(said) == 1 and "collector.shutdown()" in said[0], told
            assert channel.health()["copies_lost"] == 2
            assert any("2 copies of LoggerObserver 'collector' on a RayCollector vanished" in m for m in told), told
            assert not ray.is_initialized()
        finally:
            # torchrl's RayCollector.__del__ releases its runtime lease (which later Ray sources
            # count) and would ray.kill its dead actors, which starts a new local Ray
            collector._remote_collectors.clear()
            del collector
            gc.collect()


@pytest.mark.timeout(120)
def test_a_ray_replay_buffer_that_starts_ray_logs_every_window_before_shutting_it_down(
    tmp_path, monkeypatch, told
):
    """A ``RayReplayBuffer`` created with no Ray running starts it, and its ``close()`` shuts it
    down (its runtime lease): every window its actor sent is logged, unwarned."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    from functools import partial

    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, RayReplayBuffer

    from rl_observers import WriteMetrics

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    logger = CSVLogger(exp_name="rb", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    try:
        rb = RayReplayBuffer(
            storage=partial(LazyTensorStorage, 1000),
            batch_size=8,
            ray_init_config={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
            remote_config={"num_cpus": 0},
        )
        rb.add_observer(LoggerObserver(channel, name="rb", schedule=Every.counter("write_count", 10), metrics=WriteMetrics()))
        written = [TensorDict({"obs": torch.full((10,), float(i))}, [10]) for i in range(5)]
        for data in written:
            rb.extend(data)
        rb.close()
        assert not ray.is_initialized()  # the buffer's lease shut it down
    finally:
        ray.shutdown()
    assert channel.close(timeout=60)
    truth = [(10 * (i + 1), 10.0 * (i + 1)) for i in range(len(written))]
    assert scalars(logger, "rb/items_written") == truth
    assert channel.health()["copies_lost"] == channel.health()["dropped"] == 0
    assert not [message for message in told if "Ray was shut down" in message or "lost" in message], told
