"""Lifecycle orders: things closed, shut down, removed, added or collected at awkward moments."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import time
import weakref

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from rl_observers import Every, LoggerObserver, MetricsChannel, WriteMetrics
from rl_observers.channel.payload import Payload
from rl_observers.remote.ray import RaySender
from rl_observers.testing import EventRecorder
from tests.faults.conftest import BATCHES, assert_same_data, run_loop
from tests.helpers import RecordingLogger, assert_balanced, make_collector, read_csv, wait_for


@pytest.mark.timeout(60)
def test_closing_the_channel_while_sources_run_drops_and_counts(reference, told):
    logger = RecordingLogger()
    channel = MetricsChannel(logger, name="early", health_interval=None)

    class ClosesTheChannelAtBatch3:
        batches = 0
        closed: bool | None = None  # what close() returned, checked by the test, not in the observer

        def on_post_collect(self, source, batch):
            self.batches += 1
            if self.batches == 3:
                self.closed = channel.close(timeout=10)

    closer = ClosesTheChannelAtBatch3()

    def attach(collector, rb):
        collector.add_observer(LoggerObserver(channel, schedule=None))
        collector.add_observer(closer, on_error="raise")  # a failure here fails the test
        rb.add_observer(LoggerObserver(channel, schedule=None))

    assert_same_data(reference, run_loop(attach))  # no exception reached the loop
    assert closer.closed is True
    health = channel.health()
    assert health["dropped"] == (BATCHES - 3) + 2 * (BATCHES - 2)  # collector and buffer windows
    assert_balanced(health)
    assert [s for s, _ in logger.series("collector/frames")] == [16, 32, 48]
    closed = [m for m in told if "is closed" in m]
    assert len(closed) == 1 and "'early'" in closed[0] and "dropped" in closed[0]


@pytest.mark.timeout(60)
def test_shutting_a_source_down_while_its_observers_and_the_channel_run():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    rbs = [ReplayBuffer(storage=LazyTensorStorage(100)) for _ in range(2)]
    observers = [
        LoggerObserver(channel, schedule=Every.counter("write_count", 1000), metrics=WriteMetrics(), name=f"rb{i}")
        for i in range(2)
    ]
    for rb, observer in zip(rbs, observers):
        rb.add_observer(observer)
        rb.extend(torch.arange(5))
    rbs[0].shutdown()  # its last window is logged; the channel goes on
    assert channel.flush(timeout=10)
    assert logger.series("rb0/items_written") == [(5, 5.0)]
    rbs[1].extend(torch.arange(5))
    rbs[0].remove_observer(observers[0])  # after shutdown: nothing left to log, no error
    assert rbs[0].observers == ()
    assert not channel.closed
    assert channel.close(timeout=10)
    assert logger.series("rb0/items_written") == [(5, 5.0)]
    assert logger.series("rb1/items_written") == [(10, 10.0)]


class RemovesItself(EventRecorder):
    def on_post_extend(self, source, data, index):
        super().on_post_extend(source, data, index)
        source.remove_observer(self)


def test_an_observer_removing_itself_during_its_own_event():
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    leaving, staying = RemovesItself(), EventRecorder()
    rb.add_observer(leaving)
    rb.add_observer(staying)
    index = rb.extend(torch.arange(4))
    assert index.tolist() == [0, 1, 2, 3]
    rb.extend(torch.arange(4))
    assert leaving.events == ["post_extend"]
    assert staying.events == ["post_extend", "post_extend"]  # the walk went on after the removal
    assert rb.observers == (staying,)
    # alone, it leaves a plain torchrl buffer behind, from inside the observed call
    alone = ReplayBuffer(storage=LazyTensorStorage(100))
    alone.add_observer(RemovesItself())
    assert alone.extend(torch.arange(3)).tolist() == [0, 1, 2]
    assert type(alone) is ReplayBuffer and alone.observers == ()
    assert alone.extend(torch.arange(3)).tolist() == [3, 4, 5]


@pytest.mark.timeout(60)
def test_a_plain_callable_removing_itself_mid_collection():
    collector = make_collector()
    seen = []

    def once(batch):
        seen.append(batch.numel())
        collector.remove_observer(once)

    collector.add_observer(once)
    try:
        assert sum(batch.numel() for batch in collector) == 96
    finally:
        collector.shutdown()
    assert seen == [16] and collector.observers == ()


def test_an_observer_removed_by_another_still_gets_the_event_in_flight():
    """An event in flight finishes over the observers it started with (a snapshot)."""
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    removed = EventRecorder()

    class RemovesTheNext:
        def on_post_extend(self, source, data, index):
            if removed in source.observers:
                source.remove_observer(removed)

    rb.add_observer(RemovesTheNext())
    rb.add_observer(removed)
    rb.extend(torch.arange(2))
    rb.extend(torch.arange(2))
    assert removed.events == ["post_extend"]


def test_an_observer_added_during_another_observers_event_starts_with_the_next_event():
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    late = EventRecorder()

    class AddsALateObserver:
        def on_post_extend(self, source, data, index):
            if late not in source.observers:
                source.add_observer(late)

    rb.add_observer(AddsALateObserver())
    rb.extend(torch.arange(2))
    assert late.events == []  # not the event in flight
    rb.extend(torch.arange(2))
    rb.sample(2)
    assert late.events == ["post_extend", "post_sample"]


@pytest.mark.timeout(60)
def test_a_collector_garbage_collected_without_shutdown_logs_its_last_window():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    collector = make_collector()
    recorder = EventRecorder()
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 10_000)))
    collector.add_observer(recorder)
    batches = iter(collector)
    next(batches)
    next(batches)
    ref = weakref.ref(collector)
    del batches, collector
    gc.collect()
    assert ref() is None  # observers did not keep it alive
    assert recorder.events[-1] == "shutdown"  # torchrl's __del__ shut it down, observed
    assert channel.flush(timeout=10)
    assert logger.series("collector/frames") == [(32, 32.0)]
    assert channel.close(timeout=10)


_EXIT_SCRIPT = """
import sys
import torch
import rl_observers
from rl_observers import Every
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

logger = CSVLogger(exp_name="exit", log_dir=sys.argv[1])
rb = ReplayBuffer(storage=LazyTensorStorage(100))
rb.attach_logger(logger, schedule=Every.counter("write_count", 1000))
env = CountingEnv()
collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=-1)
collector.attach_logger(logger, schedule=Every.counter("frames", 10_000))
batches = iter(collector)
for _ in range(3):
    rb.extend(next(batches)["observation"])
print("pending windows, no close, no shutdown: exiting", flush=True)
"""




@pytest.mark.slow
@pytest.mark.timeout(90)
def test_interpreter_exit_delivers_pending_windows(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout
    scalars = tmp_path / "exit" / "scalars"
    assert read_csv(scalars / "replay_buffer" / "items_written.csv") == [(24, 24.0)]
    assert read_csv(scalars / "collector" / "frames.csv") == [(24, 24.0)]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_shut_down_under_an_open_channel_starts_no_new_ray_instance(told):
    # The channel's Ray ingest thread used to start a new ingest actor once Ray was gone, and a
    # Ray sender's thread to look its target up again; Ray's calls connect on their own: a new
    # local Ray instance, started from those threads.
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        logger = RecordingLogger()
        channel = MetricsChannel(logger, name="open", health_interval=None)
        # a handle's addresses start the receivers: the Ray ingest actor and its thread
        handle = pickle.loads(pickle.dumps(channel.handle()))
        assert set(handle._addresses) == {"socket", "ray"}
        rb = ReplayBuffer(storage=LazyTensorStorage(100))
        rb.add_observer(LoggerObserver(channel, name="rb", schedule=Every.counter("write_count", 1)))
        rb.extend(torch.arange(10))
        sender = RaySender(handle._addresses["ray"], interval=0.01)
        sender.send(Payload("sent", {"x": 1.0}))
        assert sender.flush(timeout=30) and sender.dropped == 0
    finally:
        ray.shutdown()
    said = lambda: [m for m in told if "'open'" in m and "Ray was shut down in this process while" in m]  # noqa: E731
    # ends as soon as it is said; a loaded machine may take seconds (a get the shutdown left
    # hanging once held the warning back for a minute)
    assert wait_for(said, 20)
    time.sleep(1.0)  # more drains of the ingest thread, were it still running
    rb.extend(torch.arange(10))
    sender.send(Payload("sent", {"x": 2.0}))  # nowhere to go: it stays buffered, counted
    assert not sender.flush(timeout=2)
    assert (sender.pending(), sender.dropped, sender.submitted) == (1, 0, 2)
    assert channel.flush(timeout=10) and channel.close(timeout=10)
    assert not ray.is_initialized()
    assert len(said()) == 1 and "close the channel (channel.close()) before ray.shutdown()" in said()[0]
    assert len([m for m in told if "cannot reach its owner" in m and "Ray was shut down" in m]) == 1
    assert channel.health()["dropped"] == 0 and logger.calls  # the local path went on
    assert not sender.close(timeout=0.1)  # its payload stays undelivered; its thread ends


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_ray_transport_s_calls_after_ray_shutdown_raise_instead_of_starting_ray():
    """The calls the Ray transport's threads make, made once Ray was shut down (as one racing
    ``ray.shutdown()`` is): each raises, and no new Ray starts (Ray's own calls would start one)."""
    from rl_observers.remote.ray.ingest import call_remote, no_start

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        channel = MetricsChannel(RecordingLogger(), name="calls", health_interval=None)
        address = pickle.loads(pickle.dumps(channel.handle()))._addresses["ray"]
        ingest = ray.get_actor(address.ingest, namespace=address.namespace)
        ref = call_remote(ingest.drain, 1, 0.0)
        assert no_start(ray.get)(ref, timeout=30)[0] == []
    finally:
        ray.shutdown()
    calls = {
        "actor call": lambda: call_remote(ingest.drain, 1, 0.0),
        "get": lambda: no_start(ray.get)(ref, timeout=0),
        "wait": lambda: no_start(ray.wait)([ref], timeout=0),
        "get_actor": lambda: no_start(ray.get_actor)(address.ingest, namespace=address.namespace),
        "kill": lambda: no_start(ray.kill)(ingest),
    }
    for name, call in calls.items():
        with pytest.raises((ray.exceptions.RayError, AttributeError)):  # not connected: no core worker
            call()
        assert not ray.is_initialized(), name
    assert channel.close(timeout=10)  # nothing was submitted: nothing is lost
    assert not ray.is_initialized()
