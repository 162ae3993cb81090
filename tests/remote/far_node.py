"""The far-node flows of issue 22: what a user does with Ray sources on another node.

Each flow builds its sources pinned to the far node of a
:func:`tests.remote.multinode.two_node_cluster`, observes them with one
:class:`~rl_observers.LoggerObserver` writing to a ``CSVLogger`` on the
driver, runs the flow to its end and returns a :class:`Result`: what the
logger's last row says against what the sources did. Shared by
``tests/remote/test_far_node_flows.py`` (each flow once) and
``scripts/far_node_flows.py`` (the stress loop).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from torchrl.record import CSVLogger

from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel

__all__ = ["FLOWS", "Result"]

FRAMES = 3000
FRAMES_PER_BATCH = 100


@dataclasses.dataclass
class Result:
    """The last logged value of ``key`` against what the sources did, and the channel's health."""

    key: str
    expected: float
    rows: list[tuple[int, float]]
    health: dict[str, float]
    flushed: bool
    closed: bool

    @property
    def last(self) -> float | None:
        return self.rows[-1][1] if self.rows else None

    @property
    def exact(self) -> bool:
        lost = sum(self.health.get(k, 0) for k in ("dropped", "copies_lost", "exit_code", "warnings"))
        return self.last == self.expected and lost == 0 and self.flushed and self.closed

    def __str__(self) -> str:
        health = {k: v for k, v in self.health.items() if v}
        return (
            f"{self.key}: last {self.last} of {self.expected}, rows {[r[0] for r in self.rows]}, "
            f"flushed {self.flushed}, closed {self.closed}, health {health}"
        )


def _far_collector(cluster: Any, **kwargs: Any) -> Any:
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs.utils import RandomPolicy
    from torchrl.testing.mocking_classes import CountingEnv

    def make_env() -> Any:
        return CountingEnv(max_steps=7)

    env = make_env()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return RayCollector(
            [make_env, make_env],
            RandomPolicy(env.action_spec),
            collector_class=Collector,
            frames_per_batch=FRAMES_PER_BATCH,
            total_frames=FRAMES,
            remote_configs={"num_cpus": 0, "resources": dict(cluster.far)},
            **kwargs,
        )


def _scalars(logger: Any, name: str) -> list[tuple[int, float]]:
    return list(logger.experiment.scalars.get(name, []))


def _settled(channel: Any, logger: Any, key: str, expected: float) -> Result:
    """The end of every flow: ``flush(timeout=20)``, the channel's health, ``close()``."""
    flushed = channel.flush(timeout=20)
    health = dict(channel.health())
    closed = channel.close()
    return Result(key, expected, _scalars(logger, key), health, flushed, closed)


def collect_shutdown_flush_close(cluster: Any, tmp: str) -> Result:
    """Iterate to the end, ``shutdown()``, ``flush(timeout=20)``, ``close()``."""
    logger = CSVLogger(exp_name="far", log_dir=tmp)
    channel = MetricsChannel(logger, health_interval=None)
    collector = _far_collector(cluster, sync=True)
    collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=CollectorBatchMetrics())
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in collector:
            pass
    collector.shutdown()
    return _settled(channel, logger, "collector/frames", FRAMES)


FLOWS: dict[str, Callable[[Any, str], Result]] = {
    "collect_shutdown_flush_close": collect_shutdown_flush_close,
}


def start_async_shutdown(cluster: Any, tmp: str) -> Result:
    """``.start()`` (writing into a far ``RayReplayBuffer``), wait for the end, ``async_shutdown()``."""
    import asyncio
    from functools import partial

    from torchrl.data import LazyTensorStorage, RayReplayBuffer

    logger = CSVLogger(exp_name="far", log_dir=tmp)
    channel = MetricsChannel(logger, health_interval=None)
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100_000),
        batch_size=32,
        remote_config={"num_cpus": 0, "resources": dict(cluster.far)},
    )
    collector = _far_collector(cluster, sync=True, replay_buffer=rb)
    collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=CollectorBatchMetrics())
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        collector.start()
        collector._collection_thread.join(timeout=240)
        asyncio.run(collector.async_shutdown())
    rb.close()
    return _settled(channel, logger, "collector/frames", FRAMES)


def replay_buffer_write_sample_close(cluster: Any, tmp: str) -> Result:
    """A far ``RayReplayBuffer`` written and sampled, then ``close()``, ``flush``, ``close``."""
    from functools import partial

    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, RayReplayBuffer

    from rl_observers import SampleMetrics, WriteMetrics

    logger = CSVLogger(exp_name="far", log_dir=tmp)
    channel = MetricsChannel(logger, health_interval=None)
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100_000),
        batch_size=32,
        remote_config={"num_cpus": 0, "resources": dict(cluster.far)},
    )
    rb.add_observer(
        LoggerObserver(
            channel, schedule=Every.counter("sample_calls", 25), metrics=[WriteMetrics(), SampleMetrics()], name="rb"
        )
    )
    samples = 0
    for i in range(20):
        rb.extend(TensorDict({"obs": torch.full((50, 1), float(i))}, batch_size=[50]))
        for _ in range(7):
            rb.sample()
            samples += 1
    rb.close()
    return _settled(channel, logger, "rb/sample_calls", samples)


def remove_observer_mid_run(cluster: Any, tmp: str) -> Result:
    """``remove_observer`` after half the batches, iterate to the end, shutdown, flush, close."""
    logger = CSVLogger(exp_name="far", log_dir=tmp)
    channel = MetricsChannel(logger, health_interval=None)
    collector = _far_collector(cluster, sync=True)
    observer = LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=CollectorBatchMetrics())
    collector.add_observer(observer)
    received = at_removal = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for batch in collector:
            received += batch.numel()
            if received == FRAMES // 2 + FRAMES_PER_BATCH:
                collector.remove_observer(observer)
                at_removal = received
    collector.shutdown()
    return _settled(channel, logger, "collector/frames", at_removal)


_EXIT_SCRIPT = r"""
import sys, warnings
sys.path.insert(0, sys.argv[1])
import ray
ray.init(address=sys.argv[2], log_to_driver=False)
from torchrl.record import CSVLogger
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from tests.remote.far_node import _far_collector

class Far:
    far = {"far_node": 0.01}

logger = CSVLogger(exp_name="far", log_dir=sys.argv[3])
channel = MetricsChannel(logger, health_interval=None)
collector = _far_collector(Far, sync=True)
collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=CollectorBatchMetrics()))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    for _ in collector:
        pass
collector.shutdown()
# no channel.close(): the interpreter's exit closes it
"""


def exit_without_close(cluster: Any, tmp: str) -> Result:
    """A driver that iterates, ``shutdown()``s and exits without ``close()`` (a subprocess)."""
    import glob
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, root, cluster.address, tmp],
        capture_output=True,
        text=True,
        timeout=400,
    )
    rows: list[tuple[int, float]] = []
    for path in glob.glob(os.path.join(tmp, "**", "collector", "frames.csv"), recursive=True) + glob.glob(
        os.path.join(tmp, "**", "collector_frames.csv"), recursive=True
    ):
        with open(path) as file:
            rows = [(int(float(s)), float(v)) for s, v in (line.strip().split(",")[:2] for line in file if line.strip())]
    health = {"exit_code": done.returncode} if done.returncode else {}
    lost = [line for line in done.stderr.splitlines() if "vanished" in line or "never arrived" in line]
    if lost:
        health["warnings"] = len(lost)
    return Result("collector/frames", FRAMES, rows, health, done.returncode == 0, not lost)


FLOWS.update(
    start_async_shutdown=start_async_shutdown,
    replay_buffer_write_sample_close=replay_buffer_write_sample_close,
    remove_observer_mid_run=remove_observer_mid_run,
    exit_without_close=exit_without_close,
)
