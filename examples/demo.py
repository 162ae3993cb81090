"""rl_observers demo: a CartPole collector writing into a replay buffer, watched while it runs.

The collector logs reward and episode statistics, the replay buffer logs its
writes and what sampling returns (including the age of sampled data), to CSV
and TensorBoard under ``runs/``. Run it with ``make demo``.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger, TensorboardLogger

import rl_observers
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)


class Progress:
    """A plain observer: prints one line per batch, next to the data."""

    def __init__(self, total_frames: int) -> None:
        self.total_frames = total_frames
        self.frames = 0
        self.start = time.monotonic()

    def on_post_collect(self, source, batch) -> None:
        self.frames += batch.numel()
        rate = self.frames / max(time.monotonic() - self.start, 1e-9)
        sys.stdout.write(f"\r  collected {self.frames:>6}/{self.total_frames} frames  ({rate:,.0f} frames/s)")
        sys.stdout.flush()


def main(out_dir: str = "runs", total_frames: int = 20_000, frames_per_batch: int = 1_000) -> dict:
    out = pathlib.Path(out_dir)
    csv_logger = CSVLogger(exp_name="demo", log_dir=str(out / "csv"))
    tb_logger = TensorboardLogger(exp_name="demo", log_dir=str(out / "tensorboard"))
    channels = [MetricsChannel.for_logger(csv_logger), MetricsChannel.for_logger(tb_logger)]

    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter(max_steps=200))
    env.append_transform(RewardSum())
    env.set_seed(0)
    torch.manual_seed(0)
    collector = Collector(
        env, RandomPolicy(env.action_spec), frames_per_batch=frames_per_batch, total_frames=total_frames
    )
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=256)

    for channel in channels:
        collector.add_observer(
            LoggerObserver(
                channel,
                schedule=Every.counter("frames", 5 * frames_per_batch),
                metrics=CollectorBatchMetrics(),
            )
        )
        buffer.add_observer(
            LoggerObserver(
                channel,
                schedule=Every.counter("sample_calls", 20),
                metrics=[WriteMetrics(reward_key=("next", "reward")), SampleMetrics()],
            )
        )
    collector.add_observer(Progress(total_frames))

    print(f"rl_observers {rl_observers.__version__}: CartPole collector -> replay buffer")
    for batch in collector:
        buffer.extend(batch)
        for _ in range(4):
            buffer.sample()
    collector.shutdown()
    buffer.shutdown()
    for channel in channels:
        channel.close(timeout=30)
    print()

    summary: dict[str, tuple[int, float]] = {}
    for path in sorted((out / "csv").rglob("scalars/**/*.csv")):
        scalars = next(p for p in path.parents if p.name == "scalars")
        with path.open() as f:
            rows = list(csv.reader(f))
        if rows:
            summary[str(path.relative_to(scalars).with_suffix(""))] = (len(rows), float(rows[-1][-1]))
    print(f"\n{'metric':<40} {'rows':>5} {'last value':>12}")
    for name in sorted(summary):
        if name.startswith(("collector", "tensordictreplaybuffer")):
            rows, last = summary[name]
            print(f"{name:<40} {rows:>5} {last:>12.3f}")
    print(f"\nCSV files:        {out / 'csv'}")
    print(f"TensorBoard runs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--frames", type=int, default=20_000)
    args = parser.parse_args()
    main(args.out_dir, total_frames=args.frames)
