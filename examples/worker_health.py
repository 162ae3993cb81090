"""Throughput and health of each worker: frames per second, memory, and who went silent.

Two CartPole workers (``MultiSyncCollector``) with ``WorkerHealth`` next to the
usual metrics, logged per worker and aggregated (``scope="both"``): rates add
up across workers, memory and staleness take the maximum.

Run with ``python examples/worker_health.py [out_dir]``.
"""

from __future__ import annotations

import sys

from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel, WorkerHealth


def make_env():
    return GymEnv("CartPole-v1")


def main(out_dir: str = "runs/health", total_frames: int = 6_000) -> dict[str, list]:
    logger = CSVLogger(exp_name="health", log_dir=out_dir)
    channel = MetricsChannel(logger)
    collector = MultiSyncCollector(
        [make_env, make_env], RandomPolicy(make_env().action_spec), frames_per_batch=500, total_frames=total_frames
    )
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 2_000),
            metrics=[CollectorBatchMetrics(), WorkerHealth()],  # opt-in, one more set
            scope="both",  # collector/worker_<i>/... and collector/...
        )
    )
    for _ in collector:
        pass
    collector.shutdown()
    channel.close(timeout=60)
    rows = {name: values for name, values in logger.experiment.scalars.items() if "second" in name or "_mb" in name}
    for name, values in sorted(rows.items()):
        print(f"{name:<48} {values[-1][1]:>10.1f}")
    return rows


if __name__ == "__main__":
    main(*sys.argv[1:2])
