"""The end-to-end account (``rl_observers.remote.account``) through a real handle and channel.

A handle forced onto the socket transport numbers the windows it sends, as
an observer copy's handle in a worker does; the owner's account knows, per
copy, what was sent and what arrived, and counts copies that never sent
their last window.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.record import CSVLogger

import rl_observers.remote.owner as owner_module
from rl_observers import Every, LoggerObserver, MetricsChannel
from rl_observers.channel.payload import Payload
from rl_observers.remote.window import AggregateSpec, Window
from tests.helpers import ListPartial, RecordingLogger, assert_balanced


def _window(frames: int, last: bool = False, metrics: dict | None = None) -> Window:
    return Window(
        "copies/worker_0",
        {} if metrics is None else metrics,
        observer="copies",
        worker=0,
        counters={"frames": frames},
        spec=AggregateSpec(None, "frames"),
        last=last,
    )


def test_a_copy_heard_to_its_end_counts_nothing_lost():
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    for frames in (10, 20):
        handle.submit_window(_window(frames, metrics={"frames": float(frames)}))
    handle.submit_window(_window(30, last=True))
    assert channel.flush(timeout=10)
    assert channel.close(timeout=10)
    health = channel.health()
    assert health["copies_lost"] == 0 and health["dropped"] == 0


def test_a_copy_without_its_last_window_is_reported_once_and_counted(caplog):
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    for frames in (10, 20):
        handle.submit_window(_window(frames, metrics={"frames": float(frames)}))
    assert channel.flush(timeout=10)
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        assert not channel.close(timeout=10)  # the loss is what close reports
    assert channel.health()["copies_lost"] == 1
    vanished = [r.getMessage() for r in caplog.records if "vanished without their final report" in r.getMessage()]
    assert len(vanished) == 1
    assert "worker 0" in vanished[0] and "window 2" in vanished[0] and "'frames': 20" in vanished[0]


def test_a_window_its_handle_drops_counts_once_in_dropped_by_its_gap(caplog):
    """The handle leaves a numbered window's loss to the owner's account: counted once, not twice."""
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    unpicklable = ListPartial("x", [1.0])
    unpicklable.lock = threading.Lock()
    handle.submit_window(_window(10, metrics={"frames": 10.0}))
    handle.submit_window(_window(20, metrics={"x": unpicklable}))  # window 2: dropped by the handle
    handle.submit_window(_window(30, last=True))
    assert handle.dropped == 1
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        assert not channel.close(timeout=10)
    health = channel.health()
    assert health["dropped"] == 1 and health["submitted"] == 3 and health["copies_lost"] == 0
    assert_balanced(health)
    assert any("1 of its 3 windows" in r.getMessage() for r in caplog.records)


def test_a_window_arriving_after_its_copy_was_settled_counts_once():
    """Counted lost when its copy was settled, a late window is not counted again; a newer one is."""
    from rl_observers.remote.account import Account

    lost: list[int] = []
    account = Account("late", lost.append)

    def numbered(seq: int, last: bool = False) -> Window:
        window = _window(10 * seq, last=last)
        window.copy, window.seq = "h/pid 1", seq
        return window

    assert account.note(numbered(1)) is False
    assert account.note(numbered(3)) is False
    account.settle("copies")
    assert lost == [1]  # window 2 never arrived
    assert account.note(numbered(2)) is None  # already counted: the owner must not submit it
    assert account.note(numbered(4, last=True)) is False  # never counted: the owner submits it


class _Feeder:
    """What the channel knows of an observer whose copies run elsewhere: its name."""

    name = "copies"


def test_a_copy_expected_and_never_heard_from_is_reported_and_counted(caplog):
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel._logging.copies_attached(feeder, "LoggerObserver 'copies' on a test source")
    channel._logging.copies_expected(feeder, [0, 1])
    handle.submit_window(_window(30, last=True))  # worker 0 ends
    channel._logging.copies_gone(feeder)
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        assert not channel.flush(timeout=30)  # the loss is what this flush settles and reports
    assert channel.health()["copies_lost"] == 1
    vanished = [r.getMessage() for r in caplog.records if "vanished without their final report" in r.getMessage()]
    assert len(vanished) == 1
    assert "LoggerObserver 'copies' on a test source" in vanished[0]
    assert "worker 1: never heard from" in vanished[0] and "worker 0" not in vanished[0]
    assert channel.close(timeout=10)


@pytest.mark.timeout(60)
def test_copies_gone_does_not_wait_for_a_window_that_is_not_sent_yet(monkeypatch):
    # Unbounded patience for last windows: copies_gone returns all the same, before the copy's
    # last window is even sent (a later step here); the flush that follows waits for it.
    monkeypatch.setattr(owner_module, "LAST_WINDOWS_WAIT", 1e6)  # 11 days
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel._logging.copies_attached(feeder, "LoggerObserver 'copies'")
    channel._logging.copies_expected(feeder, [0])
    handle.submit_window(_window(10, metrics={"frames": 10.0}))
    channel._logging.copies_gone(feeder)  # returns: the last window is not there yet
    assert channel.health()["copies_lost"] == 0  # not settled: it may still come
    handle.submit_window(_window(20, last=True))
    assert channel.flush(timeout=30)  # it came: settled, nothing lost
    assert channel.health()["copies_lost"] == channel.health()["dropped"] == 0
    assert channel.close(timeout=10)


def test_a_copy_gone_without_its_last_window_is_settled_by_the_next_flush():
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel._logging.copies_attached(feeder, "LoggerObserver 'copies'")
    handle.submit_window(_window(10, metrics={"frames": 10.0}))  # no last one
    channel._logging.copies_gone(feeder)
    assert not channel.flush(timeout=30)  # waits LAST_WINDOWS_WAIT at most, then counts it
    assert channel.health()["copies_lost"] == 1
    assert channel.close(timeout=10)


def test_the_channels_health_rows_carry_the_account(tmp_path):
    logger = CSVLogger(exp_name="health", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=0.0, background=False)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel._logging.copies_attached(feeder, "LoggerObserver 'copies'")
    channel._logging.copies_expected(feeder, [0, 1])
    handle.submit_window(_window(10, metrics={"frames": 10.0}))
    channel.step()
    channel._logging.copies_gone(feeder)  # worker 0 never sent its last window, worker 1 nothing
    assert not channel.flush(timeout=30)
    channel.step()
    scalars = logger.experiment.scalars
    assert scalars["channel/copies_lost"][-1][1] == 2
    assert scalars["channel/dropped"][-1][1] == 0
    channel.close()


_EXIT_AFTER_CLOSE = textwrap.dedent(
    """
    import sys

    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs.utils import RandomPolicy
    from torchrl.record import CSVLogger
    from torchrl.testing.mocking_classes import CountingEnv

    from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel

    if __name__ == "__main__":
        channel = MetricsChannel(CSVLogger(exp_name="exit", log_dir=sys.argv[1]), health_interval=None)
        env = CountingEnv(max_steps=7)
        collector = MultiSyncCollector(
            [CountingEnv, CountingEnv], RandomPolicy(env.action_spec), frames_per_batch=100, total_frames=400
        )
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", 200), metrics=CollectorBatchMetrics())
        )
        for _ in collector:
            pass
        collector.shutdown()
        print("closed", channel.close(timeout=20), channel.health()["dropped"], flush=True)
        # the driver-side original is still alive here, and the interpreter exits
    """
)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_exit_after_shutdown_and_close_says_nothing(tmp_path):
    script = tmp_path / "exit_after_close.py"
    script.write_text(_EXIT_AFTER_CLOSE)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "closed True 0" in done.stdout, done.stdout + done.stderr
    assert "after close()" not in done.stdout + done.stderr  # no end marker sent into the closed channel
    assert "Logging error" not in done.stderr


def test_a_window_undeliverable_at_exit_is_still_counted():
    # An original that folded data since its last report (a driver writing into a buffer whose
    # copies run elsewhere) and whose channel is closed: at exit its window is counted dropped.
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    holding = LoggerObserver(channel, name="holding", schedule=Every.counter("write_count", 1000), report_interval=1e6)
    idle = LoggerObserver(channel, name="idle", schedule=Every.counter("write_count", 1000), report_interval=1e6)
    rb.add_observer(holding)
    holding.prepare_copies(rb)  # what a source whose copies run elsewhere does on the driver
    other = ReplayBuffer(storage=LazyTensorStorage(100))
    other.add_observer(idle)
    idle.prepare_copies(other)
    channel._logging.copies_gone(holding)
    channel._logging.copies_gone(idle)
    assert channel.close(timeout=10)
    rb.extend(torch.arange(10))  # folded after the close, not due yet
    before = channel.health()["dropped"]
    LoggerObserver._report_live_at_exit()  # what the COPIES phase of the exit runs
    assert channel.health()["dropped"] == before + 1  # the holding one; the idle one sent nothing


def test_a_plain_payload_merges_into_a_window_of_its_namespace():
    window = Window("train/worker_0", {"x": 1.0}, step=3, observer="train", worker=0)
    assert window.absorb(Payload("train/worker_0", {"x": 2.0, "y": 5.0}, 4)) is None
    assert window.metrics == {"x": 2.0, "y": 5.0} and window.step == 4
