"""Episode returns of a CartPole collector, in TensorBoard.

``tensorboard --logdir runs/tensorboard`` then shows ``collector/episode_return_mean``
(and min/max, lengths, reward statistics), one point every 2,000 frames.

Run with ``python examples/episode_returns_tensorboard.py [out_dir]``.
"""

from __future__ import annotations

import sys

from torchrl.collectors import Collector
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import TensorboardLogger

import rl_observers  # noqa: F401  (adds add_observer / attach_logger to collectors)
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel


def main(out_dir: str = "runs/tensorboard", total_frames: int = 10_000) -> str:
    logger = TensorboardLogger(exp_name="cartpole_returns", log_dir=out_dir)
    env = GymEnv("CartPole-v1")
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=500, total_frames=total_frames)
    collector.add_observer(
        LoggerObserver(logger, schedule=Every.counter("frames", 2_000), metrics=CollectorBatchMetrics())
    )
    for _ in collector:  # training would happen here
        pass
    collector.shutdown()  # logs the last partial window
    MetricsChannel.for_logger(logger).close(timeout=30)
    logger.experiment.flush()
    print(f"TensorBoard event files in {logger.experiment.log_dir}")
    return str(logger.experiment.log_dir)


if __name__ == "__main__":
    main(*sys.argv[1:2])
