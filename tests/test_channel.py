"""Tests of the channel (queue, coalescing, delivery, health): real torchrl loggers and recording fakes of a sink.

What crosses a process through a handle (the socket transport) is tested in
``tests/remote/test_socket_transport.py``.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torchrl.record.loggers import CSVLogger

from rl_observers.remote import MetricsChannel
from rl_observers.remote.window import Window
from tests.helpers import (
    ListPartial,
    RecordingLogger,
    assert_balanced,
    read_csv,
    socket_handle,
    sync_channel,
    wait_for,
)

# ---------------------------------------------------------------------------
# recording fakes
# ---------------------------------------------------------------------------


class ScalarSink:
    """Not a torchrl Logger: only ``log_scalar``."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, Any, int | None]] = []

    def log_scalar(self, name, value, step=None):
        self.scalars.append((name, value, step))


class BadMergePartial(ListPartial):
    def merge(self, other):
        raise ValueError("cannot merge")


# ---------------------------------------------------------------------------
# construction and validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, 2.5, True])
def test_capacity_must_be_a_positive_int(capacity):
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        MetricsChannel(RecordingLogger(), capacity=capacity, background=False)


def test_on_error_must_be_a_known_policy():
    with pytest.raises(ValueError, match="'warn', 'raise' or 'ignore', got 'loud'"):
        MetricsChannel(RecordingLogger(), on_error="loud", background=False)


def test_logger_needs_a_log_method():
    with pytest.raises(TypeError, match="log_metrics.*got 42"):
        MetricsChannel(42, background=False)


def test_submit_rejects_what_is_not_a_flat_mapping_of_names():
    channel = sync_channel(RecordingLogger())
    with pytest.raises(TypeError, match=r"expected a mapping .* got \[1, 2\]"):
        channel.submit_metrics([1, 2])
    with pytest.raises(TypeError, match=r"names of type str, got 3 \(int\)"):
        channel.submit_metrics({3: 1.0})
    with pytest.raises(TypeError, match="str namespace, got 7"):
        channel.submit_metrics({"a": 1.0}, namespace=7)
    assert channel.health()["submitted"] == 0
    channel.close()


# ---------------------------------------------------------------------------
# delivery: names, steps, partials
# ---------------------------------------------------------------------------


def test_one_logger_call_per_entry_with_names_and_steps_per_namespace():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    channel.submit_metrics({"x": 1.0})
    channel.submit_metrics({"y": 2, "z": 3.5}, step=10, namespace="collector")
    channel.submit_metrics({"w": 4.0}, step=7, namespace="replay_buffer")
    assert logger.calls == []  # nothing reaches the logger from submit
    assert channel.step() == 3
    assert logger.calls == [
        ({"x": 1.0}, None),
        ({"collector/y": 2, "collector/z": 3.5}, 10),
        ({"replay_buffer/w": 4.0}, 7),
    ]
    assert channel.close()


def test_partials_expand_into_their_finalized_names_at_logging_time():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    partial = ListPartial("reward", [1.0, 2.0, 3.0])
    channel.submit_metrics({"reward": partial, "frames": 300}, step=300, namespace="collector")
    assert partial.finalized == 0
    channel.step()
    assert partial.finalized == 1
    assert logger.calls == [
        (
            {
                "collector/reward_count": 3.0,
                "collector/reward_sum": 6.0,
                "collector/frames": 300,
            },
            300,
        )
    ]
    channel.close()


def test_a_sink_with_only_log_scalar_is_accepted():
    sink = ScalarSink()
    channel = sync_channel(sink)
    channel.submit_metrics({"a": 1.0, "b": ListPartial("r", [2.0])}, step=4, namespace="ns")
    channel.step()
    assert sorted(sink.scalars) == [
        ("ns/a", 1.0, 4),
        ("ns/r_count", 1.0, 4),
        ("ns/r_sum", 2.0, 4),
    ]
    channel.close()


def test_the_submitted_mapping_is_copied():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    metrics = {"a": 1.0}
    channel.submit_metrics(metrics)
    metrics["a"] = 2.0
    metrics["b"] = 3.0
    channel.step()
    assert logger.calls == [({"a": 1.0}, None)]
    channel.close()


def test_a_window_travels_typed_to_the_router_of_its_class():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    seen = []

    class Recorder:
        def route(self, window):
            seen.append((window.namespace, window.observer, window.worker, window.counters))
            return [(window.namespace, window.metrics, window.step)]

        def finish(self):
            return []

    channel._logging.add_router(Window, Recorder())
    channel.submit_window(Window("w", {"a": 1.0}, observer="o", worker=3, counters={"frames": 1}))
    channel.handle().submit_window(Window("w", {"a": 2.0}, observer="o", worker=2))
    remote = channel.handle(transport="socket")  # as from another process: numbered, pickled
    remote.submit_window(Window("w", {"a": 3.0}, step=7, observer="o", worker=1))
    channel.submit_metrics({"a": 4.0}, namespace="plain")  # a plain payload: no router
    channel.step()
    assert seen == [("w", "o", 3, {"frames": 1}), ("w", "o", 2, None), ("w", "o", 1, None)]
    assert logger.calls == [({"w/a": 1.0}, None), ({"w/a": 2.0}, None), ({"plain/a": 4.0}, None), ({"w/a": 3.0}, 7)]
    channel.close()


def test_a_router_that_is_empty_by_len_still_routes_its_class(tmp_path):
    logger = CSVLogger(exp_name="sized", log_dir=str(tmp_path))
    channel = sync_channel(logger, name="sized")

    class Buffered:
        """Holds each window until the next one: ``len()`` says how many it holds."""

        def __init__(self):
            self.held = []

        def __len__(self):
            return len(self.held)

        def route(self, window):
            rows = [("routed", held.metrics, held.step) for held in self.held]
            self.held = [window]
            return rows

        def finish(self):
            rows = [("routed", held.metrics, held.step) for held in self.held]
            self.held = []
            return rows

    channel._logging.add_router(Window, Buffered())
    for step, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
        channel.submit_window(Window("w", {"v": value}, step=step, observer="sized"))
        channel.step()
    channel.close()
    assert read_csv(tmp_path / "sized" / "scalars" / "routed" / "v.csv") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not (tmp_path / "sized" / "scalars" / "w").exists()  # nothing bypassed the router


def test_a_router_factory_that_raises_counts_its_entry_as_a_sink_error(tmp_path, warnings_seen):
    from rl_observers.channel.delivery import _ROUTER_FACTORIES, register_router
    from rl_observers.channel.payload import Payload, payload_class

    @payload_class
    class Unroutable(Payload):
        pass

    def broken_factory():
        raise RuntimeError("no router today")

    register_router(Unroutable, broken_factory)
    try:
        logger = CSVLogger(exp_name="factory", log_dir=str(tmp_path))
        channel = sync_channel(logger, name="factory", on_error="warn")
        channel.submit_window(Unroutable("u", {"v": 1.0}))
        channel.submit_metrics({"v": 2.0}, step=1, namespace="plain")
        assert channel.step() == 2  # the failing entry is done with; delivery goes on
        health = channel.health()
        assert_balanced(health)
        assert (health["sink_errors"], health["logged"], health["pending"]) == (1, 1, 0)
        assert any("no router today" in m for m in warnings_seen), warnings_seen
        assert read_csv(tmp_path / "factory" / "scalars" / "plain" / "v.csv") == [(1, 2.0)]
        assert not channel.close()  # something failed since the last check
    finally:
        del _ROUTER_FACTORIES[Unroutable]


def test_a_row_the_logger_refuses_loses_no_other_row_of_the_entry(tmp_path, warnings_seen):
    logger = CSVLogger(exp_name="rows", log_dir=str(tmp_path))
    channel = sync_channel(logger, name="rows")

    class Fanout:
        """Routes one entry to three rows; the middle one's name is too long for a file."""

        def route(self, window):
            metrics, step = window.metrics, window.step
            return [("first", metrics, step), ("x" * 1000, metrics, step), ("last", metrics, step)]

        def finish(self):
            return []

    channel._logging.add_router(Window, Fanout())
    channel.submit_window(Window("w", {"v": 1.0}, step=4, observer="fanout"))
    channel.submit_window(Window("w", {"v": 2.0}, step=5, observer="fanout"))
    channel.step()
    scalars = tmp_path / "rows" / "scalars"
    assert read_csv(scalars / "first" / "v.csv") == [(4, 1.0), (5, 2.0)]
    assert read_csv(scalars / "last" / "v.csv") == [(4, 1.0), (5, 2.0)]
    health = channel.health()
    assert health["sink_errors"] == 2 and health["logged"] == 0  # each entry lost a row
    assert_balanced(health)
    (message,) = [m for m in warnings_seen if "MetricsChannel 'rows'" in m]
    assert "xxx" in message and "name too long" in message.lower()
    assert channel.flush(timeout=10) is False
    channel.close()


# ---------------------------------------------------------------------------
# bounded queue: coalescing and dropping
# ---------------------------------------------------------------------------


def test_overflow_coalesces_into_the_newest_entry_of_the_namespace_exactly():
    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=2)
    channel.submit_metrics({"r": ListPartial("r", [1.0]), "g": 1.0}, step=1, namespace="a")
    channel.submit_metrics({"q": 5.0}, step=1, namespace="b")
    # queue full: these merge into the pending "a" entry
    channel.submit_metrics({"r": ListPartial("r", [2.0, 3.0]), "g": 2.0}, step=2, namespace="a")
    channel.submit_metrics(
        {"r": ListPartial("r", [4.0]), "g": 3.0, "h": 9.0}, step=3, namespace="a"
    )
    health = channel.health()
    assert health["pending"] == 2 and health["coalesced"] == 2 and health["dropped"] == 0
    assert_balanced(health)
    channel.step()
    assert logger.calls == [
        ({"a/r_count": 4.0, "a/r_sum": 10.0, "a/g": 3.0, "a/h": 9.0}, 3),
        ({"b/q": 5.0}, 1),
    ]
    health = channel.health()
    assert health["logged"] == 2
    assert_balanced(health)
    channel.close()


def test_overflow_drops_the_oldest_entry_when_the_namespace_has_none_pending():
    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=2)
    channel.submit_metrics({"x": 1.0}, step=1, namespace="a")
    channel.submit_metrics({"x": 2.0}, step=1, namespace="b")
    channel.submit_metrics({"x": 3.0}, step=1, namespace="c")
    # "a" left the queue: a new "a" drops "b" instead of merging
    channel.submit_metrics({"x": 4.0}, step=2, namespace="a")
    health = channel.health()
    assert health["dropped"] == 2 and health["coalesced"] == 0 and health["pending"] == 2
    channel.step()
    assert logger.calls == [({"c/x": 3.0}, 1), ({"a/x": 4.0}, 2)]
    assert_balanced(channel.health())
    channel.close()


def test_dropping_an_entry_counts_every_payload_merged_into_it():
    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=1)
    for i in range(100):  # one pending entry of "a" holding 100 payloads
        channel.submit_metrics({"r": ListPartial("r", [1.0])}, step=i, namespace="a")
    health = channel.health()
    assert health["coalesced"] == 99 and health["dropped"] == 0
    channel.submit_metrics({"r": ListPartial("r", [1.0])}, namespace="b")  # drops "a"
    health = channel.health()
    assert health["dropped"] == 100 and health["coalesced"] == 0
    assert_balanced(health)
    channel.step()
    assert logger.calls == [({"b/r_count": 1.0, "b/r_sum": 1.0}, None)]
    assert_balanced(channel.health())
    channel.close()


def test_payloads_logged_plus_dropped_equal_those_submitted_under_a_flood():
    import random

    from rl_observers.stats import Count

    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=3)
    rng = random.Random(0)
    for i in range(5000):  # a busy namespace and rare ones: merged entries get dropped
        namespace = "busy" if rng.random() < 0.8 else f"rare{rng.randrange(20)}"
        channel.submit_metrics({"c": Count("c", 1)}, step=i, namespace=namespace)
        if i % 97 == 0:
            channel.step()
    channel.step()
    health = channel.health()
    logged = sum(v for call, _ in logger.calls for k, v in call.items() if k.endswith("/c"))
    assert health["dropped"] > 0 and health["coalesced"] > 0
    assert logged + health["dropped"] == health["submitted"] == 5000
    assert_balanced(health)
    channel.close()


def test_flush_and_close_return_false_when_payloads_were_dropped_since_the_last_check():
    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=1)
    for i in range(10):  # each namespace drops the previous one's entry
        channel.submit_metrics({"x": float(i)}, step=i, namespace=f"ns{i}")
    assert channel.flush(timeout=10) is False
    assert logger.calls == [({"ns9/x": 9.0}, 9)]
    assert channel.health()["dropped"] == 9
    channel.submit_metrics({"x": 10.0}, step=10, namespace="ns10")
    assert channel.flush(timeout=10)  # nothing lost since the previous flush
    channel.submit_metrics({"x": 11.0}, namespace="a")
    channel.submit_metrics({"x": 12.0}, namespace="b")  # drops "a"
    assert channel.close(timeout=10) is False
    assert_balanced(channel.health())


def test_a_failing_merge_keeps_the_newest_value_and_is_reported(warnings_seen):
    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=1)
    channel.submit_metrics({"r": BadMergePartial("r", [1.0])}, namespace="a")
    channel.submit_metrics({"r": BadMergePartial("r", [2.0])}, namespace="a")
    channel.step()
    assert logger.calls == [({"a/r_count": 1.0, "a/r_sum": 2.0}, None)]
    assert len(warnings_seen) == 1 and "could not merge" in warnings_seen[0]
    channel.close()


@pytest.mark.timeout(30)
def test_the_queue_stays_bounded_under_a_flood_with_a_hung_logger(gate):
    logger = RecordingLogger(gate=gate)
    channel = MetricsChannel(logger, capacity=64, health_interval=None)
    namespaces = [f"ns{i}" for i in range(200)]
    for i in range(20_000):
        channel.submit_metrics({"v": float(i)}, step=i, namespace=namespaces[i % 200])
        if i % 1000 == 0:
            assert channel.health()["pending"] <= 64 + 1  # + the entry being logged
    health = channel.health()
    assert health["submitted"] == 20_000
    assert health["pending"] <= 65
    assert health["dropped"] + health["coalesced"] >= 20_000 - 65
    assert health["dropped"] > 0
    assert_balanced(health)
    gate.set()
    assert channel.close(timeout=10) is False  # processed, but payloads were dropped
    assert_balanced(channel.health())


def test_coalescing_with_the_reducers_partials_equals_the_union():
    reducers = pytest.importorskip("rl_observers.stats")
    stats = ("count", "mean", "std", "min", "max")
    batches = [[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [-1.0]]
    union = [v for batch in batches for v in batch]
    expected = reducers.Moments.from_values("reward", union, stats=stats).finalize()

    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=1)
    for i, batch in enumerate(batches):
        channel.submit_metrics(
            {
                "reward": reducers.Moments.from_values("reward", batch, stats=stats),
                "dones": reducers.Count("dones", 1),
                "frames": 100 * (i + 1),
            },
            step=i,
            namespace="collector",
        )
    assert channel.health()["coalesced"] == 3
    channel.step()
    ((logged, step),) = logger.calls
    assert step == 3
    assert logged == {
        **{f"collector/{k}": pytest.approx(v) for k, v in expected.items()},
        "collector/dones": 4.0,
        "collector/frames": 400,
    }
    channel.close()


# ---------------------------------------------------------------------------
# the owner's thread: real logger, slow, hung, raising, flaky
# ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_csv_logger_receives_everything_after_flush(tmp_path):
    logger = CSVLogger(exp_name="exp", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, log_health=True)
    for i in range(5):
        channel.submit_metrics({"loss": 1.0 / (i + 1), "lr": 0.1}, step=i, namespace="train")
    channel.submit_metrics({"write_count": 42}, step=42, namespace="rb")
    assert channel.flush(timeout=10)
    scalars = tmp_path / "exp" / "scalars"
    assert read_csv(scalars / "train" / "loss.csv") == [(i, 1.0 / (i + 1)) for i in range(5)]
    assert read_csv(scalars / "rb" / "write_count.csv") == [(42, 42.0)]
    assert channel.close(timeout=10)
    # the channel never shuts the logger down
    logger.log_scalar("after_close", 1.0, step=0)
    assert read_csv(scalars / "after_close.csv") == [(0, 1.0)]
    # health was logged under the channel's namespace at close
    assert (scalars / "channel" / "logged.csv").exists()


@pytest.mark.timeout(30)
def test_a_slow_logger_does_not_slow_submit_down():
    gate = threading.Event()
    logger = RecordingLogger(gate=gate)
    channel = MetricsChannel(logger, health_interval=None)
    for i in range(200):
        channel.submit_metrics({"x": float(i)}, step=i, namespace="a")
    # every submit returned while the logger's first call is still blocked
    assert logger.calls == [] and not gate.is_set()
    assert channel.health()["submitted"] == 200
    assert not channel.flush(timeout=0.05)
    gate.set()
    channel.close(timeout=0)  # leave it draining in the background


@pytest.mark.timeout(30)
def test_steady_traffic_is_gathered_not_woken_per_entry_and_nothing_is_lost():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    delivery = channel._state.delivery
    wakes = []
    set_wake = delivery._wake.set
    delivery._wake.set = lambda: (wakes.append(1), set_wake())[1]
    for i in range(40):
        channel.submit_metrics({"x": float(i)}, step=i, namespace="a")
        time.sleep(0.002)
    submit_wakes = len(wakes)
    assert channel.flush(timeout=10)
    # a window every 2 ms: the thread gathers them instead of being woken per entry
    assert submit_wakes <= 10, submit_wakes
    assert logger.calls == [({"a/x": float(i)}, i) for i in range(40)]
    health = channel.health()
    assert health["logged"] == health["submitted"] == 40 and health["pending"] == 0
    # a backlog of a quarter of the capacity wakes a gathering thread at once
    assert delivery._backlog == channel.capacity // 4
    assert channel.close(timeout=10)


@pytest.mark.timeout(30)
def test_a_hung_logger_bounds_flush_and_close_by_their_timeouts(gate):
    logger = RecordingLogger(gate=gate)
    channel = MetricsChannel(logger, capacity=16, name="hung")
    for i in range(1000):
        channel.submit_metrics({"x": float(i)}, step=i)
    start = time.monotonic()
    assert channel.flush(timeout=0.2) is False
    assert time.monotonic() - start < 2.0
    start = time.monotonic()
    assert channel.close(timeout=0.2) is False
    assert time.monotonic() - start < 2.0
    assert channel.closed
    assert channel.close(timeout=0.1) is False  # idempotent, still bounded
    channel.submit_metrics({"late": 1.0})  # no exception: dropped and counted
    health = channel.health()
    assert health["submitted"] == 1001
    assert_balanced(health)
    # when the logger comes back, the left-behind thread finishes the job and exits
    gate.set()
    assert wait_for(
        lambda: not any(t.name == "MetricsChannel[hung]" for t in threading.enumerate()), timeout=10
    )
    health = channel.health()
    assert health["pending"] == 0 and health["logged"] >= 1
    assert_balanced(health)
    assert logger.calls[-1][0].keys() >= {"hung/dropped", "hung/coalesced"}  # final health


def test_warn_once_per_failure_streak_and_resume_on_recovery(warnings_seen):
    logger = RecordingLogger()
    channel = sync_channel(logger, name="flaky")
    logger.broken = True
    for i in range(3):
        channel.submit_metrics({"x": float(i)}, step=i, namespace="a")
    channel.step()
    assert channel.health()["sink_errors"] == 3
    assert len(warnings_seen) == 1
    assert "'flaky'" in warnings_seen[0] and "sink failure" in warnings_seen[0]
    logger.broken = False
    channel.submit_metrics({"x": 10.0}, step=10, namespace="a")
    channel.step()
    assert logger.calls == [({"a/x": 10.0}, 10)]
    logger.broken = True
    channel.submit_metrics({"x": 11.0}, step=11, namespace="a")
    channel.step()
    assert len(warnings_seen) == 2  # a new streak warns again
    health = channel.health()
    assert health["sink_errors"] == 4 and health["logged"] == 1
    assert_balanced(health)
    channel.close()


@pytest.mark.timeout(30)
def test_raise_policy_surfaces_the_error_from_flush_then_close(warnings_seen):
    logger = RecordingLogger()
    channel = MetricsChannel(logger, on_error="raise", health_interval=None)
    logger.broken = True
    channel.submit_metrics({"x": 1.0})
    with pytest.raises(RuntimeError, match="sink failure on call #1"):
        channel.flush(timeout=10)
    assert channel.flush(timeout=10)  # raised once
    logger.broken = False
    channel.submit_metrics({"x": 2.0})
    assert channel.flush(timeout=10)
    assert logger.calls == [({"x": 2.0}, None)]
    logger.broken = True
    channel.submit_metrics({"x": 3.0})
    with pytest.raises(RuntimeError, match="sink failure"):
        channel.close(timeout=10)
    assert warnings_seen == []
    assert channel.health()["sink_errors"] == 2


def test_raise_policy_in_sync_mode_raises_from_step():
    logger = RecordingLogger()
    channel = sync_channel(logger, on_error="raise")
    logger.broken = True
    channel.submit_metrics({"x": 1.0})
    channel.submit_metrics({"x": 2.0}, namespace="b")
    with pytest.raises(RuntimeError, match="sink failure on call #1"):
        channel.step()
    assert channel.health()["sink_errors"] == 2  # the step went through all entries
    channel.close()


def test_ignore_policy_only_counts(warnings_seen):
    logger = RecordingLogger()
    channel = sync_channel(logger, on_error="ignore")
    logger.broken = True
    channel.submit_metrics({"x": 1.0})
    assert channel.step() == 1
    assert not channel.close()  # the sink failed: close says so, even when told to ignore it
    assert warnings_seen == []
    assert channel.health()["sink_errors"] == 1


def test_close_is_idempotent_never_shuts_the_logger_down_and_drops_late_submits():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    channel.submit_metrics({"x": 1.0})
    assert channel.close(timeout=10)
    assert channel.close(timeout=10)
    assert logger.calls == [({"x": 1.0}, None)]
    assert logger.shutdown_calls == 0
    channel.submit_metrics({"x": 2.0})
    health = channel.health()
    assert health["dropped"] == 1 and health["logged"] == 1
    assert_balanced(health)
    assert channel.close(timeout=10) is False  # the late payload was lost since
    with pytest.raises(RuntimeError, match="closed"):
        channel.handle()


def test_step_is_for_channels_without_a_thread():
    channel = MetricsChannel(RecordingLogger())
    with pytest.raises(RuntimeError, match="background=False"):
        channel.step()
    channel.close(timeout=10)


def test_context_manager_closes():
    logger = RecordingLogger()
    with MetricsChannel(logger, health_interval=None) as channel:
        channel.submit_metrics({"x": 1.0})
    assert channel.closed
    assert logger.calls == [({"x": 1.0}, None)]


# ---------------------------------------------------------------------------
# health
# ---------------------------------------------------------------------------


def test_health_is_logged_when_it_changed_and_at_close():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, background=False, health_interval=0.0, log_health=True)
    channel.step()
    assert logger.calls == []  # nothing changed yet
    channel.submit_metrics({"x": 1.0}, namespace="a")
    channel.step()
    assert logger.user_calls() == [({"a/x": 1.0}, None)]
    ((health, step),) = logger.health_calls()
    assert step == 0
    assert health == {
        "channel/submitted": 1,
        "channel/logged": 1,
        "channel/pending": 0,
        "channel/coalesced": 0,
        "channel/dropped": 0,
        "channel/sink_errors": 0,
        "channel/copies_lost": 0,
    }
    channel.step()
    assert len(logger.health_calls()) == 1  # unchanged: not logged again
    channel.close()
    assert [s for _, s in logger.health_calls()] == [0, 1]  # once more at close


def test_health_reports_are_rate_limited():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, background=False, health_interval=3600.0, name="ch", log_health=True)
    for i in range(3):
        channel.submit_metrics({"x": float(i)})
        channel.step()
    assert not any(k.startswith("ch/") for m, _ in logger.calls for k in m)
    channel.close()
    assert logger.calls[-1] == (
        {
            "ch/submitted": 3,
            "ch/logged": 3,
            "ch/pending": 0,
            "ch/coalesced": 0,
            "ch/dropped": 0,
            "ch/sink_errors": 0,
            "ch/copies_lost": 0,
        },
        0,
    )


@pytest.mark.timeout(30)
def test_background_health_reports_come_from_the_thread():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=0.05, log_health=True)
    channel.submit_metrics({"x": 1.0})
    assert wait_for(
        lambda: logger.health_calls() and logger.health_calls()[-1][0]["channel/logged"] == 1, timeout=10
    )
    channel.close(timeout=10)


# ---------------------------------------------------------------------------
# sharing and lifetime
# ---------------------------------------------------------------------------


def test_for_logger_shares_one_channel_per_logger():
    logger, other = RecordingLogger(), RecordingLogger()
    channel = MetricsChannel.for_logger(logger, background=False)
    assert MetricsChannel.for_logger(logger) is channel
    assert MetricsChannel.for_logger(other, background=False) is not channel
    channel.close()
    fresh = MetricsChannel.for_logger(logger, background=False)
    assert fresh is not channel
    ref = __import__("weakref").ref(fresh)
    del fresh
    gc.collect()
    assert ref() is None  # the registry does not keep a channel alive
    assert MetricsChannel.for_logger(logger, background=False) is not None


@pytest.mark.timeout(30)
@pytest.mark.timeout(30)
def test_an_unreferenced_channel_delivers_what_is_pending_and_stops_its_threads():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, name="orphan", health_interval=None)
    remote = socket_handle(channel)  # what another process holds: no reference
    path = remote.address
    channel.submit_metrics({"x": 1.0})
    del channel
    gc.collect()
    assert wait_for(
        lambda: not any(t.name.startswith("MetricsChannel[orphan]") for t in threading.enumerate()), timeout=10
    )
    assert logger.calls == [({"x": 1.0}, None)]
    assert not os.path.exists(path)
    remote.submit_metrics({"x": 2.0})  # the owner is gone: dropped, no exception
    assert remote.dropped == 1


@pytest.mark.timeout(30)
def test_a_local_handle_keeps_its_channel_alive_without_owning_it():
    logger = RecordingLogger()
    handle = MetricsChannel.for_logger(logger, health_interval=None).handle()
    gc.collect()
    shared = MetricsChannel.for_logger(logger)  # still the same, kept alive by the handle
    handle.submit_metrics({"x": 1.0})
    assert handle.flush(timeout=10)
    assert logger.calls == [({"x": 1.0}, None)]
    assert shared.health()["logged"] == 1
    assert not shared.closed
    assert shared.close(timeout=10)


def test_close_callbacks_submit_their_last_window_before_the_final_flush(warnings_seen):
    logger = RecordingLogger()
    channel = sync_channel(logger)

    class Producer:
        def __init__(self, value):
            self.value = value

        def close_window(self):
            channel.submit_metrics({"last": self.value}, namespace="p")

    kept, dropped = Producer(1.0), Producer(2.0)
    channel._logging.add_close_callback(kept.close_window)
    channel._logging.add_close_callback(dropped.close_window)  # bound methods are held weakly
    del dropped
    gc.collect()

    def broken():
        raise ValueError("callback failure")

    channel._logging.add_close_callback(broken)
    channel._logging.add_close_callback(lambda: channel.submit_metrics({"other": 3.0}))
    assert not channel.close()  # a close callback failed: close says so
    assert logger.calls == [({"p/last": 1.0}, None), ({"other": 3.0}, None)]
    failures = [m for m in warnings_seen if "returns False" not in m]
    assert len(failures) == 1 and "callback failure" in failures[0]
    assert [m for m in warnings_seen if "close() returns False" in m]  # said, not only returned
    assert channel.close()  # callbacks run once; nothing failed since


_EXIT_SCRIPT = """
import sys, threading, time
from torchrl.record import CSVLogger
import rl_observers.channel.channel
from rl_observers.remote import MetricsChannel

rl_observers.channel.channel._EXIT_TIMEOUT = 2.0

class SlowCSV(CSVLogger):
    def log_metrics(self, metrics, step=None, **kwargs):
        time.sleep(0.05)
        return super().log_metrics(metrics, step=step, **kwargs)

logger = SlowCSV(exp_name="exit", log_dir=sys.argv[1])
channel = MetricsChannel(logger)
channel.handle()
channel._logging.add_close_callback(lambda: channel.submit_metrics({"last": 9.0}, step=9))
for i in range(3):
    channel.submit_metrics({"x": float(i)}, step=i)
print(channel.handle(transport="socket").address)

class Hung:
    def log_metrics(self, metrics, step=None):
        threading.Event().wait()

stuck = MetricsChannel(Hung(), background=False)
stuck.submit_metrics({"never": 1.0})
# no close(): the interpreter's exit closes both channels, within _EXIT_TIMEOUT
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_live_channels_deliver_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 30  # the hung logger did not hold the exit
    scalars = tmp_path / "exit" / "scalars"
    assert read_csv(scalars / "x.csv") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert read_csv(scalars / "last.csv") == [(9, 9.0)]
    assert not os.path.exists(done.stdout.strip())  # the socket file is gone too


# ---------------------------------------------------------------------------
# real logger backends
# ---------------------------------------------------------------------------


def _submit_losses(channel: MetricsChannel) -> None:
    for i in range(3):
        channel.submit_metrics(
            {"loss": 1.0 / (i + 1), "r": ListPartial("reward", [float(i), 1.0])},
            step=10 * i,
            namespace="train",
        )


_EXPECTED_LOSS = [(0, 1.0), (10, 0.5), (20, 1.0 / 3)]


@pytest.mark.timeout(60)
def test_tensorboard_logger(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torchrl.record.loggers.tensorboard import TensorboardLogger

    logger = TensorboardLogger(exp_name="tb", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, log_health=True)
    _submit_losses(channel)
    assert channel.close(timeout=30)
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(s, pytest.approx(v)) for s, v in _EXPECTED_LOSS]
    assert [e.value for e in events.Scalars("train/reward_sum")] == [1.0, 2.0, 3.0]
    assert "channel/logged" in events.Tags()["scalars"]
    logger.experiment.close()


def _wandb_history(run_file: str) -> list[dict[str, Any]]:
    """History rows of an offline W&B run file (LevelDB-log framing, protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    rows, pos, chunk = [], 7, b""  # 7-byte ":W&B" header
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_wandb_logger_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from torchrl.record.loggers.wandb import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(
        exp_name="wb",
        offline=True,
        save_dir=str(tmp_path),
        project="channel",
        log_env_packages=False,
    )
    channel = MetricsChannel(logger)
    _submit_losses(channel)
    assert channel.close(timeout=30)
    logger.experiment.finish()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    # the run file is written by wandb's own service process, possibly after finish()
    assert wait_for(lambda: any("train/loss" in row for row in _wandb_history(run_file)), timeout=10)
    rows = [row for row in _wandb_history(run_file) if "train/loss" in row]
    assert [(row["train/step"], row["train/loss"]) for row in rows] == [
        (s, pytest.approx(v)) for s, v in _EXPECTED_LOSS
    ]
    assert [row["train/reward_count"] for row in rows] == [2.0, 2.0, 2.0]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_mlflow_logger_sqlite(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from torchrl.record.loggers.mlflow import MLFlowLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(exp_name="channel", tracking_uri=uri)
    try:
        channel = MetricsChannel(logger, log_health=True)
        _submit_losses(channel)
        assert channel.close(timeout=30)
        client = MlflowClient(uri)
        run_id = logger.experiment.info.run_id
        loss = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
        assert sorted(loss) == [(s, pytest.approx(v)) for s, v in _EXPECTED_LOSS]
        assert client.get_metric_history(run_id, "channel/logged")
    finally:
        mlflow.end_run()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_trackio_logger_local(tmp_path, monkeypatch):
    pytest.importorskip("trackio")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path))
    import trackio
    import trackio.sqlite_storage
    import trackio.utils
    from torchrl.record.loggers.trackio import TrackioLogger

    for module in (trackio, trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path, raising=False)
    logger = TrackioLogger("run", "channel", auto_log_cpu=False, auto_log_gpu=False)
    channel = MetricsChannel(logger)
    _submit_losses(channel)
    assert channel.close(timeout=30)
    logger.experiment.finish()
    logs = trackio.sqlite_storage.SQLiteStorage.get_logs("channel", "run")
    loss = [(row["step"], row["train/loss"]) for row in logs if "train/loss" in row]
    assert loss == [(s, pytest.approx(v)) for s, v in _EXPECTED_LOSS]
    assert list(tmp_path.glob("channel*.db"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_process_logger_service(tmp_path):
    logger = CSVLogger(exp_name="svc", log_dir=str(tmp_path), service_backend="process")
    try:
        channel = MetricsChannel(logger.client())
        _submit_losses(channel)
        assert channel.close(timeout=60)
        logger.flush(timeout=30)
        loss = read_csv(tmp_path / "svc" / "scalars" / "train" / "loss.csv")
        assert loss == [(s, pytest.approx(v)) for s, v in _EXPECTED_LOSS]
        assert logger.is_alive  # the channel did not stop the service
    finally:
        logger.shutdown(timeout=30)


_RAY_TASK = """
def send(handle):
    for i in range(3):
        handle.submit_metrics({"x": float(i)}, step=i, namespace="ray_task")
    return handle.flush(timeout=10)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_logger_service_and_a_handle_in_a_ray_worker(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        logger = CSVLogger(exp_name="ray", log_dir=str(tmp_path), service_backend="ray")
        channel = MetricsChannel(logger.client())
        _submit_losses(channel)
        # a function from a module Ray workers cannot import is shipped by value
        namespace: dict[str, Any] = {"__name__": "channel_test_ray_task"}
        exec(_RAY_TASK, namespace)
        assert ray.get(ray.remote(namespace["send"]).remote(channel.handle()), timeout=120)
        assert channel.close(timeout=60)
        logger.flush(timeout=30)
        scalars = tmp_path / "ray" / "scalars"
        loss = read_csv(scalars / "train" / "loss.csv")
        assert loss == [(s, pytest.approx(v)) for s, v in _EXPECTED_LOSS]
        assert read_csv(scalars / "ray_task" / "x.csv") == [(i, float(i)) for i in range(3)]
        logger.shutdown(timeout=30)
    finally:
        ray.shutdown()


def test_a_channel_without_ray_starts_no_ray_receiver():
    """An owner not connected to Ray: handles carry the socket only, and Ray stays uninitialized."""
    import sys

    logger = RecordingLogger()
    channel = MetricsChannel(logger, background=False)
    handle = pickle.loads(pickle.dumps(channel.handle()))
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    assert set(handle._addresses) == {"socket"}
    assert ray is None or not ray.is_initialized()
    forced = channel.handle(transport="ray")  # cannot reach: says so once, counts
    forced.submit_metrics({"x": 1.0})
    forced.submit_metrics({"x": 2.0})
    assert (forced.transport, forced.dropped) == ("unreachable", 2)
    channel.close()
