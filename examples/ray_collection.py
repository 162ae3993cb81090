"""Ray collection watched where the data is: a RayCollector writing into a RayReplayBuffer.

Two remote collectors (Ray actors) write CartPole transitions straight into a
replay buffer that lives in its own Ray actor, while the driver samples from
it. Observers run inside those actors; only reduced numbers travel to the
driver's metrics channel, which merges the collectors' partial statistics
exactly (the episode return mean is over every episode of every worker) and
logs everything to one CSV logger.

Run with ``python examples/ray_collection.py [out_dir]``.
"""

from __future__ import annotations

import os
import sys
import warnings
from functools import partial

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from torchrl.collectors.distributed import RayCollector  # noqa: E402
from torchrl.data import LazyTensorStorage, RayReplayBuffer  # noqa: E402
from torchrl.envs import GymEnv, RewardSum, StepCounter, TransformedEnv  # noqa: E402
from torchrl.envs.utils import RandomPolicy  # noqa: E402
from torchrl.record import CSVLogger  # noqa: E402

import rl_observers  # noqa: E402,F401
from rl_observers import (  # noqa: E402
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)


def make_env() -> TransformedEnv:
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter(max_steps=200))
    env.append_transform(RewardSum())
    return env


def main(out_dir: str = "runs/ray", total_frames: int = 4_000, frames_per_batch: int = 200) -> dict:
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    logger = CSVLogger(exp_name="ray_collection", log_dir=out_dir)
    channel = MetricsChannel(logger)
    buffer = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100_000), batch_size=128, remote_config={"num_cpus": 0}
    )
    env = make_env()
    with warnings.catch_warnings():  # a random policy has no weights to synchronise
        warnings.simplefilter("ignore", UserWarning)
        collector = RayCollector(
            [make_env, make_env],
            RandomPolicy(env.action_spec),
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
            sync=True,
            remote_configs={"num_cpus": 1},
        )
    # Runs inside each remote collector; the channel's owner merges the two workers' windows.
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 1_000),
            metrics=CollectorBatchMetrics(),
            scope="both",
            name="collector",
        )
    )
    # Runs inside the buffer's actor: no extra round trip per write or sample.
    buffer.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("sample_calls", 10),
            metrics=[WriteMetrics(), SampleMetrics()],
            name="buffer",
        )
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for batch in collector:
                buffer.extend(batch.reshape(-1))
                for _ in range(4):
                    buffer.sample()
    finally:
        collector.shutdown()
        buffer.close()
        channel.close(timeout=60)
        if started_ray:
            ray.shutdown()
    scalars = logger.experiment.scalars
    summary = {name: values[-1] for name, values in sorted(scalars.items()) if "/" in name}
    for name in (
        "collector/frames",
        "collector/workers_reporting",
        "collector/episode_return_mean",
        "collector/worker_0/frames",
        "collector/worker_1/frames",
        "buffer/items_written",
        "buffer/sample_calls",
        "buffer/sample_age_mean",
    ):
        if name in summary:
            step, value = summary[name]
            print(f"{name:<32} step {step:>6}  {value:10.2f}")
    return summary


if __name__ == "__main__":
    main(*sys.argv[1:2])
