"""LoggerObserver across processes: copies contribute, the channel's owner aggregates exactly."""

from __future__ import annotations

import logging
import warnings
from functools import partial

import pytest
import torch
from tensordict import TensorDict
from torchrl._utils import logger as torchrl_logger
from torchrl.collectors import MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    Sum,
    WriteMetrics,
)
from rl_observers.remote.window import AggregateSpec, Window
from tests.helpers import RecordingLogger, scalars, start_method

NEVER = Every.counter("frames", 10**12)


def pendulum_multisync(method, frames_per_batch=200, total_frames=1200):
    env = GymEnv("Pendulum-v1")
    with start_method(method):
        return MultiSyncCollector(
            [partial(GymEnv, "Pendulum-v1")] * 2,
            RandomPolicy(env.action_spec),
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
        )


def episodes_per_worker(batches):
    """Ground truth from every frame the driver received: batches are [workers, time]."""
    episodes = []
    for worker in range(batches[0].shape[0]):
        running = 0.0
        for batch in batches:
            rewards = batch["next", "reward"][worker].reshape(-1).tolist()
            dones = batch["next", "done"][worker].reshape(-1).tolist()
            for reward, done in zip(rewards, dones):
                running += reward
                if done:
                    episodes.append(running)
                    running = 0.0
    return episodes


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multisync_aggregate_is_exact_over_every_frame(tmp_path, method):
    logger = CSVLogger(exp_name="agg", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    collector = pendulum_multisync(method)
    # a schedule that never fires: the run still ends with one aggregate row over all the data
    collector.add_observer(LoggerObserver(channel, schedule=NEVER, scope="both", name="mp"))
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert channel.close(timeout=60)
    assert batches[0].shape[0] == 2

    rewards = torch.cat([b["next", "reward"].reshape(-1) for b in batches]).double()
    (row_mean,) = scalars(logger, "mp/reward_mean")
    assert row_mean == (1200, pytest.approx(rewards.mean().item(), rel=1e-9))
    assert scalars(logger, "mp/reward_min")[0][1] == pytest.approx(rewards.min().item())
    assert scalars(logger, "mp/reward_std")[0][1] == pytest.approx(rewards.std(unbiased=False).item(), rel=1e-6)
    truth = episodes_per_worker(batches)
    assert len(truth) == 6  # three 200-step episodes per worker, each spanning two batches
    assert scalars(logger, "mp/episodes") == [(1200, 6.0)]
    assert scalars(logger, "mp/episode_return_mean")[0][1] == pytest.approx(sum(truth) / 6, rel=1e-9)
    assert scalars(logger, "mp/episode_return_min")[0][1] == pytest.approx(min(truth), rel=1e-9)
    assert scalars(logger, "mp/workers")[0][1] == 2
    # per worker: each worker's own step
    for worker in (0, 1):
        assert scalars(logger, f"mp/worker_{worker}/frames") == [(600, 600.0)]
        worker_rewards = torch.cat([b["next", "reward"][worker].reshape(-1) for b in batches]).double()
        assert scalars(logger, f"mp/worker_{worker}/reward_mean")[0][1] == pytest.approx(
            worker_rewards.mean().item(), rel=1e-9
        )


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_global_counter_schedule_and_removal_flush(tmp_path):
    logger = CSVLogger(exp_name="sched", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    collector = pendulum_multisync("fork", total_frames=1600)
    observer = LoggerObserver(channel, schedule=Every.counter("frames", 400), name="mp")
    collector.add_observer(observer)
    received = 0
    for i, batch in enumerate(collector):
        received += batch.numel()
        if i == 5:  # 1200 frames in
            collector.remove_observer(observer)
            assert channel.flush(timeout=30)
            # everything the copies produced, their last windows included, reached the logger
            assert scalars(logger, "mp/frames")[-1] == (1200, 1200.0)
    collector.shutdown()
    channel.close(timeout=30)
    steps = [step for step, _ in scalars(logger, "mp/frames")]
    assert steps[-1] == 1200 and steps == sorted(steps)
    # Thresholds on the global (summed) counter are observed, not exact (DESIGN.md): the
    # owner sees the counter when workers report, so a window closes at the first report
    # at or past each multiple of 400, once per multiple crossed; the removal flushes
    # the last one at 1200.
    crossed = [step // 400 for step in steps[:-1]]
    assert all(step >= 400 for step in steps), steps
    assert crossed == sorted(set(crossed)), steps
    assert received == 1600


# (these run before the Ray tests of this module: a driver connected to Ray hands its
# forked workers a Ray sender instead of the socket one)

@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("total_frames", "log_on_close", "last_step"),
    [
        (3000, False, 3000),  # the final counters cross 3000: that row is due, not a partial one
        (2400, False, 2100),  # 2400 is below the next threshold: a trailing partial, dropped
        (2400, True, 2400),  # ... and logged when log_on_close
    ],
)
def test_log_on_close_false_still_logs_the_rows_the_final_counters_make_due(
    tmp_path, total_frames, log_on_close, last_step
):
    logger = CSVLogger(exp_name="noclose", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    # 150 frames per worker and batch (300 per driver batch): the rows are the driver's, at the
    # first batch reaching each threshold (1200, 2100, 3000); the copies send what came after the
    # last one only when they shut down
    collector = pendulum_multisync("fork", frames_per_batch=300, total_frames=total_frames)
    observer = LoggerObserver(
        channel,
        schedule=Every.counter("frames", 1000),
        log_on_close=log_on_close,
        report_interval=600,
        name="mp",
    )
    collector.add_observer(observer)
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert channel.close(timeout=60)
    steps = [step for step, _ in scalars(logger, "mp/frames")]
    assert steps == [1200, 2100, last_step][: 3 if last_step > 2100 else 2]
    assert scalars(logger, "mp/frames")[-1] == (last_step, float(last_step))
    if last_step == total_frames:  # every episode the driver received is in a row
        truth = episodes_per_worker(batches)
        assert sum(value for _, value in scalars(logger, "mp/episodes")) == len(truth)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_closing_the_channel_before_the_collector_shuts_down_is_reported(tmp_path, warnings_seen):
    logger = CSVLogger(exp_name="order", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    # the forked workers inherit this handler: what they warn about ends up in the file
    workers_log = logging.FileHandler(tmp_path / "workers.log")
    torchrl_logger.addHandler(workers_log)
    try:
        collector = pendulum_multisync("fork", total_frames=800)
    finally:
        torchrl_logger.removeHandler(workers_log)
    # the workers hold everything until they shut down
    collector.add_observer(LoggerObserver(channel, schedule=NEVER, report_interval=600, name="mp"))
    for _ in collector:
        pass
    assert not channel.close(timeout=30)  # the workers' windows cannot reach it any more
    (warning,) = [m for m in warnings_seen if "closing while observers" in m]
    assert "LoggerObserver 'mp' on a MultiSyncCollector" in warning
    assert "Shut the source down (collector.shutdown()" in warning
    # the cause is the order of the calls: no copy is counted, nor reported, as lost
    assert channel.health()["copies_lost"] == 0
    assert not [m for m in warnings_seen if "vanished" in m]
    collector.shutdown()
    assert scalars(logger, "mp/frames") == []
    # each worker names the likely cause of what it could not send
    workers_log.close()
    assert "channel was closed (channel.close()) before the source" in (
        tmp_path / "workers.log"
    ).read_text()


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_closing_the_channel_after_removing_the_observer_is_clean(tmp_path, warnings_seen):
    logger = CSVLogger(exp_name="order", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    collector = pendulum_multisync("fork", total_frames=800)
    observer = LoggerObserver(channel, schedule=NEVER, report_interval=600, name="mp")
    collector.add_observer(observer)
    for _ in collector:
        pass
    collector.remove_observer(observer)  # its copies send their last windows
    assert channel.close(timeout=30)
    collector.shutdown()
    assert not [m for m in warnings_seen if "closing while observers" in m]
    assert scalars(logger, "mp/frames") == [(800, 800.0)]


def _rows(n):
    return TensorDict(obs=torch.arange(n, dtype=torch.float32), batch_size=[n])


def _pendulum_writing_into(rb, total_frames, method="fork"):
    """A MultiSyncCollector of two Pendulum workers writing 100-frame batches into ``rb``."""
    env = GymEnv("Pendulum-v1")
    with start_method(method):
        return MultiSyncCollector(
            [partial(GymEnv, "Pendulum-v1")] * 2,
            RandomPolicy(env.action_spec),
            frames_per_batch=100,
            total_frames=total_frames,
            replay_buffer=rb,
        )


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shared_buffer_writes_from_every_worker_are_aggregated(tmp_path):
    logger = CSVLogger(exp_name="shared", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), shared=True)
    observer = LoggerObserver(channel, schedule=Every.counter("write_count", 10**9), metrics=WriteMetrics(), name="rb")
    rb.add_observer(observer)
    rb.extend(_rows(4))  # a shared storage is initialised before it travels
    assert observer._mode == "local"  # no copies yet
    collector = _pendulum_writing_into(rb, 600)
    # told before its copies started in the workers: one more contributor from now on, fixed
    # before any copy's window (never switched by a window arriving)
    assert observer._mode == "contribute"
    for _ in collector:
        pass
    collector.shutdown()
    assert channel.close(timeout=60)
    # the driver's own write (4 items) and both workers' writes: one aggregate row
    assert scalars(logger, "rb/items_written") == [(rb.write_count, float(rb.write_count))]
    assert rb.write_count == 604
    assert scalars(logger, "rb/workers")[0][1] == 3  # two workers and the driver


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_buffer_last_rows_per_worker_and_lambda_one_liners(tmp_path, method):
    # Gauge-only sets still log each worker's last row; a one-liner's lambda travels to
    # spawn workers, and fork workers start from an empty window, not the driver's.
    logger = CSVLogger(exp_name="shared", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), shared=True)
    items = Sum("summed_items", lambda data: data.numel(), on="post_extend")
    rb.add_observer(
        LoggerObserver(
            channel, name="rb", scope="both", schedule=Every.counter("items_written", 300),
            metrics=[WriteMetrics(), items],
        )
    )
    rb.extend(_rows(100))  # the driver's own write, before the workers start
    collector = _pendulum_writing_into(rb, 600, method)
    for _ in collector:
        pass
    collector.shutdown()
    assert channel.close(timeout=60)
    assert scalars(logger, "rb/items_written")[-1][1] == 700
    assert sum(value for _, value in scalars(logger, "rb/summed_items")) == 700
    last = [scalars(logger, f"rb/worker_{w}/items_written")[-1][1] for w in (0, 1)]
    assert sum(last) == 600


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_collector_s_set_up_write_into_a_fresh_shared_buffer_is_not_data(tmp_path):
    # torchrl sets an uninitialised buffer up with one fake (zero-reward) write and empty().
    logger = CSVLogger(exp_name="setup", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000), shared=True)
    rb.add_observer(
        LoggerObserver(
            channel, name="rb", schedule=Every.counter("items_written", 10**9),
            metrics=WriteMetrics(reward_key=("next", "reward")),
        )
    )
    collector = _pendulum_writing_into(rb, 400)
    for _ in collector:
        pass
    collector.shutdown()
    assert channel.close(timeout=60)
    assert scalars(logger, "rb/items_written") == [(400, 400.0)]
    assert scalars(logger, "rb/writes")[-1][1] == 8  # 2 workers x 4 batches: no set-up write
    assert scalars(logger, "rb/reward_max")[-1][1] < 0  # Pendulum's rewards; no fake 0.0


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_collectors_writing_one_shared_buffer_are_four_workers(tmp_path):
    # Both collectors have a worker 0 and a worker 1: four processes, none overwriting another.
    logger = CSVLogger(exp_name="two", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), shared=True)
    rb.extend(_rows(4))  # a shared storage is initialised before it travels
    collectors = [_pendulum_writing_into(rb, 400) for _ in range(2)]
    observer = LoggerObserver(
        channel, name="rb", scope="both", schedule=Every.counter("items_written", 200),
        metrics=WriteMetrics(),
    )
    rb.add_observer(observer)  # mirrored to the running workers' copies
    # told when its copies were prepared: a contributor from its first event on, never local
    assert observer._copies_elsewhere and observer._mode != "local"
    for _ in zip(*collectors):
        pass
    for collector in collectors:
        collector.shutdown()
    assert channel.close(timeout=60)
    assert rb.write_count == 804
    assert scalars(logger, "rb/items_written")[-1][1] == 800  # the workers' writes
    assert scalars(logger, "rb/workers")[-1][1] == 4
    rows = ("worker_0", "worker_1", "worker_0_2", "worker_1_2")
    assert sum(scalars(logger, f"rb/{row}/items_written")[-1][1] for row in rows) == 800


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_collector_into_ray_buffer_one_logger(ray_cluster, tmp_path):
    from torchrl.collectors.distributed import RayCollector
    from torchrl.data import RayReplayBuffer

    logger = CSVLogger(exp_name="ray", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb = RayReplayBuffer(storage=partial(LazyTensorStorage, 10_000), batch_size=32, remote_config={"num_cpus": 0})
    env = GymEnv("Pendulum-v1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        collector = RayCollector(
            [partial(GymEnv, "Pendulum-v1")] * 2,
            RandomPolicy(env.action_spec),
            frames_per_batch=200,
            total_frames=800,
            sync=True,
            remote_configs={"num_cpus": 1},
        )
    collector.add_observer(LoggerObserver(channel, schedule=NEVER, metrics=CollectorBatchMetrics(), name="ray_collector"))
    rb.add_observer(
        LoggerObserver(channel, schedule=Every.counter("sample_calls", 10**9), metrics=[WriteMetrics(), SampleMetrics()], name="ray_rb")
    )
    written = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for batch in collector:
            rb.extend(batch.reshape(-1))
            written += batch.numel()
            rb.sample()
    collector.shutdown()
    rb.close()
    assert channel.close(timeout=60)
    assert scalars(logger, "ray_collector/frames") == [(800, 800.0)]
    assert scalars(logger, "ray_collector/workers")[0][1] == 2
    assert scalars(logger, "ray_rb/items_written")[0][1] == written
    assert scalars(logger, "ray_rb/sample_calls")[0][1] == 4


class FinalizeFails:
    """A mergeable partial whose ``finalize`` raises: its row cannot be written."""

    def merge(self, other):
        return self

    def finalize(self):
        raise ValueError("cannot finalize")


def contribute(channel, name, metrics, frames):
    """What a worker's observer copy submits: its window, with its counters and its schedule."""
    spec = AggregateSpec(NEVER, "frames")
    channel.submit_window(
        Window(f"{name}/worker_0", metrics, observer=name, worker=0, counters={"frames": frames}, spec=spec)
    )


def test_an_aggregate_failing_at_close_does_not_stop_the_others_last_rows(monkeypatch):
    logger = RecordingLogger()
    channel = MetricsChannel(logger, background=False, on_error="raise", health_interval=None)
    for name, frames in (("a", 10), ("broken", 20), ("unwritable", 30), ("c", 40)):
        contribute(channel, name, {"frames": float(frames)}, frames)
    contribute(channel, "unwritable", {"r": FinalizeFails()}, 30)
    channel.step()
    assert logger.calls == []  # the schedule is never due: only close logs the last windows

    aggregates = channel._logging.router(Window).aggregates
    assert list(aggregates) == ["a", "broken", "unwritable", "c"]

    def finish():
        raise RuntimeError("aggregate failed at close")

    monkeypatch.setattr(aggregates["broken"], "finish", finish)
    # "raise" stores the first error met: the unwritable row's, since the router
    # yields every other aggregate's rows before it raises the broken one's
    with pytest.raises(ValueError, match="cannot finalize"):
        channel.close()
    assert logger.series("a/frames") == [(10, 10.0)]
    assert logger.series("c/frames") == [(40, 40.0)]
    assert logger.series("c/workers") == [(40, 1)]
    assert not any(name.startswith(("broken/", "unwritable/")) for m, _ in logger.calls for name in m)
    assert aggregates == {}

