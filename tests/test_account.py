"""The end-to-end account (``rl_observers.channel.account``) through a real handle and channel.

A handle forced onto the socket transport numbers the windows it sends, as
an observer copy's handle in a worker does; the owner's account knows, per
copy, what was sent and what arrived, and counts copies that never sent
their last window.
"""

from __future__ import annotations

import logging

import pytest
from torchrl.record import CSVLogger

import rl_observers.channel.owner as owner_module
from rl_observers import MetricsChannel
from rl_observers.channel.meta import AGGREGATE, COUNTERS, LAST, WORKER
from rl_observers.logging.aggregate import AggregateSpec
from tests.helpers import RecordingLogger


def _window(frames: int, last: bool = False) -> dict:
    meta = {AGGREGATE: "copies", WORKER: 0, COUNTERS: {"frames": frames}, **AggregateSpec(None, "frames").as_meta()}
    if last:
        meta[LAST] = True
    return meta


def test_a_copy_heard_to_its_end_counts_nothing_lost():
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    for frames in (10, 20):
        handle.submit_metrics({"frames": float(frames)}, namespace="copies/worker_0", meta=_window(frames))
    handle.submit_metrics({}, namespace="copies/worker_0", meta=_window(30, last=True))
    assert channel.flush(timeout=10)
    assert channel.close(timeout=10)
    health = channel.health()
    assert health["copies_lost"] == 0 and health["windows_lost"] == 0


def test_a_copy_without_its_last_window_is_reported_once_and_counted(caplog):
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    for frames in (10, 20):
        handle.submit_metrics({"frames": float(frames)}, namespace="copies/worker_0", meta=_window(frames))
    assert channel.flush(timeout=10)
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        assert not channel.close(timeout=10)  # the loss is what close reports
    assert channel.health()["copies_lost"] == 1
    vanished = [r.getMessage() for r in caplog.records if "vanished without their final report" in r.getMessage()]
    assert len(vanished) == 1
    assert "worker 0" in vanished[0] and "window 2" in vanished[0] and "'frames': 20" in vanished[0]


class _Feeder:
    """What the channel knows of an observer whose copies run elsewhere: its name."""

    name = "copies"


def test_a_copy_expected_and_never_heard_from_is_reported_and_counted(caplog):
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel.copies_attached(feeder, "LoggerObserver 'copies' on a test source")
    channel.copies_expected(feeder, [0, 1])
    handle.submit_metrics({}, namespace="copies/worker_0", meta=_window(30, last=True))  # worker 0 ends
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        channel.copies_gone(feeder)
    assert channel.health()["copies_lost"] == 1
    vanished = [r.getMessage() for r in caplog.records if "vanished without their final report" in r.getMessage()]
    assert len(vanished) == 1
    assert "LoggerObserver 'copies' on a test source" in vanished[0]
    assert "worker 1: never heard from" in vanished[0] and "worker 0" not in vanished[0]
    assert not channel.flush(timeout=10)  # the loss is what this flush reports
    assert channel.close(timeout=10)


@pytest.mark.timeout(60)
def test_copies_gone_does_not_wait_for_a_window_that_was_never_sent(monkeypatch):
    # Unbounded patience: copies_gone returns only if it never waits for the vanished copy's
    # last window (which nobody sends); it settles the account at once and counts the copy.
    monkeypatch.setattr(owner_module, "LAST_WINDOWS_WAIT", 1e6)  # 11 days
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel.copies_attached(feeder, "LoggerObserver 'copies'")
    handle.submit_metrics({"frames": 10.0}, namespace="copies/worker_0", meta=_window(10))  # no last one
    channel.copies_gone(feeder)
    assert channel.health()["copies_lost"] == 1
    channel.close(timeout=10)


def test_the_channels_health_rows_carry_the_account(tmp_path):
    logger = CSVLogger(exp_name="health", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=0.0, background=False)
    handle = channel.handle(transport="socket")
    feeder = _Feeder()
    channel.copies_attached(feeder, "LoggerObserver 'copies'")
    channel.copies_expected(feeder, [0, 1])
    handle.submit_metrics({"frames": 10.0}, namespace="copies/worker_0", meta=_window(10))
    channel.step()
    channel.copies_gone(feeder)  # worker 0 never sent its last window, worker 1 nothing
    channel.step()
    scalars = logger.experiment.scalars
    assert scalars["channel/copies_lost"][-1][1] == 2
    assert scalars["channel/windows_lost"][-1][1] == 0
    channel.close()
