"""A live console line while two CartPole workers collect into a replay buffer.

Run with ``python examples/live_console.py`` in a terminal (a tqdm bar
rewritten in place), or ``python examples/live_console.py > run.log`` (plain
lines, no control characters).
"""

from __future__ import annotations

import sys

from torchrl.collectors import MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import CollectorBatchMetrics, Every, LiveConsole, LoggerObserver, MetricsChannel


def make_env():
    return GymEnv("CartPole-v1")


def main(out_dir: str = "runs/console", total_frames: int = 20_000, file=None) -> LiveConsole:
    channel = MetricsChannel(CSVLogger(exp_name="console", log_dir=out_dir))
    collector = MultiSyncCollector(
        [make_env, make_env], RandomPolicy(make_env().action_spec), frames_per_batch=500, total_frames=total_frames
    )
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 1_000),
            metrics=CollectorBatchMetrics(episode_window=100),  # a rolling return over 100 episodes
        )
    )
    buffer = ReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=256)
    buffer.attach_logger(channel, schedule=Every.counter("sample_calls", 50))
    console = LiveConsole(channel, total_frames=total_frames, file=file)  # opt-in: one line
    for batch in collector:
        buffer.extend(batch.reshape(-1))
        for _ in range(20):
            buffer.sample()
    collector.shutdown()
    channel.close(timeout=60)  # draws the last line
    return console


if __name__ == "__main__":
    main(*sys.argv[1:2])
