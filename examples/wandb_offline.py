"""The same observers logging to Weights & Biases, offline (no account, no network).

``WANDB_MODE=offline`` makes W&B write the run under ``<out_dir>/wandb``; sync
it later with ``wandb sync``.

Run with ``python examples/wandb_offline.py [out_dir]``.
"""

from __future__ import annotations

import os
import sys

from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import WandbLogger

import rl_observers  # noqa: F401
from rl_observers import Every, MetricsChannel


def main(out_dir: str = "runs/wandb", total_frames: int = 3_000) -> str:
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    os.makedirs(out_dir, exist_ok=True)
    logger = WandbLogger(exp_name="rl_observers_offline", save_dir=out_dir, offline=True, project="rl_observers")
    env = GymEnv("CartPole-v1")
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=500, total_frames=total_frames)
    buffer = ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=64)
    collector.attach_logger(logger, schedule=Every.counter("frames", 1_000))  # episode metrics
    buffer.attach_logger(logger, schedule=Every.counter("sample_calls", 10))  # write + sample metrics
    for batch in collector:
        buffer.extend(batch)
        for _ in range(5):
            buffer.sample()
    collector.shutdown()
    MetricsChannel.for_logger(logger).close(timeout=60)
    run_dir = logger.experiment.dir
    logger.experiment.finish()
    print(f"offline W&B run in {run_dir}")
    return run_dir


if __name__ == "__main__":
    main(*sys.argv[1:2])
