"""The far-node flows of issue 22: what a user does with Ray sources on another node.

Each flow builds its sources pinned to the far node of a
:func:`tests.multinode.two_node_cluster`, observes them with one
:class:`~rl_observers.LoggerObserver` writing to a ``CSVLogger`` on the
driver, runs the flow to its end and returns a :class:`Result`: what the
logger's last row says against what the sources did. Shared by
``tests/test_far_node_flows.py`` (each flow once) and
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
        lost = sum(self.health.get(k, 0) for k in ("dropped", "remote_dropped", "windows_lost", "copies_lost"))
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
    flushed = channel.flush(timeout=20)
    health = dict(channel.health())
    closed = channel.close()
    return Result("collector/frames", FRAMES, _scalars(logger, "collector/frames"), health, flushed, closed)


FLOWS: dict[str, Callable[[Any, str], Result]] = {
    "collect_shutdown_flush_close": collect_shutdown_flush_close,
}
