"""The least a Python observer can cost on the tightest budgets, step by step.

The replay-buffer budgets hold the library within 0.04 of the least a Python
observer does for the same statistic. This script measures what each step an
exact age needs costs when written as directly as Python allows: one
hand-written observer class per
step, each attached alone to its own buffer (no ``LoggerObserver``, no
metric set, no lock, no error policy). Each method is written out in full:
a shared helper would add the Python call whose cost is measured. The
library's own ``LoggerObserver`` + ``SampleMetrics`` run beside them. The
same for ``extend(256)`` (counts, the written range, exact rewards folded
from the storage, next to ``WriteMetrics``) and for the no-reset
``CountingEnv([100])`` collector (1,000-frame batches): a hand-written
observer that copies what exact reward and episode statistics need (the
reward and the done flags) into a preallocated ring, next to
``CollectorBatchMetrics``. Same method as
``test_bench_logger_observer.py::test_replay_buffer_ratio``: alternating
blocks, CPU time of the process, the ratio to the bare buffer or collector
per round, median over rounds.

Run it with::

    .venv/bin/python -m benchmarks.python_floor [rounds]

``benchmarks/README.md`` (its method, "The Python floor") says how the budgets use it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers.csv import CSVLogger

from benchmarks.test_bench_logger_observer import (
    FRAMES_PER_BATCH,
    MICRO_SCHEDULE,
    _rows,
    counting_env_no_resets,
    paired_compare,
)
from rl_observers import LoggerObserver, MetricsChannel
from rl_observers.metrics import CollectorBatchMetrics, SampleMetrics, WriteMetrics

_monotonic = time.monotonic
_BLOCK = 2**15


class DoNothing:
    """The dispatch alone."""

    def __init__(self, rb: Any) -> None:
        self.calls = self.items = 0
        self.last = _monotonic()
        self.cell = rb._writer._cursor_value.get_obj()
        self.host = np.empty(_BLOCK, dtype=np.int64)
        self.staged = 0

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        pass


class Counts(DoNothing):
    """``sample_calls``, ``samples_returned`` and a seconds schedule's clock read."""

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        n = info["index"].shape[0]
        self.calls += 1
        self.items += n
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class CountsAndCursor(DoNothing):
    """... and the writer's cursor read from its shared cell (what an age needs besides the slots)."""

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        n = info["index"].shape[0]
        self.calls += 1
        self.items += n
        self.cursor = self.cell.value
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class IndexView(DoNothing):
    """... and a numpy view of the sampled index (no copy)."""

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        index = info["index"]
        n = index.shape[0]
        self.calls += 1
        self.items += n
        self.cursor = self.cell.value
        self.view = index.numpy()
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class IndexCopied(DoNothing):
    """... and the index copied into one host block: the least an exact age needs per sample."""

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        index = info["index"]
        n = index.shape[0]
        self.calls += 1
        self.items += n
        self.cursor = self.cell.value
        end = self.staged + n
        if end > _BLOCK:  # the ages of a full block would be folded here
            self.staged, end = 0, n
        self.host[self.staged : end] = index.numpy()
        self.staged = end
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class IndexKept(DoNothing):
    """... or a reference to the index tensor kept instead (128 per block)."""

    def __init__(self, rb: Any) -> None:
        super().__init__(rb)
        self.kept: list[Any] = []

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        index = info["index"]
        n = index.shape[0]
        self.calls += 1
        self.items += n
        self.cursor = self.cell.value
        self.kept.append(index)
        if len(self.kept) >= 128:
            self.kept = []
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


HAND_WRITTEN = (DoNothing, Counts, CountsAndCursor, IndexView, IndexCopied, IndexKept)


class WriteCounts:
    """A write: ``writes`` and ``items_written`` counted, a seconds schedule's clock read."""

    def __init__(self, rb: Any) -> None:
        self.writes = self.items = 0
        self.last = _monotonic()
        self.cell = rb._writer._cursor_value.get_obj()
        self.pending = 0

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        self.writes += 1
        self.items += index.shape[0]
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class WritePending(WriteCounts):
    """... and the written range noted from the cursor (rewards read back from the storage later)."""

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        n = index.shape[0]
        self.writes += 1
        self.items += n
        self.cursor = self.cell.value
        self.pending += n
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class WriteRewards(WritePending):
    """... and the pending rows' rewards folded from the storage every 25,600 rows (exact
    float64 sum, sum of squared deviations, min, max: what ``Moments`` keeps)."""

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        super().on_post_extend(source, data, index)
        if self.pending >= 25_600:
            end = self.cursor
            reward = source._storage._storage.get(("next", "reward"))
            values = reward[max(0, end - self.pending) : end].to(torch.float64)
            self.folded = (
                values.sum(),
                torch.var(values, correction=0),
                torch.aminmax(values.view(-1)),
            )
            self.pending = 0


class BatchCounts:
    """A collector batch: ``batches`` and ``frames`` counted, a seconds schedule's clock read."""

    def __init__(self) -> None:
        self.batches = self.frames = 0
        self.last = _monotonic()

    def on_post_collect(self, source: Any, batch: Any) -> None:
        self.batches += 1
        self.frames += batch.numel()
        if _monotonic() - self.last >= 1.0:
            self.last = _monotonic()


class BatchStaged(BatchCounts):
    """... and the reward and done flags copied into a ring of 16 batches (summed when full)."""

    def __init__(self) -> None:
        super().__init__()
        self.rewards: torch.Tensor | None = None
        self.used = 0

    def on_post_collect(self, source: Any, batch: Any) -> None:
        nxt = batch.get("next")
        reward, done = nxt.get("reward"), nxt.get("done")
        if self.rewards is None:
            self.rewards = reward.new_empty((16, *reward.shape))
            self.dones = done.new_empty((16, *done.shape))
        self.rewards[self.used].copy_(reward)
        self.dones[self.used].copy_(done)
        self.used += 1
        if self.used == 16:  # what a window's sums would start from
            self.used = 0
            self.sums = (self.rewards.sum(), self.dones.sum())
        super().on_post_collect(source, batch)


def _collector_ops(log_dir: str, stack: ExitStack) -> tuple[dict[str, Any], dict[str, Any]]:
    ops, flushes = {}, {}
    kinds: dict[str, Any] = {"bare": None, "BatchCounts": BatchCounts, "BatchStaged": BatchStaged}
    kinds["CollectorBatchMetrics()"] = CollectorBatchMetrics
    for name, kind in kinds.items():
        env = counting_env_no_resets()
        collector = Collector(
            env, RandomPolicy(env.action_spec), frames_per_batch=FRAMES_PER_BATCH, total_frames=-1
        )
        stack.callback(collector.shutdown)
        if kind is CollectorBatchMetrics:
            logger = CSVLogger(name, log_dir=log_dir)
            collector.add_observer(
                LoggerObserver(logger, schedule=MICRO_SCHEDULE, metrics=CollectorBatchMetrics())
            )
            channel = MetricsChannel.for_logger(logger)
            flushes[name] = channel.flush
            stack.callback(channel.close, 30)  # before the collector's shutdown
        elif kind is not None:
            collector.add_observer(kind())
        ops[name] = iter(collector).__next__
    return ops, flushes


def _print(ops: dict[str, Any], timings: dict[str, float], ratios: dict[str, float]) -> None:
    for name in ops:
        extra = (timings[name] - timings["bare"]) * 1e6
        print(f"{name:26s} {timings[name] * 1e6:8.1f} us  {extra:+6.1f} us  x{ratios[name]:.3f}")


def collector_floor(rounds: int = 21) -> dict[str, float]:
    """The no-reset ``CountingEnv([100])`` collector, 20 batches per block."""
    with ExitStack() as stack:
        ops, flushes = _collector_ops(tempfile.mkdtemp(prefix="python-floor-"), stack)
        timings, ratios = paired_compare(
            ops, calls=20, blocks=rounds, clock=time.process_time, block_end=flushes
        )
    _print(ops, timings, ratios)
    return ratios


def extend_floor(rounds: int = 21) -> dict[str, float]:
    """``extend(256)`` into a 100,000-slot buffer, 200 calls per block."""
    data = _rows(256)
    kinds: dict[str, Any] = {"bare": None, "WriteCounts": WriteCounts, "WritePending": WritePending}
    kinds["WriteRewards"] = WriteRewards
    kinds["WriteMetrics()"] = []
    kinds["WriteMetrics(reward_key=...)"] = [("next", "reward")]
    with ExitStack() as stack:
        ops, flushes = {}, {}
        log_dir = tempfile.mkdtemp(prefix="python-floor-")
        for name, kind in kinds.items():
            rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000))
            for _ in range(40):
                rb.extend(data)
            if isinstance(kind, list):
                logger = CSVLogger(name, log_dir=log_dir)
                metrics = [WriteMetrics(reward_key=kind[0] if kind else None)]
                rb.add_observer(LoggerObserver(logger, schedule=MICRO_SCHEDULE, metrics=metrics))
                channel = MetricsChannel.for_logger(logger)
                flushes[name] = channel.flush
                stack.callback(channel.close, 30)
            elif kind is not None:
                rb.add_observer(kind(rb))
            ops[name] = lambda rb=rb: rb.extend(data)
        timings, ratios = paired_compare(
            ops, calls=200, blocks=rounds, clock=time.process_time, block_end=flushes
        )
    _print(ops, timings, ratios)
    return ratios


def sample_floor(rounds: int = 21) -> dict[str, float]:
    """``sample(256)`` from a 100,000-slot buffer holding 10,240 rows, 200 calls per block."""
    data = _rows(256)
    ops, flushes, channels = {}, {}, []
    log_dir = tempfile.mkdtemp(prefix="python-floor-")
    kinds: dict[str, Any] = {"bare": None, **{cls.__name__: cls for cls in HAND_WRITTEN}}
    kinds["SampleMetrics(age=False)"] = False
    kinds["SampleMetrics()"] = True
    for name, kind in kinds.items():
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000))
        for _ in range(40):
            rb.extend(data)
        if isinstance(kind, bool):
            logger = CSVLogger(name, log_dir=log_dir)
            metrics = [SampleMetrics(age=kind)]
            rb.add_observer(LoggerObserver(logger, schedule=MICRO_SCHEDULE, metrics=metrics))
            channel = MetricsChannel.for_logger(logger)
            flushes[name] = channel.flush
            channels.append(channel)
        elif kind is not None:
            rb.add_observer(kind(rb))
        ops[name] = lambda rb=rb: rb.sample(256)
    try:
        timings, ratios = paired_compare(
            ops, calls=200, blocks=rounds, clock=time.process_time, block_end=flushes
        )
    finally:
        for channel in channels:
            channel.close(30)
    _print(ops, timings, ratios)
    return ratios


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    print("sample(256):")
    sample_floor(rounds)
    print("extend(256):")
    extend_floor(rounds)
    print("no-reset CountingEnv([100]) collector:")
    collector_floor(rounds)
