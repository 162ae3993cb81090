"""Bad input: odd metric values and names, bad schedules and capacities, dead loggers.

Each gets a clear, early error where it is given, or a documented handling;
never a crash in the channel's thread or in a worker.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.record import CSVLogger

from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)
from rl_observers.remote import MetricsHandle
from tests.helpers import RecordingLogger, assert_balanced, read_csv, socket_handle, sync_channel

# -- metric values ---------------------------------------------------------------------------------

BAD_VALUES = {
    "string": ("0.5", ""),
    "nested dict": ({"inner": 1.0}, "Flatten nested metrics into names such as 'x/<name>'"),
    "multi-element tensor": (torch.ones(3), "Reduce it to one number first"),
    "multi-element array": (np.ones(2), "Reduce it to one number first"),
    "None": (None, ""),
    "list": ([1.0], ""),
    "complex": (1 + 2j, ""),
}


@pytest.mark.parametrize("kind", list(BAD_VALUES))
@pytest.mark.parametrize("where", ["channel", "remote handle"])
def test_values_that_cannot_be_logged_are_refused_at_submit(kind, where):
    value, hint = BAD_VALUES[kind]
    logger = RecordingLogger()
    channel = sync_channel(logger)
    target = channel if where == "channel" else socket_handle(channel)
    with pytest.raises(TypeError, match="expected metric values that are real numbers") as raised:
        target.submit_metrics({"ok": 1.0, "x": value})
    assert "for 'x'" in str(raised.value) and hint in str(raised.value)
    channel.step()
    assert channel.health()["submitted"] == 0 and logger.calls == []
    channel.close()


def test_numbers_nan_inf_and_one_element_tensors_are_logged_as_they_are(tmp_path):
    logger = CSVLogger(exp_name="values", log_dir=str(tmp_path))
    channel = sync_channel(logger)
    values = {
        "nan": float("nan"),
        "inf": float("inf"),
        "neg_inf": -float("inf"),
        "tensor": torch.tensor(2.5),
        "tensor_1": torch.tensor([3.5]),
        "numpy": np.float32(1.5),
        "array": np.array(4.0),
        "bool": True,
        "int": 7,
    }
    channel.submit_metrics(values, step=3, namespace="v")
    assert channel.step() == 1
    assert channel.health()["sink_errors"] == 0
    scalars = tmp_path / "values" / "scalars" / "v"
    logged = {name: read_csv(scalars / f"{name}.csv") for name in values}
    assert math.isnan(logged.pop("nan")[0][1])
    assert logged == {
        "inf": [(3, math.inf)],
        "neg_inf": [(3, -math.inf)],
        "tensor": [(3, 2.5)],
        "tensor_1": [(3, 3.5)],
        "numpy": [(3, 1.5)],
        "array": [(3, 4.0)],
        "bool": [(3, 1.0)],
        "int": [(3, 7.0)],
    }
    channel.close()


def test_nan_in_the_data_reaches_the_logger_as_nan():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
    rb.add_observer(LoggerObserver(channel, metrics=WriteMetrics(reward_key="reward"), name="rb", schedule=None))
    rb.extend(TensorDict({"reward": torch.tensor([1.0, float("nan")])}, [2]))
    channel.step()
    ((_, mean),) = logger.series("rb/reward_mean")
    assert math.isnan(mean)
    assert logger.series("rb/items_written") == [(2, 2.0)]


def test_an_empty_payload_is_ignored():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    channel.submit_metrics({})
    channel.submit_metrics({}, step=3, namespace="a")
    assert channel.step() == 0
    assert logger.calls == [] and channel.health()["submitted"] == 0
    channel.close()


# -- metric names ----------------------------------------------------------------------------------

ODD_NAMES = ["a b", "ünïcödé", "x/y/z", ".hidden", "sp?*:<>|"]


def test_odd_names_reach_the_logger_unchanged(tmp_path):
    logger = CSVLogger(exp_name="names", log_dir=str(tmp_path))
    channel = sync_channel(logger)
    channel.submit_metrics({name: float(i) for i, name in enumerate(ODD_NAMES)}, step=1, namespace="odd")
    channel.step()
    scalars = tmp_path / "names" / "scalars" / "odd"
    for i, name in enumerate(ODD_NAMES):
        assert read_csv(scalars / f"{name}.csv") == [(1, float(i))]
    channel.close()


def test_a_name_the_logger_cannot_store_is_a_counted_sink_error_and_the_channel_goes_on(tmp_path, told):
    logger = CSVLogger(exp_name="long", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, name="long", health_interval=None)
    channel.submit_metrics({"x" * 1000: 1.0}, step=1, namespace="a")  # too long for a file name
    channel.submit_metrics({"y": 2.0}, step=2, namespace="b")
    assert channel.flush(timeout=10) is False  # everything was processed, but one entry failed
    health = channel.health()
    assert health["sink_errors"] == 1 and health["logged"] == 1
    assert_balanced(health)
    assert read_csv(tmp_path / "long" / "scalars" / "b" / "y.csv") == [(2, 2.0)]
    message, returned = [m for m in told if "MetricsChannel 'long'" in m]
    assert "File name too long" in message or "name too long" in message.lower()
    assert "flush() returns False" in returned and "failed (sink_errors) 1" in returned
    assert channel.close(timeout=10)


class FinalizeFails:
    """A partial that merges but cannot finalize."""

    def merge(self, other):
        return self

    def finalize(self):
        raise ValueError("cannot finalize")


@pytest.mark.timeout(30)
def test_a_partial_that_cannot_finalize_does_not_stop_the_channel_thread(told):
    logger = RecordingLogger()
    channel = MetricsChannel(logger, name="partials", health_interval=None)
    channel.submit_metrics({"p": FinalizeFails()}, namespace="a")
    channel.submit_metrics({"x": 1.0}, namespace="b")
    assert channel.flush(timeout=10) is False  # processed, but one entry failed
    assert logger.calls == [({"b/x": 1.0}, None)]
    assert channel.health()["sink_errors"] == 1
    assert any("cannot finalize" in m for m in told)
    assert any(t.name == "MetricsChannel[partials]" for t in threading.enumerate())
    assert channel.close(timeout=10)


def test_metric_sets_refuse_keys_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"reward_key must be a str, a non-empty tuple of str or None, got 5"):
        CollectorBatchMetrics(reward_key=5)
    with pytest.raises(TypeError, match=r"done_key .* got \(\)"):
        CollectorBatchMetrics(done_key=())
    with pytest.raises(TypeError, match=r"reward_key .* got \['next', 'reward'\]"):
        WriteMetrics(reward_key=["next", "reward"])
    with pytest.raises(TypeError, match=r"reward_key .* got \('next', 1\)"):
        WriteMetrics(reward_key=("next", 1))
    with pytest.raises(TypeError, match="age must be a bool, got 'yes'"):
        SampleMetrics(age="yes")


# -- schedules, capacities, loggers ----------------------------------------------------------------


@pytest.mark.parametrize("interval", [0, -1, -0.5])
def test_every_refuses_zero_or_negative_intervals_before_the_observer_exists(interval):
    with pytest.raises(ValueError, match="interval must be strictly positive"):
        LoggerObserver(RecordingLogger(), schedule=Every.counter("write_count", interval))
    with pytest.raises(ValueError, match="interval must be strictly positive"):
        LoggerObserver(RecordingLogger(), schedule=Every.seconds(interval))


def test_a_nan_interval_is_refused_and_an_infinite_one_only_logs_on_close():
    logger = RecordingLogger()
    for schedule in (Every.counter("write_count", float("nan")), Every.seconds(float("nan"))):
        with pytest.raises(ValueError, match="schedule interval must be a number > 0, got Every"):
            LoggerObserver(logger, schedule=schedule)
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    with pytest.raises(ValueError, match="schedule interval must be a number > 0"):
        rb.attach_logger(logger, schedule=Every.counter("write_count", float("nan")))
    assert rb.observers == ()
    channel = sync_channel(logger)
    handle = rb.add_observer(
        LoggerObserver(channel, schedule=Every.counter("write_count", float("inf")), metrics=WriteMetrics(), name="rb")
    )
    for _ in range(5):
        rb.extend(torch.arange(10))
    channel.step()
    assert logger.series("rb/items_written") == []
    handle.remove()  # log_on_close
    channel.step()
    assert logger.series("rb/items_written") == [(50, 50.0)]


@pytest.mark.parametrize("capacity", [0, -3])
def test_a_channel_without_room_is_refused(capacity):
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        MetricsChannel(RecordingLogger(), capacity=capacity)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        MetricsChannel.for_logger(RecordingLogger(), capacity=capacity)


def test_a_logger_already_shut_down_is_refused_at_once(tmp_path):
    logger = CSVLogger(exp_name="dead", log_dir=str(tmp_path))
    logger.shutdown()
    with pytest.raises(ValueError, match="running logger, got a CSVLogger that is shut down"):
        MetricsChannel(logger)
    with pytest.raises(ValueError, match="shut down"):
        LoggerObserver(logger, schedule=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(ValueError, match="shut down"):
        rb.attach_logger(logger, schedule=None)
    assert rb.observers == () and type(rb) is ReplayBuffer
    # a channel made while the logger ran is not affected by the check
    alive = CSVLogger(exp_name="alive", log_dir=str(tmp_path))
    channel = MetricsChannel.for_logger(alive, background=False)
    alive.shutdown()
    with pytest.raises(ValueError, match="shut down"):
        MetricsChannel.for_logger(alive)
    channel.close()


# -- bad input inside a worker ---------------------------------------------------------------------


class SubmitsBadValues:
    """Runs in the workers: a bad payload (refused there) and a good one (delivered)."""

    def __init__(self, handle: MetricsHandle) -> None:
        self.handle = handle
        self.frames = 0

    def on_post_collect(self, source, batch):
        self.frames += batch.numel()
        self.handle.submit_metrics({"frames": self.frames}, step=self.frames, namespace=f"w{os.getpid()}")
        self.handle.submit_metrics({"bad": "not a number"}, namespace="bad")


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bad_input_inside_workers_is_handled_there_and_the_workers_go_on():
    from torchrl.collectors import MultiSyncCollector

    from tests.helpers import make_multi

    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=100)
    try:
        collector.add_observer(SubmitsBadValues(channel.handle()))  # on_error="warn" in the workers
        assert sum(batch.numel() for batch in collector) == 100
    finally:
        collector.shutdown()
    assert channel.flush(timeout=30)
    namespaces = {name.split("/")[0] for metrics, _ in logger.calls for name in metrics}
    assert len(namespaces) == 2 and "bad" not in namespaces  # both workers' good metrics, only
    assert sorted(v for m, _ in logger.calls for k, v in m.items())[-2:] == [50, 50]
    assert channel.close(timeout=10)
