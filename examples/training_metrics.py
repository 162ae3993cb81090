"""Losses, gradient norms and the learning rate next to the collector's metrics, without a sync.

A tiny Q-learning loop on CartPole: the collector's observer logs episode
returns on the ``frames`` axis, and :class:`~rl_observers.TrainingMetrics`
logs the training loop's values on the same axis, through the same channel.
The loss and the gradient norm stay tensors on their device (no ``.item()``);
the learning rate is a host number and stays on the host.

Run with ``python examples/training_metrics.py [out_dir]``.
"""

from __future__ import annotations

import sys

import torch
from torchrl.collectors import Collector
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import Every, MetricsChannel, TrainingMetrics


def main(out_dir: str = "runs/training", total_frames: int = 4_000) -> dict[str, list]:
    logger = CSVLogger(exp_name="training_metrics", log_dir=out_dir)
    env = GymEnv("CartPole-v1")
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=200, total_frames=total_frames)
    collector.attach_logger(logger, schedule=Every.counter("frames", 1_000))
    # One line: the window is 1,000 frames, the axis is the collector's frames.
    train = TrainingMetrics(logger, every=1_000, reduce={"grad_norm": "max", "lr": "latest", "td_error": "summary"})

    q = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(q.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.5)
    frames = 0
    for batch in collector:
        frames += batch.numel()
        obs, action = batch["observation"], batch["action"].argmax(-1, keepdim=True)
        value = q(obs).gather(-1, action).squeeze(-1)
        with torch.no_grad():
            target = batch["next", "reward"].squeeze(-1) + 0.99 * q(batch["next", "observation"]).amax(-1) * (
                ~batch["next", "done"].squeeze(-1)
            )
        td_error = value - target
        loss = td_error.pow(2).mean()
        optim.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(q.parameters(), 10.0)
        optim.step()
        train.record(frames, loss=loss, grad_norm=grad_norm, td_error=td_error, lr=schedule.get_last_lr()[0])
        schedule.step()
    collector.shutdown()
    train.close()
    MetricsChannel.for_logger(logger).close(timeout=60)
    rows = {name: values for name, values in logger.experiment.scalars.items() if name.startswith("train/")}
    for name, values in sorted(rows.items()):
        print(name, values[-1])
    return {**rows, "collector/episode_return_mean": logger.experiment.scalars["collector/episode_return_mean"]}


if __name__ == "__main__":
    main(*sys.argv[1:2])
