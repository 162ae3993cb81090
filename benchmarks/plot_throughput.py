"""Plots training and collector throughput per observer configuration into ``benchmarks/throughput.png``.

First, the yardstick: the demo's DQN training step on CartPole (collect 128
frames, extend, 8 updates), bare and fully observed (``_training.measure``,
paired blocks in one run). Then five configurations of the same CartPole collector (1000-frame batches), measured
in one run, in alternating blocks: bare; one no-op observer; a ``LoggerObserver``
with ``CollectorBatchMetrics``; the same with a logger that takes 200 ms per call;
and the hook users write today (``.item()`` + ``log_metrics`` in
``post_collect_hook``) with that slow logger.

Run with ``.venv/bin/python benchmarks/plot_throughput.py [--batches N] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402
from torchrl.envs.utils import RandomPolicy  # noqa: E402
from torchrl.record import CSVLogger  # noqa: E402

import rl_observers  # noqa: E402,F401
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks._training import measure as measure_training  # noqa: E402
from benchmarks._training import observed_dqn  # noqa: E402

FRAMES_PER_BATCH = 1000


class SlowCSVLogger(CSVLogger):
    """A logger whose every call takes 200 ms, like a remote backend on a bad day."""

    def log_metrics(self, metrics, step=None, **kwargs):
        time.sleep(0.2)
        return super().log_metrics(metrics, step=step, **kwargs)


class NoOp:
    def on_post_collect(self, source, batch):
        pass


def naive_hook(logger):
    def hook(batch):
        reward = batch["next", "reward"]
        done = batch["next", "done"]
        logger.log_metrics(
            {"reward_mean": reward.mean().item(), "dones": done.sum().item()}, step=None
        )

    return hook


def collectors(tmp: str) -> tuple[dict[str, Collector], tuple[CSVLogger, ...]]:
    def make():
        env = GymEnv("CartPole-v1")
        return Collector(env, RandomPolicy(env.action_spec), frames_per_batch=FRAMES_PER_BATCH, total_frames=-1)

    fast = CSVLogger(exp_name="fast", log_dir=tmp)
    slow = SlowCSVLogger(exp_name="slow", log_dir=tmp)
    made = {name: make() for name in ("bare", "no-op observer", "LoggerObserver", "LoggerObserver\n+ 200 ms logger", "sync hook\n+ 200 ms logger")}
    made["no-op observer"].add_observer(NoOp())
    made["LoggerObserver"].add_observer(
        LoggerObserver(fast, schedule=Every.counter("frames", 10_000), metrics=CollectorBatchMetrics())
    )
    made["LoggerObserver\n+ 200 ms logger"].add_observer(
        LoggerObserver(slow, schedule=Every.counter("frames", 10_000), metrics=CollectorBatchMetrics())
    )
    made["sync hook\n+ 200 ms logger"].post_collect_hook = naive_hook(slow)
    return made, (fast, slow)


def measure(batches: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        made, loggers = collectors(tmp)
        iterators = {name: iter(c) for name, c in made.items()}
        seconds: dict[str, list[float]] = {name: [] for name in made}
        for it in iterators.values():
            next(it)  # warm-up
        for _ in range(batches):  # alternate: noise spreads over every configuration
            for name, it in iterators.items():
                start = time.perf_counter()
                next(it)
                seconds[name].append(time.perf_counter() - start)
        for collector in made.values():
            collector.shutdown()
        for logger in loggers:
            MetricsChannel.for_logger(logger).close(timeout=30)
    return {name: FRAMES_PER_BATCH / statistics.median(values) for name, values in seconds.items()}


def measure_dqn() -> dict[str, float]:
    """Training iterations per second of the demo's DQN, bare and fully observed (CPU time)."""
    with tempfile.TemporaryDirectory() as tmp, observed_dqn(tmp) as (dqn, observed):
        result = measure_training(dqn, observed)
    bare = 1e3 / result["bare_cpu_ms_per_iteration"]
    return {"bare": bare, "fully observed": bare * result["ratio_cpu"]}


def plot(training: dict[str, float], rates: dict[str, float], out: pathlib.Path) -> None:
    fig, (ax_dqn, ax) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 3]})
    bars = ax_dqn.bar(list(training), list(training.values()), color=["#888", "#38c"])
    for bar, name in zip(bars, training):
        ax_dqn.annotate(f"{training[name] / training['bare']:.3f}×",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax_dqn.set_ylabel("training iterations / CPU second")
    ax_dqn.set_title("DQN training step on CartPole\n(128 frames + 8 updates)", fontsize=10)
    bare = rates["bare"]
    names = list(rates)
    bars = ax.bar(names, [rates[n] for n in names], color=["#888", "#6a9", "#38c", "#38c", "#c53"])
    for bar, name in zip(bars, names):
        ax.annotate(f"{rates[name] / bare:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_ylabel("frames / second")
    ax.set_title("CartPole collector, 1000-frame batches: median frames/s (ratio to bare)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name("throughput.png")))
    args = parser.parse_args()
    training = measure_dqn()
    print(f"{'DQN training step, fully observed':<32} {training['fully observed'] / training['bare']:.3f}x of bare")
    rates = measure(args.batches)
    for name, rate in rates.items():
        print(f"{name.replace(chr(10), ' '):<32} {rate:8,.0f} frames/s  ({rate / rates['bare']:.2f}x)")
    plot(training, rates, pathlib.Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
