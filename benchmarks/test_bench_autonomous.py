"""Budget: an observed ``.start()`` run reaches its first write within 1.2x of the unobserved one.

Time to first write: from building the collector (and, observed, its
``LoggerObserver`` and the replay buffer's) through attaching and
``start()`` until the replay buffer's ``write_count`` moves, the wait a
training script has before it can sample. Observed and unobserved runs
alternate, the median of each is compared in the same run, and a budget
missed once is measured once more (load from other processes fails one
measurement, a regression fails both).

``fork`` runs take about half a second each and are measured three times
with two workers. A ``spawn`` worker imports torch and torchrl before it
answers (seconds, tens of seconds on a loaded machine), so the ``spawn``
case runs one worker of the collector the issue was about
(``MultiAsyncCollector``), measured once each way.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from contextlib import contextmanager

import pytest
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers.csv import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

from rl_observers import LoggerObserver

BUDGET = 1.2
# make test (one core may be busy) asserts a ceiling instead: the MultiSyncCollector case measured
# 1.46 on correct code at load ~4 (half-second runs, three of each); a start-up that waits on
# a timeout or a worker's import costs seconds, i.e. several times this.
TEST_CEILING = 2.0
# 1000-frame batches, as in the throughput budgets: an in-process first batch then takes ~0.15 s, of
# which a LoggerObserver's fixed start-up (its channel's delivery and socket threads, ~10 ms) is noise.
FRAMES_PER_BATCH = 1000
KINDS = {"Collector": Collector, "MultiSyncCollector": MultiSyncCollector, "MultiAsyncCollector": MultiAsyncCollector}


@contextmanager
def _start_method(method):
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


def _time_to_first_write(kind, observed, log_dir, workers):
    policy = RandomPolicy(CountingEnv().action_spec)
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), shared=kind is not Collector)
    started = time.perf_counter()
    if kind is Collector:
        collector = Collector(CountingEnv, policy, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1, replay_buffer=rb)
    else:
        collector = kind(
            [CountingEnv] * workers, policy, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1, replay_buffer=rb
        )
    try:
        if observed:
            logger = CSVLogger("ttfw", log_dir=str(log_dir))
            rb.add_observer(LoggerObserver(logger, schedule=None))
            collector.add_observer(LoggerObserver(logger, schedule=None))
        collector.start()
        deadline = started + 120
        while rb.write_count == 0:
            assert time.perf_counter() < deadline, "no write within 120 s"
            time.sleep(0.0005)
        return time.perf_counter() - started
    finally:
        collector.async_shutdown(timeout=10)


def _ratio(kind, rounds, workers, tmp_path):
    times = {False: [], True: []}
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        for observed in order:
            times[observed].append(_time_to_first_write(kind, observed, tmp_path / f"run{i}", workers))
    bare, observed = statistics.median(times[False]), statistics.median(times[True])
    return observed / bare, bare, observed


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "method"),
    [
        ("Collector", "fork"),
        ("MultiSyncCollector", "fork"),
        ("MultiAsyncCollector", "fork"),
        pytest.param("MultiAsyncCollector", "spawn", marks=pytest.mark.bench_only),
    ],
)
def test_time_to_first_write_ratio(benchmark, tmp_path, kind, method):
    rounds, workers = (3, 2) if method == "fork" else (1, 1)
    limit = TEST_CEILING if benchmark.disabled else BUDGET
    with _start_method(method):
        ratio, bare, observed = _ratio(KINDS[kind], rounds, workers, tmp_path)
        if ratio > limit:
            again = _ratio(KINDS[kind], rounds, workers, tmp_path / "again")
            ratio, bare, observed = min((ratio, bare, observed), again)
    benchmark.extra_info.update(ratio=ratio, bare_s=bare, observed_s=observed)
    print(f"\n{kind} ({method}): bare {bare:.3f} s, observed {observed:.3f} s, ratio {ratio:.2f}x")
    assert ratio <= limit, f"{kind} ({method}): observed first write after {observed:.3f} s, bare {bare:.3f} s"
    benchmark.pedantic(lambda: None, rounds=1)
