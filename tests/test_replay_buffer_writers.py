"""Every torchrl writer observed: skipped items are neither written nor stamped."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    ReplayBuffer,
    RoundRobinWriter,
)
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401  (adds add_observer)
from rl_observers import Every, LoggerObserver, MetricsChannel, SampleMetrics, WriteMetrics
from tests.helpers import replay_buffer


def _items(values: list[float]) -> TensorDict:
    rank = torch.tensor(values)
    return TensorDict({"rank": rank, "next": {"reward": rank.unsqueeze(-1)}}, batch_size=[len(values)])


@pytest.mark.parametrize(
    "kind", ["round_robin", "max_value", "prioritized", "prioritized_max_value"]
)
def test_writes_and_ages_count_only_stored_items(kind, tmp_path):
    if kind.startswith("prioritized"):
        try:
            replay_buffer(kind, 4)
        except RuntimeError:
            pytest.skip("prioritized replay buffers need torchrl's C++ extension")
    rb = replay_buffer(kind, 4)
    writes, samples = WriteMetrics(reward_key=("next", "reward")), SampleMetrics()
    logger = CSVLogger(exp_name="writers", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    # The observer's schedule never fires: this test pulls the windows itself.
    observer = LoggerObserver(
        channel, metrics=[writes, samples], schedule=Every.seconds(float("inf"))
    )
    rb.add_observer(observer, on_error="raise")
    stamps: dict[int, int] = {}  # slot -> items stored when it was last written
    stored_rewards: list[float] = []
    stored = 0
    rng = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no observer warning either
        for step in range(12):
            values = (torch.rand(3, generator=rng) * 10).tolist()
            if step % 3 == 2:  # add, one item
                item = _items(values[:1])[0]
                index = rb.add(item)
                slots, kept = (
                    ([] if index is None else [int(index)]),
                    values[:1] if index is not None else [],
                )
            else:
                index = rb.extend(_items(values))
                pairs = [(int(i), v) for i, v in zip(index.tolist(), values) if i >= 0]
                slots, kept = [i for i, _ in pairs], [v for _, v in pairs]
            for slot in slots:
                stored += 1
                stamps[slot] = stored
            stored_rewards += kept
            batch, info = rb.sample(4, return_info=True)
            want_ages = [stored - stamps[int(i)] for i in info["index"].tolist()]
            got = samples.pull()["sample_age"]
            assert (got.min, got.max, got.count) == (min(want_ages), max(want_ages), len(want_ages))
    if kind.endswith("max_value"):
        # torchrl's count also has items an extend stored and then replaced by a later item
        # of the same extend (their index is -1): they are not in the buffer.
        assert stored <= rb.write_count
    else:
        assert stored == rb.write_count
    assert writes.counters()["items_written"] == stored
    assert writes.counters()["writes"] == 12
    if kind.endswith("max_value"):
        assert stored < 32  # the writer did skip items
    reward = writes.pull()["reward"]
    assert reward.count == len(stored_rewards)
    assert reward.mean == pytest.approx(sum(stored_rewards) / len(stored_rewards))
    assert channel.close()


def test_round_robin_writer_of_a_plain_buffer_stores_every_item():
    rb = ReplayBuffer(storage=LazyTensorStorage(5), writer=RoundRobinWriter())
    writes, samples = WriteMetrics(), SampleMetrics()
    for metrics in (writes, samples):
        metrics.bind(rb)
        assert metrics._skips is False  # no host read of the index
    for chunk in (torch.arange(4), torch.arange(4, 7)):
        index = rb.extend(chunk)
        writes.on_post_extend(rb, chunk, index)
        samples.on_post_extend(rb, chunk, index)
    assert writes.counters()["items_written"] == rb.write_count == 7


def test_a_write_that_stores_nothing_counts_a_call_and_no_item():
    rb = replay_buffer("max_value", 2)
    writes, samples = WriteMetrics(reward_key=("next", "reward")), SampleMetrics()
    for data in (_items([5.0, 6.0]), _items([1.0, 2.0])):  # the second is worse: all skipped
        index = rb.extend(data)
        writes.on_post_extend(rb, data, index)
        samples.on_post_extend(rb, data, index)
    skipped = _items([0.5])[0]
    index = rb.add(skipped)
    assert index is None
    writes.on_post_add(rb, skipped, index)
    samples.on_post_add(rb, skipped, index)
    assert writes.counters() == {"write_count": 2, "writes": 3, "items_written": 2}
    assert writes.pull()["reward"].finalize()["reward_mean"] == 5.5
    assert samples._written == 2
