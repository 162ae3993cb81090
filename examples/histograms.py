"""Episode returns and observations as histograms in TensorBoard, merged across workers first.

Two CartPole workers (``MultiSyncCollector``); each folds its episode returns
into a quantile sketch and its pole angles into fixed bins; the owner merges
the workers' counts exactly and draws them with TensorBoard's pre-binned
``add_histogram_raw``. CSV or MLflow loggers would get the quantile scalars.

Run with ``python examples/histograms.py [out_dir]`` and open
``tensorboard --logdir <out_dir>`` (the HISTOGRAMS and DISTRIBUTIONS tabs).
"""

from __future__ import annotations

import sys

from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers.tensorboard import TensorboardLogger

import rl_observers  # noqa: F401
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    Histogram,
    LoggerObserver,
    MetricsChannel,
    draw_histograms,
)


def make_env():
    return GymEnv("CartPole-v1")


def pole_angle(batch):
    return batch["observation"][..., 2]


def main(out_dir: str = "runs/histograms", total_frames: int = 4_000) -> str:
    logger = TensorboardLogger(exp_name="histograms", log_dir=out_dir)
    channel = MetricsChannel(logger)
    draw_histograms(channel)  # opt-in: distributions also go to the histogram view
    collector = MultiSyncCollector(
        [make_env, make_env], RandomPolicy(make_env().action_spec), frames_per_batch=400, total_frames=total_frames
    )
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 1_000),
            metrics=[
                CollectorBatchMetrics(quantiles=(0.05, 0.5, 0.95)),  # episode_return_p50, ... and its histogram
                Histogram("pole_angle", pole_angle, edges=[i / 100 for i in range(-21, 22)]),
            ],
        )
    )
    for _ in collector:
        pass
    collector.shutdown()
    channel.close(timeout=60)
    logger.experiment.flush()
    print(f"histograms in {logger.experiment.log_dir}")
    return logger.experiment.log_dir


if __name__ == "__main__":
    main(*sys.argv[1:2])
