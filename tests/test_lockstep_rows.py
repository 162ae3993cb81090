"""Aggregate rows of lockstep collectors are the rows one observer on the driver would log.

A ``MultiSyncCollector`` or ``RayCollector(sync=True)`` yields batches that
join every worker's rollout in lockstep. Its observer copies cut their windows
where the driver's rows fall (``rl_observers.remote.lockstep``), so each
aggregate row equals, step for step and value for value, what a driver-side
observer logs over the yielded batches (computed in the test from the data),
in every run.
"""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
from torchrl.collectors import MultiSyncCollector
from torchrl.data import LazyMemmapStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.record.loggers.monitoring import Every

from rl_observers import CollectorBatchMetrics, LoggerObserver, MetricsChannel
from rl_observers.remote.aggregate import Aggregate
from rl_observers.remote.window import AggregateSpec, Window
from rl_observers.stats import Count
from tests import remote_rows_truth
from tests.helpers import start_method
from tests.remote_rows_truth import assert_rows_equal, driver_rows, logged_rows

pytestmark = pytest.mark.timeout(240)

FRAMES, PER_BATCH, EVERY = 6000, 500, 1000
#: One Ray for the module's Ray tests (tests/conftest.py's ``ray_cluster``): the truth travels by value.
RAY_BY_VALUE = (remote_rows_truth,)


def _cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


def _observe(collector, tmp: str) -> tuple[CSVLogger, MetricsChannel]:
    logger = CSVLogger(exp_name="rows", log_dir=tmp)
    channel = MetricsChannel(logger)
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", EVERY),
            metrics=CollectorBatchMetrics(),
            scope="aggregate",
        )
    )
    return logger, channel


def _observed_multisync(seed: int, **kwargs) -> tuple[MultiSyncCollector, CSVLogger, MetricsChannel]:
    """The issue's 2-worker CartPole ``MultiSyncCollector``, seeded and observed (``kwargs``: torchrl's)."""
    collector = MultiSyncCollector(
        [_cartpole, _cartpole],
        RandomPolicy(_cartpole().action_spec),
        frames_per_batch=PER_BATCH,
        total_frames=FRAMES,
        **kwargs,
    )
    collector.set_seed(seed)
    return collector, *_observe(collector, tempfile.mkdtemp())


def _multisync_run(seed: int) -> tuple[dict, dict]:
    collector, logger, channel = _observed_multisync(seed)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        torch.randn(64, 64) @ torch.randn(64, 64)  # a short training step
    collector.shutdown()
    assert channel.flush(timeout=30)
    assert channel.close(timeout=30)
    assert batches[0].shape == torch.Size([2, PER_BATCH // 2])  # stacked by worker
    return logged_rows(logger, "collector"), driver_rows(batches, EVERY)


@pytest.mark.real_collector
@pytest.mark.slow
def test_multisync_aggregate_rows_are_the_driver_s_rows_in_every_run():
    with start_method("fork"):
        first, truth = _multisync_run(seed=1)
        assert_rows_equal(first, truth)
        assert [s for s, _ in first["frames"]] == [1000, 2000, 3000, 4000, 5000, 6000]
        second, truth_again = _multisync_run(seed=1)
        assert_rows_equal(second, truth_again)
    for series in first:  # two identical seeded runs log the same steps
        assert [s for s, _ in first[series]] == [s for s, _ in second[series]]


def _continues(previous, rollout) -> bool:
    """Whether ``rollout`` goes on from ``previous`` (the same env: its episode did not end there)."""
    return (
        previous is not None
        and not bool(previous["next", "done"][-1])
        and torch.equal(previous["next", "observation"][-1], rollout["observation"][0])
    )


def _rollouts_by_worker(stored, per_worker: int) -> list:
    """The ``[2, per_worker]`` batches the workers wrote, from the buffer's items in write order.

    In lockstep, both workers write rollout ``k`` (one ``extend`` each) before either
    starts rollout ``k + 1``, in either order: a rollout belongs to the worker whose
    episode it goes on with (where both episodes ended, either order gives the same rows).
    """
    rollouts = stored.split(per_worker)
    last = [None, None]  # each worker's previous rollout
    batches = []
    for first, second in zip(rollouts[::2], rollouts[1::2]):
        if _continues(last[0], second) or _continues(last[1], first):
            first, second = second, first
        last = [first, second]
        batches.append(torch.stack([first, second]))
    return batches


def _multisync_buffer_run(seed: int) -> tuple[dict, dict]:
    rb = ReplayBuffer(storage=LazyMemmapStorage(2 * FRAMES))  # memory the workers write and the test reads
    collector, logger, channel = _observed_multisync(seed, replay_buffer=rb)
    for batch in collector:
        assert batch is None  # the workers wrote it into the buffer
    collector.shutdown()
    assert channel.flush(timeout=30)
    assert channel.close(timeout=30)
    assert rb.write_count == FRAMES
    stored = rb.storage.get(torch.arange(FRAMES))
    return logged_rows(logger, "collector"), driver_rows(
        _rollouts_by_worker(stored, PER_BATCH // 2), EVERY
    )


@pytest.mark.real_collector
@pytest.mark.slow
def test_multisync_writing_a_buffer_logs_the_rows_of_what_its_workers_wrote():
    """Buffer mode (iteration yields ``None``): the truth is what the workers wrote, batch by batch."""
    with start_method("fork"):
        first, truth = _multisync_buffer_run(seed=3)
        assert_rows_equal(first, truth)
        second, truth_again = _multisync_buffer_run(seed=3)
        assert_rows_equal(second, truth_again)
    assert (
        [s for s, _ in first["frames"]]
        == [s for s, _ in second["frames"]]
        == [1000, 2000, 3000, 4000, 5000, 6000]
    )


@pytest.mark.real_collector
def test_an_observer_attached_mid_run_logs_the_driver_s_next_rows(tmp_path):
    """Attached after 80 frames (4 batches of 20), every 40: the driver's next rows are 120, 160, 200."""
    from torchrl.testing.mocking_classes import CountingEnv

    def counting():
        return CountingEnv(max_steps=4)

    with start_method("fork"):
        collector = MultiSyncCollector(
            [counting, counting], RandomPolicy(counting().action_spec), frames_per_batch=20, total_frames=200
        )
        batches = iter(collector)
        before = [next(batches) for _ in range(4)]
        logger = CSVLogger(exp_name="attached", log_dir=str(tmp_path))
        channel = MetricsChannel(logger)
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", 40), metrics=CollectorBatchMetrics())
        )
        after = [batch.numel() for batch in batches]
        collector.shutdown()
    assert channel.close(timeout=30)
    assert sum(b.numel() for b in before) == 80 and sum(after) == 120
    assert logger.experiment.scalars["collector/frames"] == [(120, 120.0), (160, 160.0), (200, 200.0)]


def _ray_sync_run() -> tuple[dict, dict]:
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector

    env = _cartpole()
    collector = RayCollector(
        [_cartpole, _cartpole],
        RandomPolicy(env.action_spec),
        collector_class=Collector,
        frames_per_batch=PER_BATCH,
        total_frames=FRAMES,
        sync=True,
        remote_configs={"num_cpus": 0.5},
    )
    logger, channel = _observe(collector, tempfile.mkdtemp())
    batches = [batch.clone() for batch in collector]
    collector.shutdown(shutdown_ray=False)
    assert channel.flush(timeout=30)
    assert channel.close(timeout=30)
    if batches[0].ndim == 1:  # concatenated: one [time] rollout per remote collector
        batches = [b.reshape(2, -1) for b in batches]
    return logged_rows(logger, "collector"), driver_rows(batches, EVERY)


@pytest.mark.real_collector
@pytest.mark.slow
def test_ray_sync_collector_aggregate_rows_are_the_driver_s_rows_in_every_run(ray_cluster):
    first, truth = _ray_sync_run()
    second, truth_again = _ray_sync_run()
    assert_rows_equal(first, truth)
    assert_rows_equal(second, truth_again)
    for series in first:  # two runs log the same steps, whatever the actors' timing
        assert [s for s, _ in first[series]] == [s for s, _ in second[series]], series
    assert [s for s, _ in first["frames"]] == [1000, 2000, 3000, 4000, 5000, 6000]


@pytest.mark.slow
def test_a_ray_replay_buffer_logs_the_rows_of_the_same_buffer_in_process(ray_cluster):
    from functools import partial

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    series = ("sample_calls", "samples_returned", "items_written", "writes")

    def drive(rb, tmp: str) -> dict[str, list]:
        logger = CSVLogger(exp_name="rb", log_dir=tmp)
        channel = MetricsChannel(logger)
        rb.add_observer(
            LoggerObserver(channel, schedule=Every.counter("sample_calls", 10), name="rb")
        )
        for i in range(30):
            rb.extend(torch.arange(8) + 8 * i)
            rb.sample(4)
        close = getattr(rb, "close", None)
        if close is not None:
            close()
        assert channel.flush(timeout=30)
        assert channel.close(timeout=30)
        return {
            name: [(int(s), float(v)) for s, v in logger.experiment.scalars.get(f"rb/{name}", [])]
            for name in series
        }

    here = drive(ReplayBuffer(storage=LazyTensorStorage(1000)), tempfile.mkdtemp())
    assert [s for s, _ in here["sample_calls"]] == [10, 20, 30]
    from torchrl.data import RayReplayBuffer

    there = drive(
        RayReplayBuffer(
            storage=partial(LazyTensorStorage, 1000),
            batch_size=4,
            remote_config={"num_cpus": 0},
        ),
        tempfile.mkdtemp(),
    )
    assert there == here


# -- the owner's side, window by window -------------------------------------------------------------


def _window(worker: int, frames: int, n: int, *, due: bool = True, last: bool = False) -> Window:
    spec = AggregateSpec(
        Every.counter("frames", 1000), "frames", workers=2, lockstep=True, timeout=5.0
    )
    return Window(
        f"c/worker_{worker}",
        {"frames": float(frames), "n": Count("n", n)},
        observer="c",
        worker=worker,
        counters={"frames": frames},
        spec=spec,
        cut=frames * 2,
        due=due,
        last=last,
    )


def test_a_cut_is_logged_once_every_worker_s_window_of_it_is_in():
    agg = Aggregate.from_spec("c", _window(0, 500, 1).spec)
    assert agg.receive(_window(0, 500, 1)) == []  # worker 1's window of the cut is missing
    assert agg.receive(_window(0, 1000, 2)) == []  # worker 0 ran ahead: its next cut waits too
    ((name, metrics, step),) = agg.receive(_window(1, 500, 4))
    assert (name, step) == ("c", 1000)
    assert (
        metrics["frames"] == 1000.0 and metrics["n"].n == 5.0
    )  # worker 0's second window is not in
    assert metrics["workers_reporting"] == 2
    ((_, metrics, step),) = agg.receive(_window(1, 1000, 8))
    assert step == 2000 and metrics["frames"] == 2000.0 and metrics["n"].n == 10.0


def test_a_silent_worker_holds_rows_back_only_for_worker_timeout(caplog):
    agg = Aggregate.from_spec("c", _window(0, 500, 1).spec)
    assert agg.receive(_window(0, 500, 1)) == []
    assert agg.overdue(now=float("-inf")) == []  # still within its wait
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        ((_, metrics, step),) = agg.overdue(now=float("inf"))  # the wait is over
    assert step == 1000 and metrics["workers_reporting"] == 1 and metrics["n"].n == 1.0
    (message,) = [r.getMessage() for r in caplog.records if "worker_timeout" in r.getMessage()]
    assert "worker 1" in message
    # its late window is never lost: it goes into the next row, whose step still rises
    assert agg.receive(_window(1, 500, 4)) == []
    assert agg.receive(_window(0, 1000, 2)) == []
    ((_, metrics, step),) = agg.receive(_window(1, 1000, 8))
    assert step == 2000 and metrics["n"].n == 14.0 and metrics["frames"] == 2000.0


def test_the_last_windows_make_the_last_row_at_close():
    agg = Aggregate.from_spec("c", _window(0, 500, 1).spec)
    agg.receive(_window(0, 500, 1))
    agg.receive(_window(1, 500, 2))
    agg.receive(_window(0, 750, 4, due=False, last=True))
    agg.receive(_window(1, 750, 8, due=False, last=True))
    ((_, metrics, step),) = agg.finish()
    assert step == 1500 and metrics["n"].n == 12.0
