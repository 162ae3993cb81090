"""What shutting a source down, and exiting without doing so, does to its logging.

* A source that shut down frees its namespace: a collector rebuilt in a loop
  and attached to the same logger again is accepted, however late the old
  one is garbage-collected (here: kept alive on purpose). A replay buffer
  used again after ``shutdown()`` takes its namespace back, or reports why it
  cannot.
* A multiprocessing collector never shut down before the interpreter exits
  is shut down at exit, so its workers' last windows are logged (torchrl
  alone would wait for the workers forever).
* The refusal of ``on_error="raise"`` describes the observer as it was
  passed, not with placeholders of unresolved fields.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

from rl_observers import Every, MetricsChannel
from tests.helpers import read_csv, scalars, start_method


def _collector(total_frames: int = 300) -> Collector:
    env = CountingEnv(max_steps=7)
    return Collector(env, RandomPolicy(env.action_spec), frames_per_batch=100, total_frames=total_frames)


def _multi_sync(total_frames: int = 800) -> MultiSyncCollector:
    env = CountingEnv(max_steps=7)
    return MultiSyncCollector(
        [CountingEnv, CountingEnv], RandomPolicy(env.action_spec), frames_per_batch=200, total_frames=total_frames
    )


def test_a_shut_down_collector_frees_its_namespace(tmp_path):
    logger = CSVLogger(exp_name="rebuilt", log_dir=str(tmp_path))
    kept = []  # the old collectors stay alive: only their shutdown frees the namespace
    for _ in range(3):
        collector = _collector()
        collector.attach_logger(logger, schedule=Every.counter("frames", 100))
        for _ in collector:
            pass
        collector.shutdown()
        kept.append(collector)
    assert MetricsChannel.for_logger(logger).close(10)
    assert [step for step, _ in scalars(logger, "collector/frames")] == [100, 200, 300] * 3


def test_a_collector_still_running_keeps_its_namespace(tmp_path):
    logger = CSVLogger(exp_name="running", log_dir=str(tmp_path))
    first, second = _collector(), _collector()
    first.attach_logger(logger)
    next(iter(first))
    with pytest.raises(ValueError, match="namespace 'collector'.* is already used on this logger"):
        second.attach_logger(logger)
    first.shutdown()
    second.attach_logger(logger)
    second.shutdown()
    assert MetricsChannel.for_logger(logger).close(10)


def test_a_buffer_written_after_shutdown_takes_its_namespace_back(tmp_path):
    logger = CSVLogger(exp_name="reused", log_dir=str(tmp_path))
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    rb.attach_logger(logger, schedule=Every.counter("items_written", 10))
    rb.extend(torch.arange(10))
    rb.shutdown()
    rb.extend(torch.arange(10))  # a torchrl buffer still takes writes after shutdown(): rows go on
    other = ReplayBuffer(storage=LazyTensorStorage(100))
    with pytest.raises(ValueError, match="namespace 'replay_buffer'.* is already used on this logger"):
        other.attach_logger(logger)
    assert MetricsChannel.for_logger(logger).flush(10)
    assert [step for step, _ in scalars(logger, "replay_buffer/items_written")] == [10, 20]
    MetricsChannel.for_logger(logger).close(10)


def test_a_buffer_written_after_its_namespace_was_taken_reports_it(tmp_path, caplog):
    logger = CSVLogger(exp_name="taken", log_dir=str(tmp_path))
    first = ReplayBuffer(storage=LazyTensorStorage(100))
    first.attach_logger(logger, schedule=Every.counter("items_written", 10))
    first.extend(torch.arange(10))
    first.shutdown()
    second = ReplayBuffer(storage=LazyTensorStorage(100))
    second.attach_logger(logger, schedule=Every.counter("items_written", 10))
    second.extend(torch.arange(10))
    with caplog.at_level(logging.WARNING):
        first.extend(torch.arange(30))  # not mixed into the namespace the second buffer uses now
    assert "is used again after shutdown(), which freed the namespace 'replay_buffer'" in caplog.text
    assert MetricsChannel.for_logger(logger).flush(10)
    assert [step for step, _ in scalars(logger, "replay_buffer/items_written")] == [10, 10]
    MetricsChannel.for_logger(logger).close(10)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_shut_down_multiprocess_collector_frees_its_namespace(tmp_path):
    logger = CSVLogger(exp_name="rebuilt_mp", log_dir=str(tmp_path))
    with start_method("fork"):
        first = _multi_sync()
        first.attach_logger(logger, schedule=Every.counter("frames", 400))
        for _ in first:
            pass
        first.shutdown()  # first stays referenced: its shutdown alone frees the namespace
        second = _multi_sync()
        second.attach_logger(logger, schedule=Every.counter("frames", 400))
        for _ in second:
            pass
        # Removing the first's observer now must not finish the second's aggregate.
        first.remove_observer(first.observers[0])
        second.shutdown()
    assert MetricsChannel.for_logger(logger).close(10)
    assert [step for step, _ in scalars(logger, "collector/frames")] == [400, 800, 400, 800]


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_refusal_of_raise_describes_the_observer_as_passed(tmp_path):
    logger = CSVLogger(exp_name="refused", log_dir=str(tmp_path))
    with start_method("fork"):
        collector = _multi_sync()
        try:
            # schedule=None would mean "log every event": an unresolved default is not shown so
            with pytest.raises(ValueError, match=r"for LoggerObserver\(schedule='auto'\)\.$"):
                collector.attach_logger(logger, on_error="raise")
            with pytest.raises(ValueError, match=r"for LoggerObserver\(name='x', schedule=None\)\.$"):
                collector.attach_logger(logger, name="x", schedule=None, on_error="raise")
        finally:
            collector.shutdown()


_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys

    import rl_observers
    from rl_observers import Every
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs.utils import RandomPolicy
    from torchrl.record import CSVLogger
    from torchrl.testing.mocking_classes import CountingEnv

    if __name__ == "__main__":
        logger = CSVLogger(exp_name="exit", log_dir=sys.argv[1])
        env = CountingEnv(max_steps=7)
        collector = MultiSyncCollector(
            [CountingEnv, CountingEnv], RandomPolicy(env.action_spec), frames_per_batch=200, total_frames=1400
        )
        collector.attach_logger(logger, schedule=Every.counter("frames", 1000))
        for _ in collector:
            pass
        # no shutdown(), no close(): the workers' last windows are logged at exit all the same
    """
)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_multiprocess_collector_not_shut_down_logs_its_last_window_at_exit(tmp_path):
    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(_EXIT_SCRIPT)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 60  # the workers did not hold the exit
    assert "rl_observers" not in done.stderr  # nothing lost, so nothing to warn about
    rows = read_csv(tmp_path / "exit" / "scalars" / "collector" / "frames.csv")
    # the window up to the last frame (thresholds before it are observed, not exact)
    assert rows[-1] == (1400, 1400.0)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_shut_down_ray_collector_and_a_closed_ray_buffer_free_their_namespaces(tmp_path):
    import warnings

    from torchrl.collectors.distributed import RayCollector
    from torchrl.data import RayReplayBuffer

    from tests.helpers import local_ray

    logger = CSVLogger(exp_name="rebuilt_ray", log_dir=str(tmp_path))
    kept = []  # the old collectors and buffers stay alive: their shutdown alone frees the names
    env = CountingEnv(max_steps=7)
    with local_ray(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(2):
            rb = RayReplayBuffer(storage=lambda: LazyTensorStorage(1_000), remote_config={"num_cpus": 0})
            collector = RayCollector(
                [CountingEnv], RandomPolicy(env.action_spec), frames_per_batch=100, total_frames=200,
                sync=True, remote_configs={"num_cpus": 1},
            )
            collector.attach_logger(logger, schedule=Every.counter("frames", 10**9))
            rb.attach_logger(logger, schedule=Every.counter("items_written", 10**9))
            for batch in collector:
                rb.extend(batch.reshape(-1))
            collector.shutdown()
            rb.close()
            kept += [collector, rb]
        assert MetricsChannel.for_logger(logger).close(30)
    # each one's last window, logged when it shut down
    assert scalars(logger, "collector/frames") == [(200, 200.0), (200, 200.0)]
    assert scalars(logger, "replay_buffer/items_written") == [(200, 200.0), (200, 200.0)]


def test_a_worker_that_did_not_stop_at_exit_is_reported(monkeypatch, caplog):
    """The exit hook's report when torchrl had to terminate a worker (its last window is lost)."""
    import os
    from types import SimpleNamespace

    from rl_observers.remote import multiprocess

    class StuckCollector:
        pipes = (None, None)
        closed = False

        def __init__(self):
            self.procs = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]

        def shutdown(self, timeout=None, raise_on_error=True):
            self.closed = True
            self.procs[0].exitcode, self.procs[1].exitcode = 0, -15  # worker 1 was terminated

    collector = StuckCollector()
    observed = multiprocess.IdentityMap()
    observed.set(collector, True)
    monkeypatch.setattr(multiprocess, "_OBSERVED", observed)
    monkeypatch.setattr(multiprocess, "_EXIT_PID", os.getpid())
    with caplog.at_level(logging.WARNING):
        multiprocess._shut_down_observed_at_exit()
    assert collector.closed
    assert "StuckCollector was still running at interpreter exit" in caplog.text
    assert "worker 1 (exit code -15)" in caplog.text and "worker 0" not in caplog.text
    assert "Call collector.shutdown() before the program ends." in caplog.text
