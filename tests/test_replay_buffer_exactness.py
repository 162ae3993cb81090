"""Replay-buffer metrics stay exact when writes interleave, the buffer is emptied or shared,
a write overwrites pending rows, or a consuming sampler writes into consumed slots."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import ConsumingSampler

import rl_observers  # noqa: F401  (adds add_observer)
from rl_observers import (
    Every,
    LoggerObserver,
    MetricsChannel,
    MetricSet,
    SampleMetrics,
    WriteMetrics,
)
from tests.helpers import RecordingLogger

NEVER = Every.counter("items_written", 10**12)


def _rewards(n: int, value: float) -> TensorDict:
    return TensorDict({"next": {"reward": torch.full((n, 1), value)}}, batch_size=[n])


def _observed(rb, *sets):
    """``rb`` observed by a LoggerObserver folding ``sets`` (never emitting on its own)."""
    channel = MetricsChannel(RecordingLogger(), background=False, health_interval=None)
    rb.add_observer(LoggerObserver(channel, schedule=NEVER, metrics=list(sets)))
    return channel


def test_writes_from_two_threads_fold_each_thread_s_own_rows():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000))
    metrics = WriteMetrics(reward_key=("next", "reward"))
    channel = _observed(rb, metrics)
    rb.extend(_rewards(1, 1.5))  # decides the range path
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: writes interleave

    def write(value: float) -> None:
        data = _rewards(10, value)
        for _ in range(2_000):
            rb.extend(data)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no row may be reported lost
            threads = [threading.Thread(target=write, args=(v,)) for v in (1.0, 2.0)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            window = metrics.pull()
    finally:
        sys.setswitchinterval(interval)
        channel.close(10)
    assert window["items_written"] == 40_001
    assert window["reward"].count == 40_001
    assert window["reward"].finalize() == pytest.approx(
        {"reward_mean": 1.5, "reward_std": 0.5, "reward_min": 1.0, "reward_max": 2.0}, abs=1e-4
    )


def test_rewards_written_before_empty_are_all_folded():
    # An on-policy loop: two writes, then the buffer is emptied, five times.
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000))
    metrics = WriteMetrics(reward_key=("next", "reward"))
    channel = _observed(rb, metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for iteration in range(5):
            rb.extend(_rewards(100, float(iteration)))
            rb.extend(_rewards(100, float(iteration)))
            rb.empty()
        window = metrics.pull()
    channel.close(10)
    assert window["reward"].count == 1000
    assert window["reward"].finalize()["reward_mean"] == pytest.approx(2.0)


def test_a_write_overwriting_pending_rows_warns_and_later_writes_stay_exact():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    metrics = WriteMetrics(reward_key=("next", "reward"))
    channel = _observed(rb, metrics)
    rb.extend(_rewards(5, 0.0))  # folded from its data; decides the range path
    rb.extend(_rewards(20, 1.0))  # pending in the storage
    with pytest.warns(UserWarning, match="the rewards of 10 rows written to the replay buffer could not be read back"):
        rb.extend(_rewards(90, 0.0))  # overwrites 10 of the 20 pending rows
    assert metrics.pull()["reward"].count == 105  # the 10 overwritten rewards are gone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value in (3.0, 5.0):
            rb.extend(_rewards(20, value))
        rb.extend(_rewards(90, 7.0))
        window = metrics.pull()
    channel.close(10)
    assert window["reward"].count == 130
    assert window["reward"].finalize()["reward_mean"] == pytest.approx((60 + 100 + 630) / 130)


def _write_shared(rb, value: float, queue) -> None:
    metrics = WriteMetrics(reward_key=("next", "reward"))
    metrics.bind(rb)
    data = _rewards(10, value)
    for _ in range(300):
        metrics.on_post_extend(rb, data, rb.extend(data))
    window = metrics.pull()
    queue.put((value, window["items_written"], window["reward"].count, window["reward"].finalize()))


@pytest.mark.slow
def test_a_buffer_shared_by_two_processes_folds_each_process_s_own_rewards():
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000), shared=True)
    rb.extend(_rewards(10, 0.0))  # allocates the shared storage
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_write_shared, args=(rb, v, queue)) for v in (1.0, 2.0)]
    for worker in workers:
        worker.start()
    results = sorted(queue.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(30)
    for value, items, count, stats in results:
        assert items == count == 3000
        assert stats["reward_min"] == stats["reward_max"] == value


def test_a_consuming_sampler_writes_into_consumed_slots_and_metrics_follow():
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(10), sampler=ConsumingSampler(max_sample_count=1)
    )
    writes = WriteMetrics(reward_key=("next", "reward"))
    samples = SampleMetrics()
    channel = _observed(rb, writes, samples)
    written = 0

    def write(n: int, reward: float) -> None:
        nonlocal written
        numbers = torch.arange(written, written + n)  # the item's place among all writes
        rb.extend(TensorDict({"k": numbers, "next": {"reward": torch.full((n, 1), reward)}}, [n]))
        written += n

    write(10, 0.0)
    rb.sample(5)
    writes.pull(), samples.pull()
    write(5, 1000.0)  # lands in the 5 consumed slots, the cursor stays
    batch = rb.sample(5)
    true_ages = (written - 1 - batch["k"]).tolist()
    ages = samples.pull()["sample_age"].finalize()
    rewards = writes.pull()["reward"].finalize()
    channel.close(10)
    assert rewards["reward_mean"] == rewards["reward_min"] == 1000.0
    assert ages == {
        "sample_age_mean": pytest.approx(sum(true_ages) / 5),
        "sample_age_min": min(true_ages),
        "sample_age_max": max(true_ages),
    }


def test_a_sample_folded_during_another_threads_emission_is_logged_at_close():
    # Thread B's sample is due and its emission pulls (slowly); the main thread's sample folds
    # meanwhile and is not due: the window it opened is logged at close.
    started = threading.Event()

    class SlowPull(MetricSet):
        def on_post_sample(self, source, batch, info):
            pass

        def pull(self):
            if threading.current_thread().name == "emitter":
                started.set()
                time.sleep(0.3)
            return super().pull()

    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    rb.extend(torch.arange(10))
    schedule = Every.counter("sample_calls", 2)
    rb.add_observer(LoggerObserver(channel, schedule=schedule, metrics=[SampleMetrics(), SlowPull()]))
    rb.sample(4)
    emitter = threading.Thread(target=rb.sample, args=(4,), name="emitter")
    emitter.start()
    assert started.wait(10)
    rb.sample(4)
    emitter.join()
    channel.close(10)
    logged = [m["replay_buffer/sample_calls"] for m, _ in logger.calls if "replay_buffer/sample_calls" in m]
    assert logged == [2.0, 3.0]


def test_a_write_after_the_cursor_moved_unobserved_is_folded():
    # load_state_dict moves the writer's cursor back without a write event: the pending rows it
    # overwrites are reported, and every write's own rewards are still folded.
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(64))
    metrics = WriteMetrics(reward_key="r")
    channel = _observed(rb, metrics)

    def write(value: float) -> None:
        rb.extend(TensorDict({"r": torch.full((4,), value)}, [4]))

    write(1.0)  # rows 0-3
    checkpoint = rb.state_dict()  # cursor at 4
    write(2.0)  # rows 4-7, pending
    write(3.0)  # rows 8-11, pending
    rb.load_state_dict(checkpoint)  # cursor back at 4
    with pytest.warns(UserWarning, match="the rewards of 4 rows .* moved by 56 rows"):
        write(5.0)  # rows 4-7: the 2.0 rows are gone
    write(6.0)  # rows 8-11
    window = metrics.pull()
    channel.close(10)
    assert window["items_written"] == 20
    assert window["reward"].count == 16
    assert window["reward"].finalize()["reward_mean"] == pytest.approx((4 + 12 + 20 + 24) / 16)


def test_a_large_write_after_the_cursor_moved_unobserved_reports_the_rows_it_overwrote():
    # A write of more than a quarter of the storage is folded from its data; after the cursor
    # moved back without an event (torchrl's own empty(), as a Ray actor runs it for a client
    # handed out before the observers), the pending rows it overwrote hold its rewards now: they
    # are reported, never read back as theirs.
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    metrics = WriteMetrics(reward_key="r")
    channel = _observed(rb, metrics)
    rb.extend(TensorDict({"r": torch.zeros(10)}, [10]))  # folded from its data; decides the range path
    rb.extend(TensorDict({"r": torch.ones(10)}, [10]))  # rows 10-19, pending
    TensorDictReplayBuffer.empty(rb)  # torchrl's function: no event; the cursor is back at 0
    with pytest.warns(UserWarning, match="the rewards of 10 rows .* moved by 80 rows"):
        rb.extend(TensorDict({"r": torch.full((30,), 5.0)}, [30]))  # rows 0-29: the 1.0 rows are gone
    window = metrics.pull()
    channel.close(10)
    assert window["items_written"] == 50
    assert window["reward"].count == 40
    assert window["reward"].finalize()["reward_min"] == 0.0
    assert window["reward"].finalize()["reward_mean"] == pytest.approx(150 / 40)


def test_a_large_write_after_an_unobserved_cursor_move_folds_the_pending_rows_it_spared():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    metrics = WriteMetrics(reward_key="r")
    channel = _observed(rb, metrics)
    rb.extend(TensorDict({"r": torch.zeros(50)}, [50]))  # folded from its data
    rb.extend(TensorDict({"r": torch.ones(10)}, [10]))  # rows 50-59, pending
    TensorDictReplayBuffer.empty(rb)  # torchrl's function: no event; the cursor is back at 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rb.extend(TensorDict({"r": torch.full((30,), 5.0)}, [30]))  # rows 0-29: spares rows 50-59
    window = metrics.pull()
    channel.close(10)
    assert window["reward"].count == 90
    assert window["reward"].finalize()["reward_mean"] == pytest.approx((10 + 150) / 90)


def test_ages_and_rewards_follow_a_writer_whose_shared_cursor_was_replaced():
    # The sets keep the writer's shared cursor cell between events; a writer given a new one
    # (as torchrl's writer gets when unpickled) is read from its new cell from then on.
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(64))
    samples = SampleMetrics()
    writes = WriteMetrics(reward_key="r")
    channel = _observed(rb, writes, samples)

    def write(value: float) -> None:
        rb.extend(TensorDict({"r": torch.full((4,), value)}, [4]))

    def sampled_ages() -> list[int]:
        _, info = rb.sample(8, return_info=True)
        return (rb._writer._cursor - 1 - info["index"]).remainder(64).tolist()

    write(1.0)
    expected = sampled_ages()
    writer = rb._writer
    writer._cursor_value = multiprocessing.Value("i", writer._cursor)  # a new shared cell
    write(2.0)  # rows 4-7, from the new cell
    expected += sampled_ages()
    window = samples.pull()
    rewards = writes.pull()["reward"]
    channel.close(10)
    ages = window["sample_age"].finalize()
    assert ages["sample_age_mean"] == pytest.approx(sum(expected) / len(expected))
    assert (ages["sample_age_min"], ages["sample_age_max"]) == (min(expected), max(expected))
    assert rewards.count == 8
    assert rewards.finalize()["reward_mean"] == pytest.approx(1.5)
