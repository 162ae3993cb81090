"""Observed collectors started with ``.start()`` leave no child process behind.

Whatever the order of attaching, starting, failing and shutting down, once
``async_shutdown(timeout=...)`` or ``shutdown()`` returned (or the collector
was deleted) no worker process of the collector is alive. A hang fails the
test (``pytest-timeout``) instead of blocking the suite.
"""

from __future__ import annotations

import gc
import time

import psutil
import pytest
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.record.loggers.csv import CSVLogger
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

from rl_observers import LoggerObserver
from rl_observers.testing import EventRecorder
from tests.helpers import start_method

pytestmark = pytest.mark.timeout(180)


def _children() -> set[int]:
    """This process's descendants, without multiprocessing's resource tracker (it lives on by design)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.Error:
            continue
        found.add(child.pid)
    return found


def _wait_until_gone(before: set[int], timeout: float = 20.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = _children() - before
        alive = set()
        for pid in left:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _policy():
    env = ContinuousActionVecMockEnv()
    module = nn.Linear(env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1])
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"]), module


def _build(kind, tmp_path, observe):
    policy, module = _policy()
    rb = ReplayBuffer(storage=LazyTensorStorage(1_000), shared=True)
    collector = kind(
        [ContinuousActionVecMockEnv, ContinuousActionVecMockEnv],
        policy,
        replay_buffer=rb,
        frames_per_batch=16,
        total_frames=-1,
    )
    if observe:
        _observe(collector, rb, tmp_path)
    return collector, rb, module


def _observe(collector, rb, tmp_path):
    logger = CSVLogger("lifecycle", log_dir=str(tmp_path))
    rb.add_observer(LoggerObserver(logger, schedule=None))
    rb.add_observer(EventRecorder())
    collector.add_observer(LoggerObserver(logger, schedule=None))
    collector.add_observer(EventRecorder())


def _wait_for_data(rb, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not len(rb):
        assert time.monotonic() < deadline, "RB is empty"
        time.sleep(0.02)


@pytest.mark.real_collector
@pytest.mark.parametrize(
    ("kind", "method"),
    [(MultiAsyncCollector, "spawn"), (MultiAsyncCollector, "fork"), (MultiSyncCollector, "fork")],
    ids=["async-spawn", "async-fork", "sync-fork"],
)
def test_start_update_policy_async_shutdown_leaves_no_child(tmp_path, kind, method):
    """torchrl's ``test_start_update_policy`` pattern, observed on the collector and its buffer."""
    before = _children()
    with start_method(method):
        collector, rb, module = _build(kind, tmp_path, observe=True)
        try:
            collector.start()
            _wait_for_data(rb)
            module.weight.data += 1
            collector.update_policy_weights_()
        finally:
            collector.async_shutdown(timeout=10)
    assert _wait_until_gone(before) == set()


@pytest.mark.real_collector
@pytest.mark.parametrize("order", ["attach_then_start", "start_then_attach"])
def test_user_error_between_start_and_shutdown_leaves_no_child(tmp_path, order):
    before = _children()
    with start_method("fork"):
        collector, rb, _ = _build(MultiAsyncCollector, tmp_path, observe=order == "attach_then_start")
        with pytest.raises(ZeroDivisionError):
            try:
                collector.start()
                if order == "start_then_attach":  # attaching while it runs free
                    _observe(collector, rb, tmp_path)
                _wait_for_data(rb)
                1 / 0  # noqa: B018  (the user's training code fails)
            finally:
                collector.shutdown()
    assert _wait_until_gone(before) == set()


@pytest.mark.real_collector
def test_attach_failure_after_start_leaves_no_child(tmp_path):
    class RefusesWorkers:
        def attached(self, source):
            raise RuntimeError("refused")

        def on_post_collect(self, source, batch):
            pass

    before = _children()
    with start_method("fork"):
        collector, rb, _ = _build(MultiAsyncCollector, tmp_path, observe=True)
        try:
            collector.start()
            with pytest.raises(Exception, match="refused"):
                collector.add_observer(RefusesWorkers())
            _wait_for_data(rb)
        finally:
            collector.async_shutdown(timeout=10)
    assert _wait_until_gone(before) == set()


@pytest.mark.real_collector
def test_deleted_collector_shuts_its_workers_down(tmp_path):
    """Never shut down, only dropped: torchrl's ``__del__`` shuts the workers down, observed or not.

    Observers hold neither the collector nor its buffer alive. A collector
    that stays referenced (a global, a failing test's traceback) keeps its
    workers running free until it is shut down, as in torchrl.
    """
    before = _children()
    with start_method("fork"):
        collector, rb, _ = _build(MultiAsyncCollector, tmp_path, observe=True)
        collector.start()
        _wait_for_data(rb)
        del collector
        gc.collect()
    assert _wait_until_gone(before) == set()


@pytest.mark.real_collector
def test_shutdown_before_start_then_attach_refused_leaves_no_child(tmp_path):
    before = _children()
    with start_method("fork"):
        collector, rb, _ = _build(MultiSyncCollector, tmp_path, observe=True)
        collector.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            collector.add_observer(EventRecorder())
        rb.add_observer(EventRecorder())  # the buffer lives on; its collector's workers are gone
    assert _wait_until_gone(before) == set()
