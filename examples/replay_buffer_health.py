"""Replay-buffer health on a prioritized buffer: how old sampled data is, and its priority weights.

A collector fills a ``TensorDictPrioritizedReplayBuffer``; a stand-in training
step samples from it and updates priorities. The buffer's ``LoggerObserver``
logs every 20 samples: ``sample_age_mean/min/max`` (items written since the
sampled items were written), ``priority_weight_mean/min/max`` and the write
statistics, to CSV.

Run with ``python examples/replay_buffer_health.py [out_dir]``.
"""

from __future__ import annotations

import sys

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import Every, LoggerObserver, MetricsChannel, SampleMetrics, WriteMetrics


def main(out_dir: str = "runs/buffer_health", total_frames: int = 5_000) -> dict:
    logger = CSVLogger(exp_name="buffer_health", log_dir=out_dir)
    buffer = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(2_000), batch_size=64
    )
    buffer.add_observer(
        LoggerObserver(
            logger,
            schedule=Every.counter("sample_calls", 20),
            metrics=[WriteMetrics(reward_key=("next", "reward")), SampleMetrics()],
            name="buffer",
        )
    )
    env = GymEnv("CartPole-v1")
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=250, total_frames=total_frames)
    for batch in collector:
        buffer.extend(batch)
        for _ in range(5):
            sample = buffer.sample()
            sample["td_error"] = torch.rand(sample.shape)  # what a loss would compute
            buffer.update_tensordict_priority(sample)
    collector.shutdown()
    MetricsChannel.for_logger(logger).close(timeout=30)
    scalars = logger.experiment.scalars
    for name in ("buffer/sample_age_mean", "buffer/sample_age_max", "buffer/priority_weight_mean"):
        step, value = scalars[name][-1]
        print(f"{name:<30} at sample {step:>4}: {value:9.3f}")
    return {name: values for name, values in scalars.items()}


if __name__ == "__main__":
    main(*sys.argv[1:2])
