"""Metrics from Ray actors on another node reach the driver's logger, exactly.

One two-node cluster (:mod:`tests.remote.multinode`) serves the whole module; the
far node shares no temporary files with the driver, so the channel's socket
does not exist there and handles send through Ray. Each test owns a plain Ray
actor holding a torchrl replay buffer observed by a copy of a driver-side
:class:`~rl_observers.LoggerObserver`, pinned to a node with custom
resources. Ground truth is computed from the data the actors report back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torchrl.record import CSVLogger

from rl_observers import Every, LoggerObserver, MetricsChannel, WriteMetrics
from rl_observers.remote.aggregate import finish_aggregate
from tests.helpers import assert_balanced, scalars, wait_for
from tests.remote.multinode import ONE_CLUSTER_AT_A_TIME, cluster_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), ONE_CLUSTER_AT_A_TIME]

NEVER = Every.counter("items_written", 10**12)


cluster = cluster_fixture()


def _buffer_actor(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class Buffer:
        """A torchrl replay buffer observed by a copy of the driver's LoggerObserver."""

        def observe(self, observer: LoggerObserver, worker: int) -> None:
            """A new buffer, observed by ``observer`` (actors are shared by the module's tests)."""
            from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

            import rl_observers  # noqa: F401  (installs add_observer on torchrl's buffers)
            from rl_observers.sources.placement import place

            self.rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000))
            place(self.rb, worker, 2)
            self.observer = observer
            self.rb.add_observer(observer)
            self.rewards: list[float] = []

        def where(self) -> tuple[str, str, bool]:
            socket = self.observer._sink._addresses.get("socket")
            return (
                ray.get_runtime_context().get_node_id(),
                self.observer._sink.transport,
                socket is not None and os.path.exists(socket),
            )

        def write(self, batches: int, size: int, seed: int, pause: float = 0.0) -> int:
            from tensordict import TensorDict

            generator = torch.Generator().manual_seed(seed)
            for _ in range(batches):
                reward = torch.randn(size, 1, generator=generator, dtype=torch.float64)
                self.rb.extend(TensorDict({"next": {"reward": reward}}, batch_size=[size]))
                self.rewards += reward.reshape(-1).tolist()
                if pause:
                    time.sleep(pause)
            return len(self.rewards)

        def written(self) -> list[float]:
            return self.rewards

        def remove(self) -> bool:
            self.rb.remove_observer(self.observer)
            return self.observer._sink.flush(10.0)

        def dropped(self) -> int:
            return self.observer._sink.dropped

        def use(self, handle: Any, count: int) -> tuple[str, int, list[str]]:
            """Submits through ``handle``; returns its transport, its drops and the warnings."""
            import logging

            records: list[str] = []

            class Keep(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    records.append(record.getMessage())

            keep = Keep()
            logging.getLogger("torchrl").addHandler(keep)
            try:
                for i in range(count):
                    handle.submit_metrics({"x": float(i)}, namespace="lost")
            finally:
                logging.getLogger("torchrl").removeHandler(keep)
            return handle.transport, handle.dropped, records

    return Buffer


def _observer(
    channel: MetricsChannel, name: str, scope: str, schedule: Every = NEVER, worker_timeout: float = 10.0
) -> LoggerObserver:
    return LoggerObserver(
        channel,
        schedule=schedule,
        metrics=WriteMetrics(reward_key=("next", "reward")),
        name=name,
        scope=scope,
        report_interval=0.1,
        worker_timeout=worker_timeout,
    )


@pytest.fixture(scope="module")
def actors(cluster) -> Iterator[tuple[Any, Any]]:
    """One buffer actor on the far node, one on the head node (torch loads once in each)."""
    import ray

    Buffer = _buffer_actor(ray)
    far = Buffer.options(resources=cluster.far).remote()
    head = Buffer.options(resources=cluster.head).remote()
    yield far, head
    for actor in (far, head):
        ray.kill(actor)


def _pair(ray: Any, actors: tuple[Any, Any], observer: LoggerObserver) -> tuple[Any, Any]:
    far, head = actors
    ray.get([far.observe.remote(observer, 1), head.observe.remote(observer, 0)])
    return far, head


def _truth(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {
        "mean": t.mean().item(),
        "min": t.min().item(),
        "max": t.max().item(),
        "std": t.std(unbiased=False).item(),
    }


def _check(logger: Any, namespace: str, values: list[float]) -> None:
    truth = _truth(values)
    for stat in ("mean", "min", "max", "std"):
        rows = scalars(logger, f"{namespace}/reward_{stat}")
        assert len(rows) == 1, (namespace, stat, rows)
        assert rows[0][1] == pytest.approx(truth[stat], rel=1e-6, abs=1e-9), (namespace, stat)
    assert scalars(logger, f"{namespace}/items_written")[0][1] == len(values)


@pytest.mark.real_collector
def test_far_node_windows_reach_the_drivers_csv_exactly(cluster, actors, tmp_path):
    """scope="both", log_on_close at shutdown: far node through Ray, head node through the socket."""
    ray = pytest.importorskip("ray")
    logger = CSVLogger(exp_name="far", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    far, head = _pair(ray, actors, _observer(channel, "both", "both"))
    where_far, where_head = ray.get([far.where.remote(), head.where.remote()])
    assert where_far == (cluster.far_node_id, "ray", False)  # the socket does not exist there
    assert where_head == (cluster.head_node_id, "socket", True)
    ray.get([far.write.remote(20, 16, seed=1), head.write.remote(10, 16, seed=2)])
    far_values, head_values = ray.get([far.written.remote(), head.written.remote()])
    assert ray.get([far.remove.remote(), head.remove.remote()]) == [True, True]
    start = time.monotonic()
    assert channel.close(timeout=30)  # the owner's router logs the last windows (log_on_close)
    assert time.monotonic() - start < 30
    _check(logger, "both", far_values + head_values)
    _check(logger, "both/worker_1", far_values)
    _check(logger, "both/worker_0", head_values)
    assert scalars(logger, "both/workers")[0][1] == 2
    health = channel.health()
    assert health["dropped"] == 0


@pytest.mark.real_collector
@pytest.mark.parametrize("scope", ["aggregate", "per_worker"])
def test_remove_observer_then_flush_delivers_everything(cluster, actors, tmp_path, scope):
    ray = pytest.importorskip("ray")
    logger = CSVLogger(exp_name=scope, log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    far, head = _pair(ray, actors, _observer(channel, scope, scope))
    ray.get([far.write.remote(8, 8, seed=3), head.write.remote(4, 8, seed=4)])
    far_values, head_values = ray.get([far.written.remote(), head.written.remote()])
    assert ray.get([far.remove.remote(), head.remove.remote()]) == [True, True]
    finish_aggregate(channel, scope)  # what removing the original does once its copies are gone
    assert channel.flush(timeout=30)
    if scope == "aggregate":
        _check(logger, scope, far_values + head_values)
        assert not scalars(logger, f"{scope}/worker_1/reward_mean")
    else:
        _check(logger, f"{scope}/worker_1", far_values)
        _check(logger, f"{scope}/worker_0", head_values)
        assert not scalars(logger, f"{scope}/reward_mean")
    assert channel.close(timeout=10)


@pytest.mark.real_collector
def test_killing_the_ingest_mid_run(cluster, actors, tmp_path, warnings_seen):
    """Collection goes on; the owner's health shows the loss; flush/close return in time."""
    ray = pytest.importorskip("ray")
    victim = "ingest"
    logger = CSVLogger(exp_name=victim, log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    # the buffer is placed as worker 1 of 2 and worker 0 never writes: rows wait 0.5 s for it at most
    observer = _observer(channel, victim, "aggregate", schedule=Every.counter("items_written", 64), worker_timeout=0.5)
    far, _ = actors
    ray.get(far.observe.remote(observer, 1))
    ray.get(far.write.remote(2, 8, seed=5))
    running = far.write.remote(150, 8, seed=6, pause=0.01)  # ~2 s of writes
    address = channel.handle()._addresses["ray"]
    deadline = time.monotonic() + 20
    while True:
        try:
            target = ray.get_actor(address.ingest, namespace=address.namespace)
            break
        except ValueError:
            assert time.monotonic() < deadline, "no ingest actor"
            time.sleep(0.05)
    time.sleep(0.5)
    ray.kill(target)
    written = ray.get(running, timeout=60)  # collection went on
    assert written == 8 * 152
    assert ray.get(far.remove.remote())
    start = time.monotonic()
    channel.flush(timeout=10)
    assert time.monotonic() - start < 12
    assert_balanced(channel.health())
    # the row waited for worker 0 (never heard from) for worker_timeout at most, then was logged
    assert wait_for(lambda: scalars(logger, f"{victim}/items_written"), timeout=10)
    frames = scalars(logger, f"{victim}/items_written")
    assert frames and frames[-1][1] <= written  # rows go on after the fault
    start = time.monotonic()
    channel.close(timeout=10)
    assert time.monotonic() - start < 12
    health = channel.health()
    assert_balanced(health)
    assert health["dropped"] >= 1  # what the dead ingest held, counted
    assert [m for m in warnings_seen if "ingest actor died" in m]


@pytest.mark.real_collector
def test_unreachable_owner_warns_once_and_counts(cluster, actors, tmp_path):
    """A handle that reaches its owner by no transport says so once, and counts its drops."""
    ray = pytest.importorskip("ray")
    logger = CSVLogger(exp_name="lost", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    handle = channel.handle(transport="socket")  # forced: the socket does not reach the far node
    far, _ = actors
    transport, dropped, records = ray.get(far.use.remote(handle, 5))
    assert (transport, dropped) == ("unreachable", 5)
    assert len(records) == 1 and "cannot reach its owner MetricsChannel" in records[0]
    assert "socket" in records[0]
    channel.close(timeout=10)
