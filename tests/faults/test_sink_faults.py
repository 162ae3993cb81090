"""Sink faults: a logger that is slow, hung, raising, flaky, or a logger service that dies.

Each case runs the same seeded loop (a real ``Collector`` writing into a real
replay buffer and sampling from it), with a ``LoggerObserver`` on each, and
checks that the loop's data is identical to a run without observers, that
the channel stays bounded and accounts for every submission, that
``flush`` / ``close`` return within their timeouts, that what was submitted
before the fault reached the logger, and that the user is told once.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

import rl_observers.channel.delivery as delivery_module
from rl_observers import LoggerObserver, MetricsChannel
from tests.faults.conftest import (
    BATCHES,
    TOTAL_FRAMES,
    assert_same_data,
    run_loop,
    window_total,
)
from tests.helpers import RecordingLogger, assert_balanced, read_csv, wait_for

CAPACITY = 4


def observe_into(channel: MetricsChannel):
    """Attaches a LoggerObserver (default metrics, emitting at every event) to both sources."""

    def attach(collector, rb):
        collector.add_observer(LoggerObserver(channel, schedule=None))
        rb.add_observer(LoggerObserver(channel, schedule=None))

    return attach


def assert_nothing_lost(logger: RecordingLogger) -> None:
    """Every window reached the logger: coalesced partials merged, newest gauges kept."""
    assert logger.series("collector/frames")[-1] == (TOTAL_FRAMES, float(TOTAL_FRAMES))
    episodes_total = logger.series("collector/episodes_total")[-1][1]
    assert episodes_total > 0
    assert window_total(logger, "collector/episodes") == episodes_total
    assert window_total(logger, "collector/dones") == episodes_total
    assert logger.series("replay_buffer/items_written")[-1][1] == TOTAL_FRAMES
    assert logger.series("replay_buffer/sample_calls")[-1][1] == BATCHES


def sink_warnings(told: list[str]) -> list[str]:
    """The warnings of the sink's failures (not those of flush()/close() returning False)."""
    return [m for m in told if "MetricsChannel" in m and "returns False" not in m]


def returned_false(told: list[str], what: str) -> list[str]:
    """The warnings of ``what`` (``"flush"``, ``"close"``) returning False."""
    return [m for m in told if f"{what}() returns False" in m]


@pytest.mark.timeout(60)
def test_a_slow_sink_changes_nothing_and_loses_nothing(reference, told):
    logger = RecordingLogger(delay=0.2)
    channel = MetricsChannel(logger, capacity=CAPACITY, health_interval=None)
    observed = run_loop(observe_into(channel))
    assert_same_data(reference, observed)
    health = channel.health()
    assert health["pending"] <= CAPACITY + 1  # the bound holds (one entry in flight)
    assert_balanced(health)
    start = time.monotonic()
    assert channel.flush(timeout=0.05) is False  # still logging: reported, not waited for
    assert time.monotonic() - start < 2.0
    assert channel.flush(timeout=30)
    assert_nothing_lost(logger)
    assert channel.close(timeout=30)
    assert sink_warnings(told) == []


@pytest.mark.timeout(60)
def test_a_hung_sink_blocks_nothing_and_delivers_once_released(reference, gate, told):
    logger = RecordingLogger(gate=gate)
    channel = MetricsChannel(logger, capacity=CAPACITY, name="hung", health_interval=None)
    observed = run_loop(observe_into(channel))
    assert_same_data(reference, observed)
    health = channel.health()
    assert health["pending"] <= CAPACITY + 1
    assert health["coalesced"] + health["dropped"] > 0  # the flood was bounded
    assert_balanced(health)
    start = time.monotonic()
    assert channel.flush(timeout=0.2) is False
    assert channel.close(timeout=0.2) is False
    assert time.monotonic() - start < 3.0
    gate.set()  # the logger comes back: the left-behind thread delivers and stops
    assert wait_for(lambda: not any(t.name == "MetricsChannel[hung]" for t in threading.enumerate()))
    assert channel.health()["pending"] == 0
    assert_nothing_lost(logger)


@pytest.mark.timeout(30)
def test_close_without_timeout_gives_up_on_a_hung_sink_and_says_so(gate, told, monkeypatch):
    monkeypatch.setattr(delivery_module, "CLOSE_STALL_TIMEOUT", 0.3)
    channel = MetricsChannel(RecordingLogger(gate=gate), name="stuck", health_interval=None)
    channel.submit_metrics({"x": 1.0})
    channel.submit_metrics({"x": 2.0}, namespace="other")
    start = time.monotonic()
    assert channel.close() is False  # no timeout given: bounded by the stall limit
    assert time.monotonic() - start < 5.0
    (message,) = sink_warnings(told)
    assert "'stuck'" in message and "has not returned" in message and "2 entries" in message
    (returned,) = returned_false(told, "close")
    assert "'stuck'" in returned and "pending 2" in returned
    with MetricsChannel(RecordingLogger(gate=gate), name="stuck2", health_interval=None) as other:
        other.submit_metrics({"x": 1.0})
    assert other.closed  # leaving the with block is bounded too


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["warn", "raise", "ignore"])
def test_a_sink_raising_at_every_call(reference, told, on_error):
    logger = RecordingLogger(fail=lambda attempt: True)
    channel = MetricsChannel(logger, capacity=CAPACITY, on_error=on_error, health_interval=None)
    observed = run_loop(observe_into(channel))
    assert_same_data(reference, observed)  # the source never sees the sink's errors
    start = time.monotonic()
    if on_error == "raise":
        with pytest.raises(RuntimeError, match="sink failure on call #1"):
            channel.flush(timeout=10)
        assert channel.flush(timeout=10)  # raised once
    else:
        assert channel.flush(timeout=10) is False  # nothing reached the logger: never True
    assert time.monotonic() - start < 10
    health = channel.health()
    assert health["logged"] == 0 and health["sink_errors"] == logger.attempts > 0
    assert_balanced(health)
    expected = 1 if on_error == "warn" else 0
    assert len(sink_warnings(told)) == expected
    if on_error == "raise":
        with pytest.raises(RuntimeError, match="sink failure"):
            channel.submit_metrics({"x": 1.0})
            channel.close(timeout=10)
    else:
        assert channel.close(timeout=10)  # nothing failed since the last flush
    assert channel.closed


@pytest.mark.timeout(60)
def test_a_flaky_sink_recovers_and_logging_resumes(told):
    broken = threading.Event()
    logger = RecordingLogger(fail=lambda attempt: broken.is_set())
    channel = MetricsChannel(logger, name="flaky", health_interval=0.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    rb.add_observer(LoggerObserver(channel, name="rb", schedule=None))

    refused = []

    def write(n, delivered=True):
        for _ in range(n):
            rb.extend(torch.arange(4))
        assert channel.flush(timeout=10) is delivered  # False while the sink fails
        refused.append(not delivered)

    write(3)  # before the fault: logged
    broken.set()
    write(3, delivered=False)  # the sink fails: counted, told once
    broken.clear()
    write(3)  # recovered: logging resumes
    broken.set()
    write(1, delivered=False)  # a second failure streak is told again
    broken.clear()
    write(1)
    items = [value for _, value in logger.series("rb/items_written")]
    assert items == [4.0, 8.0, 12.0, 28.0, 32.0, 36.0, 44.0]
    health = channel.health()
    assert health["sink_errors"] >= 4
    assert_balanced(health)
    streaks = [m for m in sink_warnings(told) if "'flaky'" in m]
    assert len(streaks) == 2 and "sink failure" in streaks[0]
    # each flush that returned False said so
    assert len(returned_false(told, "flush")) == sum(refused) == 2
    # the channel's health, logged once the sink is back, reports the errors
    assert wait_for(lambda: (logger.series("flaky/sink_errors") or [(0, -1)])[-1][1] == health["sink_errors"])
    assert channel.close(timeout=10)


class ConnectionLost(RecordingLogger):
    """A logger whose every call raises ``ConnectionError`` (a remote sink gone for good)."""

    def log_metrics(self, metrics, step=None, **kwargs):
        self.attempts += 1
        raise ConnectionError("sink unreachable")


def test_a_sink_that_never_recovers_stays_visible(told, monkeypatch):
    """Warned at the first failure, again while it keeps failing (with counts), and at close()."""
    monkeypatch.setattr(delivery_module, "REPEAT_WARNING_SECONDS", 1e9)  # no repeat is due yet
    logger = ConnectionLost()
    channel = MetricsChannel(logger, name="gone", background=False, health_interval=None)
    for step in range(3):
        channel.submit_metrics({"x": float(step)}, step=step, namespace="train")
        channel.step()
    said = [m for m in sink_warnings(told) if "'gone'" in m]
    assert len(said) == 1 and "ConnectionError('sink unreachable')" in said[0]
    assert "at most once every 1e+09 seconds" in said[0]
    # the repeat interval has passed (here: it is 0): each failure warns again, with counts
    monkeypatch.setattr(delivery_module, "REPEAT_WARNING_SECONDS", 0.0)
    for step in range(3, 5):
        channel.submit_metrics({"x": float(step)}, step=step, namespace="train")
        channel.step()
    said = [m for m in sink_warnings(told) if "'gone'" in m]
    assert len(said) == 3
    assert "still failing: 3 more failure(s) since the previous warning, 4 in this streak" in said[1]
    # (the entry being logged when the sink raised is still pending)
    assert "submitted 4, logged 0, pending 1, dropped 0, failed (sink_errors) 3" in said[1]
    assert "1 more failure(s) since the previous warning, 5 in this streak" in said[2]
    assert not channel.close()
    assert returned_false(told, "close") == [
        "MetricsChannel 'gone': close() returns False: since the previous flush() or close(), "
        "something failed or was not delivered (submitted 5, logged 0, pending 0, dropped 0, "
        "failed (sink_errors) 5). See channel.health() and the warnings above."
    ]
    assert logger.attempts == 5


def test_on_error_ignore_stays_quiet_at_close(told):
    channel = MetricsChannel(ConnectionLost(), name="quiet", background=False, on_error="ignore")
    channel.submit_metrics({"x": 1.0}, namespace="train")
    channel.step()
    assert not channel.close()
    assert not [m for m in told if "'quiet'" in m]


# -- logger services whose process or actor dies ---------------------------------------------------




def _kill_service_mid_run(logger, kill, told, reference):
    """Half the loop logs through the service; it is killed; the loop finishes regardless."""
    channel = MetricsChannel(logger, capacity=CAPACITY, name="svc", health_interval=None)
    killed = []

    def attach(collector, rb):
        collector.add_observer(LoggerObserver(channel, schedule=None))
        rb.add_observer(LoggerObserver(channel, schedule=None))

        class KillAtBatch3:
            batches = 0

            def on_post_collect(self, source, batch):
                self.batches += 1
                if self.batches == 3:
                    assert channel.flush(timeout=60)  # the first windows reached the service
                    kill()
                    killed.append(True)

        collector.add_observer(KillAtBatch3())

    observed = run_loop(attach)
    assert killed
    assert_same_data(reference, observed)
    start = time.monotonic()
    channel.flush(timeout=30)  # bounded whatever the dead service does
    assert channel.close(timeout=10) in (True, False)
    assert time.monotonic() - start < 45
    health = channel.health()
    assert health["sink_errors"] > 0
    assert_balanced(health)
    assert len([m for m in sink_warnings(told) if "'svc'" in m]) == 1
    return health


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_process_logger_service(tmp_path, told, reference):
    from torchrl.record import CSVLogger

    logger = CSVLogger(exp_name="svc", log_dir=str(tmp_path), service_backend="process")
    try:
        _kill_service_mid_run(logger, logger._process.kill, told, reference)
        assert not logger.is_alive
        with pytest.raises(ValueError, match="shut down"):  # a dead service is refused up front
            LoggerObserver(logger, schedule=None)
    finally:
        try:
            logger.shutdown(timeout=5)
        except Exception:
            pass
    frames = read_csv(tmp_path / "svc" / "scalars" / "collector" / "frames.csv")
    assert (48, 48.0) in frames  # flushed before the kill at the third batch: kept


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_ray_logger_service(tmp_path, told, reference, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        from torchrl.record import CSVLogger

        logger = CSVLogger(exp_name="svc", log_dir=str(tmp_path), service_backend="ray")
        actor = logger._actor
        _kill_service_mid_run(logger, lambda: ray.kill(actor, no_restart=True), told, reference)
        try:
            logger.shutdown(timeout=5)
        except Exception:
            pass
    finally:
        if started:
            ray.shutdown()
    frames = read_csv(tmp_path / "svc" / "scalars" / "collector" / "frames.csv")
    assert (48, 48.0) in frames
    assert os.path.exists(tmp_path / "svc" / "scalars" / "replay_buffer")
