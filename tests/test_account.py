"""The end-to-end account (``rl_observers.channel.account``) through a real handle and channel.

A handle forced onto the socket transport numbers the windows it sends, as
an observer copy's handle in a worker does; the owner's account knows, per
copy, what was sent and what arrived, and counts copies that never sent
their last window.
"""

from __future__ import annotations

import logging

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
