"""A buffer that prefetches (``prefetch=N``) is counted and folded when ``sample()`` hands a batch over.

torchrl makes such a buffer's batches ahead, in up to ``N`` threads of its
pool. Observers hear each batch once, in the thread that called
``sample()``, when it is returned, with the info it was made with; a batch
the prefetch queue drops is never counted, and no two threads run an
observer at once. Every logged row is compared with a truth computed here
from the batches the test received.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401  (adds add_observer)
from rl_observers import Every, LoggerObserver, MetricsChannel, SampleMetrics
from rl_observers.sources.replay_buffers import (
    ObservedPrefetchingReplayBuffer,
    ObservedReplayBuffer,
)
from tests.helpers import replay_buffer, scalars

CAPACITY = 10_000  # never wraps here: the item written k-th (from 0) sits in slot k
BATCH = 16
PREFETCH = 3
WINDOW = 5  # samples per logged row
KINDS = ("plain", "tensordict", "prioritized_plain", "prioritized")  # tests.helpers.replay_buffer's


def _items(kind: str, start: int, n: int):
    """Items ``start .. start + n - 1``: each carries the number of its write, ``id``."""
    ids = torch.arange(start, start + n)
    return ids if kind in ("plain", "prioritized_plain") else TensorDict({"id": ids}, [n])


def _sample(rb, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One ``sample()``: the ids it returned, their slots, and their importance weights."""
    if kind in ("plain", "prioritized_plain"):
        batch, info = rb.sample(return_info=True)
        return batch, info["index"], info.get("priority_weight")
    batch = rb.sample()  # torchrl puts the info into the batch
    return batch["id"], batch["index"], batch.get("priority_weight", None)


def _rows(logger, name: str) -> list[tuple[int, float]]:
    return [(int(step), float(value)) for step, value in scalars(logger, f"rb/{name}")]


@pytest.mark.parametrize("kind", KINDS)
def test_sample_counts_and_statistics_follow_the_batches_sample_returned(tmp_path, kind):
    rb = replay_buffer(kind, CAPACITY, batch_size=BATCH, prefetch=PREFETCH)
    written = 200
    rb.extend(_items(kind, 0, written))
    if kind.startswith("prioritized"):
        rb.update_priority(torch.arange(written), torch.linspace(0.1, 3.0, written))
    logger = CSVLogger(exp_name="prefetch", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb.add_observer(
        LoggerObserver(
            channel,
            name="rb",
            schedule=Every.counter("sample_calls", WINDOW),
            metrics=SampleMetrics(),
            log_on_close=False,
        )
    )
    calls = 4 * WINDOW
    received = []  # per sample(): (ids, slots, weights, items written when it was handed over)
    try:
        for _ in range(calls):
            ids, slots, weights = _sample(rb, kind)
            received.append((ids.clone(), slots.clone(), None if weights is None else weights.clone(), written))
            rb.extend(_items(kind, written, 8))  # batches made ahead wait in the queue meanwhile
            written += 8
        stats = rb.stats()
        assert channel.flush(timeout=30)
    finally:
        channel.close(timeout=30)
        rb.shutdown()
    # the queue still holds batches made for calls that never came: none counted
    assert stats["sample_calls"] == calls
    assert stats["samples_returned"] == calls * BATCH
    for ids, slots, _, _ in received:
        assert torch.equal(ids, slots)  # never wrapped: the ids are the slots
    steps = [WINDOW * (i + 1) for i in range(calls // WINDOW)]
    assert _rows(logger, "sample_calls") == [(s, float(s)) for s in steps]
    assert _rows(logger, "samples_returned") == [(s, float(s * BATCH)) for s in steps]
    assert _rows(logger, "batch_size") == [(s, float(BATCH)) for s in steps]
    expected = {name: [] for name in ("sample_age_mean", "sample_age_min", "sample_age_max")}
    weights_expected = {name: [] for name in ("priority_weight_mean", "priority_weight_min", "priority_weight_max")}
    for step in steps:
        window = received[step - WINDOW : step]
        # ages taken at hand-over: items written after each sampled item until sample() returned it
        ages = [w - 1 - k for ids, _, _, w in window for k in ids.tolist()]
        expected["sample_age_mean"].append((step, statistics.fmean(ages)))
        expected["sample_age_min"].append((step, float(min(ages))))
        expected["sample_age_max"].append((step, float(max(ages))))
        if window[0][2] is not None:
            weights = torch.cat([w.reshape(-1).double() for _, _, w, _ in window])
            weights_expected["priority_weight_mean"].append((step, weights.mean().item()))
            weights_expected["priority_weight_min"].append((step, weights.min().item()))
            weights_expected["priority_weight_max"].append((step, weights.max().item()))
    for name, rows in expected.items():
        assert _rows(logger, name) == [(s, pytest.approx(v)) for s, v in rows], name
    for name, rows in weights_expected.items():
        if kind.startswith("prioritized"):
            assert _rows(logger, name) == [(s, pytest.approx(v, rel=1e-5)) for s, v in rows], name
        else:
            assert not rows and _rows(logger, name) == [], name


def _counted(rb) -> tuple[int, int]:
    stats = rb.stats()
    return stats["sample_calls"], stats["samples_returned"]


@pytest.mark.parametrize("kind", ("plain", "tensordict"))
def test_batches_the_prefetch_queue_drops_are_never_counted(kind):
    rb = replay_buffer(kind, CAPACITY, batch_size=BATCH, prefetch=PREFETCH)
    rb.extend(_items(kind, 0, 100))
    metrics = SampleMetrics()
    rb.add_observer(metrics)
    for _ in range(4):
        _sample(rb, kind)
    assert rb.stats()["prefetch_queue_size"] == PREFETCH  # made, not handed over
    assert _counted(rb) == (4, 4 * BATCH)
    # load_state_dict drops the queue for the one saved with the state: the dropped batches
    # are never counted, the restored ones are when sample() hands them over
    other = replay_buffer(kind, CAPACITY, batch_size=BATCH, prefetch=PREFETCH)
    other.extend(_items(kind, 1000, 100))
    other.sample()  # its queue now holds PREFETCH batches of ids 1000..1099
    rb.load_state_dict(other.state_dict())
    other.shutdown()
    assert _counted(rb) == (4, 4 * BATCH)
    ids, slots, _ = _sample(rb, kind)
    assert ids.min() >= 1000 and torch.equal(ids - 1000, slots)  # made in `other`, handed over here
    assert _counted(rb) == (5, 5 * BATCH)
    # shutdown leaves the queue behind: never handed over, never counted
    for _ in range(3):
        _sample(rb, kind)
    assert _counted(rb) == (8, 8 * BATCH)
    assert metrics.counters() == {"sample_calls": 8, "samples_returned": 8 * BATCH}
    rb.shutdown()
    assert metrics.counters() == {"sample_calls": 8, "samples_returned": 8 * BATCH}


def test_batches_queued_before_empty_are_counted_when_handed_over():
    # torchrl 0.14's empty() keeps the prefetch queue: sample() still hands over the batches made
    # before it, so they are delivered, and counted then.
    rb = ReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=BATCH, prefetch=PREFETCH)
    rb.extend(torch.arange(100))
    metrics = SampleMetrics(age=False)
    rb.add_observer(metrics)
    rb.sample()
    for made in list(rb._prefetch_queue):  # the queued batches are made before empty(), whatever the load
        made.result()
    rb.empty()
    rb.extend(torch.arange(1000, 1010))
    handed = [rb.sample() for _ in range(PREFETCH + 2)]
    assert all(batch.max() < 100 for batch in handed[:PREFETCH])  # made before empty()
    assert all(batch.min() >= 1000 for batch in handed[PREFETCH:])
    assert metrics.counters() == {"sample_calls": PREFETCH + 3, "samples_returned": (PREFETCH + 3) * BATCH}
    rb.shutdown()


def test_an_epoch_iterated_with_prefetch_counts_each_batch_it_yielded():
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(100), sampler=SamplerWithoutReplacement(drop_last=True), batch_size=10, prefetch=3
    )
    rb.extend(TensorDict({"id": torch.arange(100)}, [100]))
    seen: list[torch.Tensor] = []
    rb.add_observer(index_recorder(seen))
    yielded = [batch["index"].clone() for batch in rb]
    rb.shutdown()
    assert len(yielded) == 10 and sorted(torch.cat(yielded).tolist()) == list(range(100))
    assert [i.tolist() for i in seen] == [i.tolist() for i in yielded]


def index_recorder(seen: list[torch.Tensor]):
    """An observer keeping the index of each ``post_sample`` it hears."""

    class Recorder:
        def on_post_sample(self, source, batch, info):
            seen.append(info["index"].clone())

    return Recorder()


class ConcurrencyRecorder:
    """Records how many threads run its ``on_post_sample`` at once, and which threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = self.most = 0
        self.threads: set[int] = set()
        self.indices: list[torch.Tensor] = []

    def on_post_sample(self, source, batch, info) -> None:
        with self._lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.threads.add(threading.get_ident())
            self.indices.append(info["index"].clone())
        time.sleep(0.002)  # a slow observer: overlapping threads would show
        with self._lock:
            self.active -= 1


def _slow(data):
    time.sleep(0.002)  # a transform as slow as the observer: the prefetch threads overlap
    return data


def test_no_two_threads_run_an_observer_at_once():
    rb = ReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=BATCH, prefetch=PREFETCH, transform=_slow)
    rb.extend(torch.arange(1000))
    recorder = ConcurrencyRecorder()
    rb.add_observer(recorder)
    received: dict[int, list[torch.Tensor]] = {}

    def sample(n: int) -> None:
        mine = received.setdefault(threading.get_ident(), [])
        for _ in range(n):
            mine.append(rb.sample(return_info=True)[1]["index"].clone())

    try:
        sample(20)
        users = [threading.Thread(target=sample, args=(20,)) for _ in range(2)]
        for thread in users:
            thread.start()
        for thread in users:
            thread.join()
    finally:
        rb.shutdown()
    assert recorder.most == 1
    assert recorder.threads <= set(received)  # the threads that called sample(), never torchrl's pool
    assert len(recorder.indices) == 60
    handed = sorted(tuple(i.tolist()) for batches in received.values() for i in batches)
    assert sorted(tuple(i.tolist()) for i in recorder.indices) == handed


def test_an_observer_may_sample_from_its_event():
    rb = ReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=BATCH, prefetch=PREFETCH)
    rb.extend(torch.arange(100))
    events: list[torch.Tensor] = []

    class Resampling:
        def on_post_sample(self, source, batch, info):
            events.append(batch.clone())
            if len(events) == 1:
                events.append(source.sample())  # handed over, and heard, inside this event

    rb.add_observer(Resampling())
    first = rb.sample()
    rb.shutdown()
    assert torch.equal(events[0], first)
    assert len(events) == 3 and torch.equal(events[1], events[2])


def test_only_a_prefetching_buffer_gets_the_hand_over_path():
    plain = ReplayBuffer(storage=LazyTensorStorage(10))
    ahead = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2, prefetch=2)
    for rb in (plain, ahead):
        rb.add_observer(SampleMetrics())
    # a buffer that does not prefetch keeps torchrl's sample() and emits from _sample, as before
    assert type(plain).sample is ReplayBuffer.sample
    assert type(plain)._sample is ObservedReplayBuffer._sample
    assert type(ahead).sample is ObservedPrefetchingReplayBuffer.sample
    assert type(ahead)._sample is ObservedPrefetchingReplayBuffer._sample
    assert type(ahead).extend is ObservedReplayBuffer.extend
    assert isinstance(ahead, ReplayBuffer) and type(ahead).__name__ == "ReplayBuffer"
    (metrics,) = ahead.observers
    ahead.remove_observer(metrics)
    assert type(ahead) is ReplayBuffer
    ahead.shutdown()
