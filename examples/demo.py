"""rl_observers demo: a DQN learns CartPole while its collector and replay buffer are watched.

The agent (``examples/dqn_cartpole.py``) collects 128 frames, writes them into
a replay buffer and trains on 8 sampled batches, again and again. Observers
next to the data log reward and episode statistics of the collector, the
buffer's writes and the age of the data it samples, to CSV and TensorBoard
under ``runs/``, with the 5th, 50th and 95th percentiles of the episode
return, the episode length and the sample age (each within 1 % of the true
quantile of the window). The console shows one live line
(:class:`rl_observers.LiveConsole`: frames, frames per second, the episode
return, samples per second) as training goes; the run ends with a table of every series and a plot read back from
the run's own CSV files (a run replaces the previous one's): the median
episode return and sample age of each window, inside the band of their
5th to 95th percentiles, and the episodes completed per window (whole
windows: the last one, cut short by the run's end, is left out). Run
it with ``make demo`` (about a minute on 2 CPU cores), or
``python examples/demo.py --frames 10000`` for less.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import pathlib
import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from dqn_cartpole import close, make_dqn, observe, train

import rl_observers

if TYPE_CHECKING:
    from matplotlib.figure import Figure

QUANTILES = (0.05, 0.5, 0.95)
#: (series, y label, x label): a series logged with quantiles is drawn as its median inside
#: its p5-p95 band. (CartPole's episode length is its return, and its reward is 1 at every
#: step: the third panel counts the episodes completed per window, fewer as they get longer.
#: A count depends on its window's length: windows shorter than the others are left out.)
PLOTTED = (
    ("collector/episode_return", "episode return", "frames"),
    ("replay_buffer/sample_age", "age of sampled data (items)", "sample calls"),
    ("collector/episodes", "episodes completed per window", "frames (whole windows: a shorter last one is left out)"),
)
COUNTS = ("collector/episodes",)


@contextlib.contextmanager
def quiet_torchrl() -> Iterator[None]:
    """torchrl's INFO lines (storage initialised, ...) tell the demo's viewer nothing, and in a
    log file they come with colour codes among the console's plain lines: WARNING and up."""
    torchrl_logger = logging.getLogger("torchrl")
    level = torchrl_logger.level
    torchrl_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        torchrl_logger.setLevel(level)


def read_scalars(csv_dir: pathlib.Path) -> dict[str, list[tuple[float, float]]]:
    """Every series a ``CSVLogger`` wrote under ``csv_dir``: name -> [(step, value), ...]."""
    scalars: dict[str, list[tuple[float, float]]] = {}
    for path in sorted(csv_dir.rglob("scalars/**/*.csv")):
        root = next(p for p in path.parents if p.name == "scalars")
        with path.open() as f:
            rows = [(float(step), float(value)) for step, value in csv.reader(f)]
        if rows:
            scalars[str(path.relative_to(root).with_suffix(""))] = rows
    return scalars


def whole_windows(rows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The rows of windows as long (in steps) as the longest: a run's last window, cut short, is left out.

    Examples:
        >>> whole_windows([(1280.0, 5.0), (2560.0, 4.0), (2688.0, 0.0)])
        [(1280.0, 5.0), (2560.0, 4.0)]
    """
    lengths = [step - before for (step, _), before in zip(rows, [0.0] + [step for step, _ in rows])]
    return [row for row, length in zip(rows, lengths) if length >= max(lengths)]


def plot(scalars: dict[str, list[tuple[float, float]]], out: pathlib.Path) -> Figure:
    """Episode return, sample age and episodes per window, as logged, into one PNG at ``out``.

    A series with quantiles is drawn as its median per window (``_p50``)
    inside the band of its 5th to 95th percentiles (``_p5``, ``_p95``); a
    count per window over whole windows only (:func:`whole_windows`).
    Returns the figure (closed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PLOTTED), 1, figsize=(7, 7), sharex=False)
    for ax, (name, label, x_label) in zip(axes, PLOTTED):
        banded = f"{name}_p50" in scalars
        rows = scalars.get(f"{name}_p50" if banded else name, [])
        rows = whole_windows(rows) if name in COUNTS and rows else rows
        ax.plot([s for s, _ in rows], [v for _, v in rows], marker=".", label="median" if banded else None)
        low, high = scalars.get(f"{name}_p5", []), scalars.get(f"{name}_p95", [])
        if banded and low and len(low) == len(high):
            ax.fill_between(
                [s for s, _ in low],
                [v for _, v in low],
                [v for _, v in high],
                alpha=0.2,
                label="p5-p95",
            )
            ax.legend(fontsize=7, loc="upper left")
        ax.set_title(f"{name}_p5 / _p50 / _p95" if banded else name, fontsize=10)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel(x_label, fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("DQN on CartPole-v1, logged by rl_observers")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def main(out_dir: str = "runs", total_frames: int = 50_000) -> dict[str, tuple[int, float]]:
    out = pathlib.Path(out_dir)
    for previous in ("csv", "tensorboard"):  # the last run's files go: the table and plot show one run
        shutil.rmtree(out / previous / "dqn", ignore_errors=True)
    torch.set_num_threads(1)  # a 64-unit MLP: threads cost more than they give
    print(f"rl_observers {rl_observers.__version__}: DQN on CartPole-v1, {total_frames:,} frames")
    with quiet_torchrl():
        dqn = make_dqn()
        observed = observe(dqn, out, quantiles=QUANTILES)
        # One line, redrawn once a second from the channel's thread (plain lines in a log file).
        rl_observers.LiveConsole(observed.channel, total_frames=total_frames)
        start = time.monotonic()
        train(dqn, -(-total_frames // dqn.config.frames_per_batch))
        close(dqn)
        observed.close(timeout=30)
    seconds = time.monotonic() - start

    scalars = read_scalars(out / "csv" / "dqn")
    summary = {name: (len(rows), rows[-1][1]) for name, rows in scalars.items()}
    print(f"\n{'metric':<40} {'rows':>5} {'last value':>12}")
    for name in sorted(summary):
        if name.startswith(("collector", "replay_buffer")):
            rows, last = summary[name]
            print(f"{name:<40} {rows:>5} {last:>12.3f}")
    png = out / "dqn_cartpole.png"
    plot(scalars, png)
    print(f"\n{dqn.frames:,} frames, {dqn.updates:,} updates in {seconds:.0f} s")
    print(f"Plot:             {png}")
    print(f"CSV files:        {out / 'csv'}")
    print(f"TensorBoard runs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--frames", type=int, default=50_000)
    args = parser.parse_args()
    main(args.out_dir, total_frames=args.frames)
