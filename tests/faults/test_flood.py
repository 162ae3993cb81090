"""Floods and concurrency: a million submissions into a hung sink; a buffer hammered by threads
while observers come and go."""

from __future__ import annotations

import gc
import threading
import weakref

import psutil
import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from rl_observers import LoggerObserver, MetricsChannel, Observer, WriteMetrics
from rl_observers.testing import EventRecorder
from tests.helpers import RecordingLogger, assert_balanced

SUBMITS = 1_000_000
THREADS = 8
CAPACITY = 1024


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_million_submissions_from_eight_threads_into_a_hung_sink(gate):
    logger = RecordingLogger(gate=gate)
    channel = MetricsChannel(logger, capacity=CAPACITY, name="flood", health_interval=None)
    handle = channel.handle()  # the local handle takes the same path
    errors: list[BaseException] = []
    process = psutil.Process()
    for i in range(10_000):  # warm up: queue full, allocator settled
        channel.submit_metrics({"x": float(i)}, step=i, namespace=f"warm{i % 64}")
    gc.collect()
    rss_before = process.memory_info().rss

    def flood(thread: int) -> None:
        submit = channel.submit_metrics if thread % 2 else handle.submit_metrics
        # odd threads reuse 16 namespaces (coalescing), even ones never repeat one (dropping)
        reuse = thread % 2 == 1
        try:
            for i in range(SUBMITS // THREADS):
                namespace = f"t{thread}/{i % 16}" if reuse else f"t{thread}/{i}"
                submit({"x": float(i), "n": i}, step=i, namespace=namespace)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=flood, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    growth = process.memory_info().rss - rss_before
    assert errors == []
    assert growth < 50 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB"
    health = channel.health()
    assert health["submitted"] == SUBMITS + 10_000
    assert health["pending"] <= CAPACITY + 1
    # entries the odd threads coalesced into may all have been dropped since: their
    # payloads then count as dropped, and coalesced can end at 0
    assert health["dropped"] > 0
    assert_balanced(health)
    gate.set()  # the sink comes back: what is pending is delivered, bounded
    assert channel.close(timeout=60) is False  # delivered, but payloads were dropped
    assert channel.health()["pending"] == 0
    assert_balanced(channel.health())


PER_THREAD = 1000


@pytest.mark.timeout(90)
def test_threads_writing_and_sampling_while_observers_come_and_go():
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=8)
    rb.extend(torch.arange(100))
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    steady = EventRecorder()
    steady_logger = LoggerObserver(channel, name="steady", schedule=None)
    rb.add_observer(steady)
    rb.add_observer(steady_logger)
    stop = threading.Event()
    errors: list[BaseException] = []
    churned: list[EventRecorder] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as error:  # pragma: no cover - reported below
                errors.append(error)

        return run

    @guarded
    def writer():
        for _ in range(PER_THREAD):
            rb.extend(torch.arange(5))

    @guarded
    def sampler():
        for _ in range(PER_THREAD):
            rb.sample()

    @guarded
    def churn():
        while not stop.is_set():
            recorder = EventRecorder()
            handle = rb.add_observer(recorder)
            churned.append(recorder)
            rb.sample()  # this thread's own events too
            handle.remove()

    churner = threading.Thread(target=churn)
    churner.start()
    workers = [threading.Thread(target=f) for f in (writer, writer, sampler, sampler)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    stop.set()
    churner.join()
    assert errors == []
    assert rb.observers == (steady, steady_logger)
    churn_samples = len(churned)
    # observers attached throughout saw every event exactly once
    assert steady.count("post_extend") == 2 * PER_THREAD
    assert steady.count("post_sample") == 2 * PER_THREAD + churn_samples
    assert channel.flush(timeout=30)
    # on the buffer's own axis: the 100 items written before attaching count too
    assert logger.series("steady/items_written")[-1][1] == 100 + 2 * PER_THREAD * 5
    assert logger.series("steady/sample_calls")[-1][1] == 2 * PER_THREAD + churn_samples
    # observers that came and went saw at most what happened while they were attached
    assert churn_samples > 0
    for recorder in churned:
        assert recorder.count("post_sample") >= 1  # their own sample, at least
        assert recorder.count("post_extend") <= 2 * PER_THREAD
    assert channel.close(timeout=10)


def test_logger_observers_attached_and_removed_over_and_over_leave_no_callbacks_behind():
    channel = MetricsChannel(RecordingLogger(), background=False, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    removed = []
    for _ in range(2000):
        observer = LoggerObserver(channel, metrics=WriteMetrics(), schedule=None)
        rb.add_observer(observer).remove()
        removed.append(weakref.ref(observer))
        del observer
    kept = LoggerObserver(channel, metrics=WriteMetrics(), name="kept", schedule=None)
    rb.add_observer(kept)
    gc.collect()
    assert not any(ref() for ref in removed)  # the channel's close callbacks keep none alive
    rb.extend(torch.arange(3))
    assert channel.close()
    assert channel.logger.series("kept/items_written")[-1][1] == 3


class _Held(Observer):
    """Holds a thread inside its ``post_sample`` / ``post_extend`` event until released."""

    def __init__(self) -> None:
        self.sampling, self.sample_released = threading.Event(), threading.Event()
        self.writing, self.write_released = threading.Event(), threading.Event()

    def on_post_sample(self, source, batch, info) -> None:
        self.sampling.set()
        assert self.sample_released.wait(timeout=30)

    def on_post_extend(self, source, data, index) -> None:
        self.writing.set()
        assert self.write_released.wait(timeout=30)


@pytest.mark.timeout(60)
def test_a_sampling_threads_first_event_does_not_count_a_write_in_flight_twice():
    """The first event lines the counters up with torchrl's write count. A write that torchrl
    counted and the observer had not folded yet at that moment is counted once."""
    rb = ReplayBuffer(storage=LazyTensorStorage(1_000), batch_size=4)
    rb.extend(torch.arange(100))  # before attaching: on the buffer's axis
    held = _Held()
    rb.add_observer(held)  # called before the logger observer, in both threads
    observer = LoggerObserver(MetricsChannel(RecordingLogger(), health_interval=None), schedule=None)
    rb.add_observer(observer)
    sampler = threading.Thread(target=rb.sample)
    sampler.start()
    assert held.sampling.wait(timeout=30)  # sampled (torchrl's lock released), event not yet seen
    writer = threading.Thread(target=rb.extend, args=(torch.arange(5),))
    writer.start()
    assert held.writing.wait(timeout=30)  # torchrl counted 105; the observer folded nothing yet
    threading.Timer(0.5, held.write_released.set).start()
    held.sample_released.set()  # the observer's first event: it lines up while the write is held
    sampler.join(timeout=30)
    writer.join(timeout=30)
    assert rb.write_count == 105
    assert observer.stats()["items_written"] == 105
    assert observer._channel().close(timeout=10)
