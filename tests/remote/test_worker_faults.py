"""Worker faults: a multiprocessing collector worker SIGKILLed, a Ray collector actor killed.

Observer copies run in the workers and send their windows to the driver's
channel. When a worker dies:

* an iterated ``MultiSyncCollector`` / ``MultiAsyncCollector`` notices it
  within torchrl's health-check interval, *terminates the other workers*
  (``SIGTERM``, torchrl's policy) and raises: the driver is not stuck, what
  the workers submitted before is logged, and the survivors' last partial
  windows are lost with them;
* a collector running free after ``start()`` keeps collecting with the
  survivors, whose metrics keep flowing into the aggregate, and a later
  ``shutdown()`` lets the survivors' observers close their windows;
* observers can still be removed from a collector with a dead worker (from
  the survivors; the dead worker is reported once), and attaching to it is
  refused with an error naming the worker;
* a ``RayCollector`` whose actor is killed raises ``ActorDiedError`` from its
  iterator, its shutdown is bounded, and the surviving actors still emit
  ``shutdown``.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer

import tests.remote._remote_observers as remote_observers
from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from tests.helpers import RecordingLogger, make_multi, wait_for

pytestmark = pytest.mark.slow
RAY_BY_VALUE = (remote_observers,)  # the recording observers travel to Ray's actors by value (tests/conftest.py)


def lines_of(log: Path, tag: str, event: str) -> Counter[int]:
    """Events of ``tag`` recorded in ``log``, counted per worker."""
    return Counter(
        line.worker for line in remote_observers.read_lines(log) if line.tag == tag and line.event == event
    )


def frames_logged(logger: RecordingLogger) -> list[float]:
    return [value for _, value in logger.series("workers/frames")]


@pytest.mark.real_collector
@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=["sync", "async"])
def test_a_worker_killed_while_the_collector_is_iterated(tmp_path, cls):
    log = tmp_path / "events.txt"
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    collector = make_multi(cls, "fork", frames_per_batch=20, total_frames=20_000)
    received = 0
    try:
        collector.add_observer(remote_observers.CollectorLog(log, "rec"))
        collector.add_observer(LoggerObserver(channel, metrics=CollectorBatchMetrics(), name="workers", schedule=None))
        killed = None
        # torchrl says which worker died; on a busy machine it can instead fail to close the
        # survivor it terminated (it waits 0.1 s for it), which says so.
        noticed = r"worker 0 \(exit code -9\)|Cannot close a process while it is still running"
        with pytest.raises((RuntimeError, ValueError), match=noticed):
            for i, batch in enumerate(collector):
                received += batch.numel()
                # Kill once both workers collected (a busy machine can starve one of them for
                # a while: an async collector yields whichever is ready).
                both = i >= 3 and set(lines_of(log, "rec", "post_collect")) == {0, 1}
                if killed is None and (both or i == 500):
                    os.kill(collector.procs[0].pid, signal.SIGKILL)
                    killed = time.monotonic()
        assert time.monotonic() - killed < 30  # noticed, not hung
    finally:
        start = time.monotonic()
        collector.shutdown()
        assert time.monotonic() - start < 30
    assert set(lines_of(log, "rec", "post_collect")) == {0, 1}  # both collected before the kill
    # torchrl terminated the survivor too: both copies vanished without their final report,
    # which the account counts (and this flush reports); what they sent is logged
    assert not channel.flush(timeout=30)  # settles the account of the copies that are gone
    assert channel.health()["copies_lost"] >= 1
    assert frames_logged(logger) and max(frames_logged(logger)) > 0  # what was sent is logged
    channel.submit_metrics({"after": 1.0})  # the channel is unaffected
    assert channel.flush(timeout=10) and logger.series("after") == [(None, 1.0)]
    assert channel.close(timeout=10)


@pytest.mark.real_collector
@pytest.mark.timeout(90)
def test_a_worker_killed_before_its_first_window_is_counted(told):
    # The copy in worker 0 dies before it sent anything: the owner was told at attach which
    # workers have copies, so it is not invisible; worker 1's copy reports to its end.
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=20_000)
    try:
        collector.add_observer(LoggerObserver(channel, metrics=CollectorBatchMetrics(), name="workers"))
        os.kill(collector.procs[0].pid, signal.SIGKILL)
        assert wait_for(lambda: not collector.procs[0].is_alive(), timeout=10)
    finally:
        collector.shutdown()
    assert not channel.flush(timeout=30)  # the loss is what this flush settles and reports
    assert channel.health()["copies_lost"] == 1
    vanished = [m for m in told if "vanished without their final report" in m]
    assert len(vanished) == 1 and "LoggerObserver 'workers' on a MultiSyncCollector" in vanished[0]
    assert "worker 0: never heard from" in vanished[0] and "worker 1" not in vanished[0]
    assert channel.flush(timeout=10)
    assert channel.close(timeout=10)


def kill_outside_buffer_writes(rb: ReplayBuffer, proc: Any) -> None:
    """SIGKILLs the worker ``proc`` while this process holds ``rb``'s process-shared write lock.

    A worker killed inside ``rb.extend`` would die holding torchrl's write
    lock (and the locks of the writer's shared cursor), and every other
    writer would wait for it forever: that is torchrl's behaviour, with or
    without observers. Holding the lock while killing makes sure the worker
    dies anywhere else in its loop (collecting, observing, reporting).
    """
    with rb._write_lock:
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_for(lambda: not proc.is_alive(), timeout=10)


@pytest.mark.real_collector
@pytest.mark.timeout(120)
def test_a_worker_killed_while_the_collector_runs_free(tmp_path, monkeypatch, told):
    import rl_observers.remote.aggregate as aggregate

    if hasattr(aggregate, "STALE_AFTER"):
        monkeypatch.setattr(aggregate, "STALE_AFTER", 1.0)
    log = tmp_path / "events.txt"
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(500_000), shared=True)
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=-1, replay_buffer=rb)
    try:
        collector.add_observer(remote_observers.CollectorLog(log, "rec"))
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", 200), metrics=CollectorBatchMetrics(), name="workers")
        )
        collector.start()
        assert wait_for(lambda: channel.flush(timeout=5) and len(frames_logged(logger)) >= 3, timeout=60)
        kill_outside_buffer_writes(rb, collector.procs[0])
        time.sleep(0.5)
        channel.flush(timeout=10)
        at_kill = frames_logged(logger)[-1]
        survivor = lines_of(log, "rec", "post_collect")[1]
        # the survivor goes on: its batches are observed and the aggregate keeps growing
        assert wait_for(lambda: lines_of(log, "rec", "post_collect")[1] > survivor + 10, timeout=30)
        assert wait_for(lambda: channel.flush(timeout=5) and frames_logged(logger)[-1] > at_kill + 200, timeout=30)
        if hasattr(aggregate, "STALE_AFTER"):  # the user sees that one worker stopped reporting
            assert wait_for(
                lambda: channel.flush(timeout=5)
                and logger.series("workers/workers_reporting")[-1][1] == 1,
                timeout=30,
            )
    finally:
        start = time.monotonic()
        collector.shutdown()
        assert time.monotonic() - start < 30
    assert lines_of(log, "rec", "shutdown") == {1: 1}  # the survivor closed its window
    # the end-to-end account: the dead worker's copy is reported once and counted; what it
    # had reported stays in the aggregate
    assert not channel.flush(timeout=10)  # the loss is what this flush settles and reports
    assert channel.health()["copies_lost"] == 1
    vanished = [m for m in told if "vanished without their final report" in m]
    assert len(vanished) == 1 and "1 copies of LoggerObserver 'workers'" in vanished[0]
    assert "worker 0 (" in vanished[0] and "'frames'" in vanished[0] and "worker 1" not in vanished[0]
    assert frames_logged(logger)[-1] > at_kill + 200
    assert channel.flush(timeout=10)  # nothing more was lost since
    assert channel.close(timeout=10)


@pytest.mark.real_collector
@pytest.mark.timeout(120)
def test_removing_an_observer_after_a_worker_died_leaves_a_consistent_state(tmp_path, told):
    log = tmp_path / "events.txt"
    rb = ReplayBuffer(storage=LazyTensorStorage(500_000), shared=True)
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=-1, replay_buffer=rb)
    first = remote_observers.CollectorLog(log, "first")
    second = remote_observers.CollectorLog(log, "second")
    try:
        collector.add_observer(first)
        collector.add_observer(second)
        collector.start()
        assert wait_for(lambda: len(lines_of(log, "second", "post_collect")) == 2, timeout=60)
        kill_outside_buffer_writes(rb, collector.procs[0])
        assert wait_for(lambda: not collector.procs[0].is_alive(), timeout=10)
        start = time.monotonic()
        collector.remove_observer(first)  # no error: the dead worker's copy died with it
        collector.remove_observer(second)
        assert time.monotonic() - start < 30
        assert collector.observers == ()  # the driver's record matches the survivors
        dead = [m for m in told if "is dead" in m]
        assert len(dead) == 1 and "worker 0 (exit code -9)" in dead[0]  # reported once
        seen = {tag: lines_of(log, tag, "post_collect")[1] for tag in ("first", "second")}
        time.sleep(1.0)
        for tag in ("first", "second"):  # the survivor's copies are gone
            assert lines_of(log, tag, "post_collect")[1] <= seen[tag] + 1
        # attaching to a collector with a dead worker is refused, and attaches nothing anywhere
        with pytest.raises(RuntimeError, match=r"worker 0 \(exit code -9\) is dead; nothing was attached"):
            collector.add_observer(remote_observers.CollectorLog(log, "late"))
        assert collector.observers == ()
        time.sleep(0.5)
        assert lines_of(log, "late", "post_collect") == {}
        assert collector.procs[1].is_alive()  # nothing of this terminated the survivor
    finally:
        collector.shutdown()


# -- Ray -------------------------------------------------------------------------------------------



def _ray_collector():
    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs.utils import RandomPolicy
    from torchrl.testing.mocking_classes import CountingEnv

    env = CountingEnv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return RayCollector(
            [CountingEnv, CountingEnv],
            RandomPolicy(env.action_spec),
            frames_per_batch=10,
            total_frames=20_000,
            remote_configs={"num_cpus": 1},
        )


def _kill_actor_0_once_both_ran(ray, collector, log: Path, heard: Callable[[], Any] = lambda: True) -> None:
    """Kills actor 0 from the 4th batch on, once both actors have logged a batch and ``heard()``.

    The collector is asynchronous: on a busy machine actor 1 alone may deliver
    the first batches while actor 0 still starts.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i, _ in enumerate(collector):
            ran = set(lines_of(log, "rec", "post_collect")) == {0, 1} and heard()
            if i >= 3 and (ran or i >= 1_000):
                ray.kill(collector.remote_collectors[0], no_restart=True)


@pytest.mark.real_collector
@pytest.mark.timeout(180)
def test_a_killed_ray_collector_actor(ray_cluster, tmp_path, told):
    from ray.exceptions import RayActorError

    log = tmp_path / "events.txt"
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    collector = _ray_collector()
    try:
        collector.add_observer(remote_observers.CollectorLog(log, "rec"))
        # per worker too: killed once the owner logged actor 0's window, so the loss names its node
        collector.add_observer(
            LoggerObserver(channel, metrics=CollectorBatchMetrics(), name="workers", schedule=None, scope="both")
        )
        start = time.monotonic()
        with pytest.raises(RayActorError):
            _kill_actor_0_once_both_ran(ray_cluster, collector, log, lambda: logger.series("workers/worker_0/frames"))
        assert time.monotonic() - start < 60
    finally:
        start = time.monotonic()
        collector.shutdown()
        assert time.monotonic() - start < 60
    assert set(lines_of(log, "rec", "post_collect")) == {0, 1}
    assert logger.series("workers/worker_0/frames")  # heard before it was killed
    # the killed actor's copy vanished without its final report: reported once, counted, and
    # what this flush reports; what it had reported stays in the aggregate
    assert not channel.flush(timeout=30)  # settles the account of the copies that are gone
    assert channel.health()["copies_lost"] == 1
    vanished = [m for m in told if "vanished without their final report" in m]
    assert len(vanished) == 1 and "1 copies of LoggerObserver 'workers' on a RayCollector" in vanished[0]
    assert "worker 0 (" in vanished[0] and "/node " in vanished[0] and "'frames'" in vanished[0]
    assert frames_logged(logger) and max(frames_logged(logger)) > 0
    assert len([m for m in told if "could not emit 'shutdown'" in m]) <= 1
    assert channel.flush(timeout=10)
    assert channel.close(timeout=10)


@pytest.mark.real_collector
@pytest.mark.timeout(180)
def test_surviving_ray_actors_close_their_windows_when_another_actor_died(ray_cluster, tmp_path, told):
    from ray.exceptions import RayActorError

    log = tmp_path / "events.txt"
    collector = _ray_collector()
    try:
        collector.add_observer(remote_observers.CollectorLog(log, "rec"))
        with pytest.raises(RayActorError):
            _kill_actor_0_once_both_ran(ray_cluster, collector, log)
    finally:
        start = time.monotonic()
        collector.shutdown()
        assert time.monotonic() - start < 60
    assert lines_of(log, "rec", "shutdown") == {1: 1}  # the survivor emitted it before it was killed
    failed = [m for m in told if "could not emit 'shutdown'" in m]
    assert len(failed) == 1 and "1 of 2 Ray actors: actor 0 (" in failed[0]
