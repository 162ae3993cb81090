"""SampleMetrics and WriteMetrics against ground truth computed from real replay buffers."""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)

from rl_observers.metrics import (
    SampleMetrics,
    WriteMetrics,
)

# -- SampleMetrics -----------------------------------------------------------------


def _expected_ages(ids: list[int], written: int) -> dict[str, float]:
    # the item with id k was the (k + 1)-th item written; age = items written after it
    ages = [written - 1 - k for k in ids]
    return {
        "sample_age_mean": statistics.fmean(ages),
        "sample_age_min": float(min(ages)),
        "sample_age_max": float(max(ages)),
    }


def test_sample_age_with_wrapping_writes_and_adds():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    metrics = SampleMetrics()
    written = 0
    for size in (4, 7, 1, 12, 3):  # the 12-item extend wraps around the whole storage
        if size == 1:
            index = rb.add(torch.tensor(written))
            metrics.on_post_add(rb, None, index)
        else:
            data = torch.arange(written, written + size)
            metrics.on_post_extend(rb, data, rb.extend(data))
        written += size
        for _ in range(2):
            batch, info = rb.sample(6, return_info=True)
            metrics.on_post_sample(rb, batch, info)
            payload = metrics.pull()
            assert payload["sample_age"].finalize() == pytest.approx(
                _expected_ages(batch.tolist(), written)
            )
    assert written == rb.write_count
    assert payload["sample_calls"] == 10 and payload["samples_returned"] == 60
    assert payload["batch_size"] == 6
    assert metrics.counters() == {"sample_calls": 10, "samples_returned": 60}
    assert metrics.stats() == {"sample_calls": 10, "samples_returned": 60}


def test_sample_age_over_many_samples_in_one_window():
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(16), writer=RoundRobinWriter(track_generations=True)
    )
    metrics = SampleMetrics()
    seen, written = [], 0
    for size in (5, 9, 20, 6):
        data = TensorDict({"id": torch.arange(written, written + size)}, [size])
        metrics.on_post_extend(rb, data, rb.extend(data))
        written += size
        batch, info = rb.sample(8, return_info=True)
        assert "index_generation" in info
        metrics.on_post_sample(rb, batch, info)
        seen += [written - 1 - k for k in batch["id"].tolist()]
    got = metrics.pull()["sample_age"].finalize()
    assert got == pytest.approx(
        {
            "sample_age_mean": statistics.fmean(seen),
            "sample_age_min": min(seen),
            "sample_age_max": max(seen),
        }
    )


@pytest.mark.parametrize("written", [8, 16, 9, 15])
def test_sample_age_at_every_cursor_position_including_zero(written):
    # Cursor 0 (the storage just filled): slot capacity - 1 is the newest item, age 0.
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    metrics = SampleMetrics()
    data = torch.arange(written)
    metrics.on_post_extend(rb, data, rb.extend(data))
    batch, info = rb.sample(64, return_info=True)
    metrics.on_post_sample(rb, batch, info)
    assert metrics.pull()["sample_age"].finalize() == pytest.approx(
        _expected_ages(batch.tolist(), written)
    )


class ReusingSampler(RandomSampler):
    """A sampler that writes each sample's index into the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.index: torch.Tensor | None = None

    def sample(self, storage, batch_size):
        index, info = super().sample(storage, batch_size)
        if self.index is None or self.index.shape != index.shape:
            self.index = index.clone()
        else:
            self.index.copy_(index)
        return self.index, info


def test_sample_age_with_a_sampler_that_reuses_its_index():
    # Ages are folded when a window closes: a sampler that rewrites its index buffer must not
    # change the ages of the samples already taken (their indices are copied, not kept).
    rb = ReplayBuffer(storage=LazyTensorStorage(50), sampler=ReusingSampler())
    metrics = SampleMetrics()
    metrics.bind(rb)
    rb.extend(torch.arange(20))  # the writer's cursor is at 20: slot k has age 19 - k
    for _ in range(2):
        ages = []
        for _ in range(5):
            batch, info = rb.sample(3, return_info=True)
            metrics.on_post_sample(rb, batch, info)
            ages += (19 - batch).tolist()
        got = metrics.pull()["sample_age"].finalize()
        truth = {"sample_age_mean": statistics.fmean(ages), "sample_age_min": min(ages)}
        assert got == pytest.approx({**truth, "sample_age_max": max(ages)})
    assert metrics.counters() == {"sample_calls": 10, "samples_returned": 30}


def test_sample_age_over_many_staged_samples():
    # More samples than are staged at once, of changing sizes, writes in between, a pull,
    # a state_dict and a pickle in the middle of a stage.
    rb = ReplayBuffer(storage=LazyTensorStorage(50))
    metrics = SampleMetrics()
    seen, written = [], 0
    for step in range(70):
        if step % 3 == 0:
            data = torch.arange(written, written + 7)
            metrics.on_post_extend(rb, data, rb.extend(data))
            written += 7
        batch, info = rb.sample(9 if step % 11 == 0 else 5, return_info=True)
        metrics.on_post_sample(rb, batch, info)
        seen += [written - 1 - k for k in batch.tolist()]
        if step == 40:
            metrics = pickle.loads(pickle.dumps(metrics))
        if step == 50:
            state = metrics.state_dict()
        if step in (25, 50, 69):
            got = metrics.pull()["sample_age"].finalize()
            assert got == pytest.approx(
                {
                    "sample_age_mean": statistics.fmean(seen),
                    "sample_age_min": min(seen),
                    "sample_age_max": max(seen),
                }
            )
            seen = []
    resumed = SampleMetrics()
    resumed.load_state_dict(state)
    assert resumed.counters() == {"sample_calls": 51, "samples_returned": 51 * 5 + 5 * 4}
    assert metrics.counters()["sample_calls"] == 70


def test_staged_samples_never_read_a_value_on_the_host():
    rb = ReplayBuffer(storage=LazyTensorStorage(64, device="meta"))
    metrics = SampleMetrics()
    index = torch.arange(64, device="meta")
    metrics.on_post_extend(rb, None, index)
    for step in range(3 * 16):  # the stamps of full stages are folded inside on_post_sample
        metrics.on_post_sample(rb, None, {"index": index[: 8 if step % 20 else 4]})
    assert metrics.counters()["sample_calls"] == 48
    with pytest.raises((NotImplementedError, RuntimeError)):
        metrics.pull()


def test_sample_age_with_unbounded_list_storage():
    rb = ReplayBuffer(storage=ListStorage())
    metrics = SampleMetrics()
    written = 0
    for size in (3, 2000):  # grows the stamps past their first allocation
        data = [torch.tensor(k) for k in range(written, written + size)]
        metrics.on_post_extend(rb, data, rb.extend(data))
        written += size
    batch, info = rb.sample(50, return_info=True)
    metrics.on_post_sample(rb, batch, info)
    assert metrics.pull()["sample_age"].finalize() == pytest.approx(
        _expected_ages(batch.tolist(), written)
    )


def test_items_written_before_observing_have_their_true_age_with_a_round_robin_writer():
    # Ages come from the writer's cursor: every stored item has one, observed or not.
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(torch.arange(5))  # not observed
    metrics = SampleMetrics()
    data = torch.arange(5, 12)  # wraps: ids 10 and 11 overwrite slots 0 and 1
    metrics.on_post_extend(rb, data, rb.extend(data))
    batch, info = rb.sample(40, return_info=True)
    metrics.on_post_sample(rb, batch, info)
    age = metrics.pull()["sample_age"]
    assert age.count == 40
    assert age.finalize() == pytest.approx(_expected_ages(batch.tolist(), 12))


def test_a_write_landing_while_a_sample_is_taken_counts_toward_its_ages():
    # The cursor is read when the sample is folded: a write between the sampler
    # drawing the index and post_sample (another process's) counts toward the ages.
    rb = ReplayBuffer(storage=LazyTensorStorage(20))
    rb.extend(torch.arange(10))
    metrics = SampleMetrics()
    metrics.bind(rb)
    batch, info = rb.sample(30, return_info=True)
    rb.extend(torch.arange(10, 13))  # not seen by the set; no sampled slot is rewritten
    metrics.on_post_sample(rb, batch, info)
    age = metrics.pull()["sample_age"]
    assert age.count == 30
    assert age.finalize() == pytest.approx(_expected_ages(batch.tolist(), 13))


def _extend_in_child(rb, data):
    rb.extend(data)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_writes_from_another_process_sharing_the_cursor_are_counted(tmp_path):
    # docs/distributed.rst, docs/faq.rst: with a round-robin writer the ages come
    # from the writer's cursor, which a shared buffer's copies share (the
    # memory-mapped storage shares the data too, so the sample reads the child's items).
    def rows(ids):
        return TensorDict({"id": torch.tensor(ids)}, [len(ids)])

    rb = ReplayBuffer(storage=LazyMemmapStorage(10, scratch_dir=tmp_path), shared=True)
    rb.extend(rows(range(4)))  # a shared storage is initialised before it travels
    metrics = SampleMetrics()
    metrics.bind(rb)
    child = multiprocessing.get_context("fork").Process(
        target=_extend_in_child, args=(rb, rows(range(4, 12)))  # wraps: 10, 11 in slots 0, 1
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert rb.write_count == 12 and len(rb) == 10
    batch, info = rb.sample(40, return_info=True)
    ids = batch["id"].tolist()
    assert set(ids) <= set(range(2, 12))  # the child's items, in the shared storage
    metrics.on_post_sample(rb, batch, info)
    age = metrics.pull()["sample_age"]
    assert age.count == 40
    assert age.finalize() == pytest.approx(_expected_ages(ids, 12))


def test_items_written_before_observing_have_no_age_with_a_max_value_writer():
    # Not a round-robin writer: the stamp path, which sees only the writes it is given.
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(10), writer=TensorDictMaxValueWriter(rank_key="k")
    )

    def rows(ids):
        return TensorDict({"k": torch.tensor(ids, dtype=torch.float32)}, [len(ids)])

    rb.extend(rows([0, 1, 2, 3, 4]))  # not observed
    metrics = SampleMetrics()
    metrics.bind(rb)
    data = rows([5, 6, 7])
    metrics.on_post_extend(rb, data, rb.extend(data))
    batch, info = rb.sample(40, return_info=True)
    metrics.on_post_sample(rb, batch, info)
    observed = [int(k) for k in batch["k"].tolist() if k >= 5]
    age = metrics.pull()["sample_age"]
    assert age.count == len(observed) < 40
    assert age.finalize() == pytest.approx(_expected_ages([k - 5 for k in observed], 3))


def test_items_written_before_observing_have_no_age_with_stamps():
    rb = ReplayBuffer(storage=ListStorage())  # unbounded: slots are stamped by each write
    rb.extend([torch.tensor(k) for k in range(5)])  # not observed
    metrics = SampleMetrics()
    data = [torch.tensor(k) for k in range(5, 8)]
    metrics.on_post_extend(rb, data, rb.extend(data))
    batch, info = rb.sample(40, return_info=True)
    metrics.on_post_sample(rb, batch, info)
    observed = [k for k in batch.tolist() if k >= 5]
    age = metrics.pull()["sample_age"]
    assert age.count == len(observed) < 40
    assert age.finalize() == pytest.approx(
        {k: v for k, v in _expected_ages([k - 5 for k in observed], 3).items()}
    )


def test_sample_metrics_on_a_multi_dim_storage():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(12, ndim=2))
    writes = WriteMetrics()
    samples = SampleMetrics()
    for _ in range(4):
        data = TensorDict({"x": torch.zeros(3, 2)}, [3, 2])
        index = rb.extend(data)
        writes.on_post_extend(rb, data, index)
        samples.on_post_extend(rb, data, index)
    assert writes.counters()["items_written"] == rb.write_count
    batch, info = rb.sample(5, return_info=True)
    samples.on_post_sample(rb, batch, info)
    payload = samples.pull()
    assert payload["samples_returned"] == 5
    age = payload["sample_age"]
    assert age.count == 5 and 0 <= age.min <= age.max < rb.write_count


def test_priority_weights_from_the_sampler_info():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    data = torch.arange(6)
    metrics = SampleMetrics(age=False)
    metrics.on_post_extend(rb, data, rb.extend(data))
    batch, info = rb.sample(4, return_info=True)
    weights = torch.tensor([0.5, 1.0, 0.25, 1.0])
    info["priority_weight"] = weights  # the key torchrl's PrioritizedSampler sets
    metrics.on_post_sample(rb, batch, info)
    payload = metrics.pull()
    assert "sample_age" not in payload
    assert payload["priority_weight"].finalize() == {
        "priority_weight_mean": 0.6875,
        "priority_weight_min": 0.25,
        "priority_weight_max": 1.0,
    }


def _prioritized_available() -> bool:
    try:
        PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(4))
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(
    not _prioritized_available(), reason="torchrl's C++ segment trees are not available"
)
def test_prioritized_replay_buffer_weights():
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(10))
    metrics = SampleMetrics()
    data = torch.arange(8)
    metrics.on_post_extend(rb, data, rb.extend(data))
    rb.update_priority(torch.arange(8), torch.arange(1.0, 9.0))
    batch, info = rb.sample(16, return_info=True)
    metrics.on_post_sample(rb, batch, info)
    w = torch.as_tensor(info["priority_weight"]).double()
    got = metrics.pull()["priority_weight"].finalize()
    assert got == pytest.approx(
        {
            "priority_weight_mean": w.mean().item(),
            "priority_weight_min": w.min().item(),
            "priority_weight_max": w.max().item(),
        }
    )


def test_sample_without_info_counts_the_batch():
    metrics = SampleMetrics()
    metrics.on_post_sample(None, TensorDict({"a": torch.zeros(7)}, [7]), None)
    metrics.on_post_sample(None, torch.zeros(3, 4), None)
    payload = metrics.pull()
    assert payload["sample_calls"] == 2 and payload["samples_returned"] == 10
    assert payload["batch_size"] == 3
    assert payload["sample_age"].count == 0 and payload["priority_weight"].count == 0


def test_sample_metrics_state_dict_round_trip():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    metrics = SampleMetrics()
    data = torch.arange(6)
    metrics.on_post_extend(rb, data, rb.extend(data))
    metrics.on_post_sample(rb, *rb.sample(2, return_info=True))
    resumed = SampleMetrics()
    resumed.load_state_dict(pickle.loads(pickle.dumps(metrics.state_dict())))
    data = torch.arange(6, 9)
    resumed.on_post_extend(rb, data, rb.extend(data))
    batch, info = rb.sample(10, return_info=True)
    resumed.on_post_sample(rb, batch, info)
    payload = resumed.pull()
    assert payload["sample_calls"] == 2 and payload["samples_returned"] == 12
    assert payload["sample_age"].finalize() == pytest.approx(_expected_ages(batch.tolist(), 9))


def test_sample_fold_never_reads_a_value_on_the_host():
    # A buffer whose storage lives on the meta device (torchrl itself cannot
    # extend it: its writer reads the cursor). Stamps follow the storage, so
    # stamping and sampling run on meta tensors, where any host read raises.
    rb = ReplayBuffer(storage=LazyTensorStorage(8, device="meta"))
    metrics = SampleMetrics()
    writes = WriteMetrics(reward_key="r")
    data = TensorDict({"r": torch.ones(6, 1)}, [6]).to("meta")
    index = torch.arange(6, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sample_age must not be disabled
        metrics.on_post_extend(rb, data, index)
        writes.on_post_extend(rb, data, index)
        metrics.on_post_sample(
            rb, data, {"index": index[:4], "priority_weight": torch.ones(4, device="meta")}
        )
    assert metrics.counters() == {"sample_calls": 1, "samples_returned": 4}
    assert writes.counters()["items_written"] == 6
    for metric_set in (metrics, writes):
        with pytest.raises((NotImplementedError, RuntimeError)):
            metric_set.pull()


# -- WriteMetrics ------------------------------------------------------------------


def test_write_metrics_counts_and_rewards():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(20))
    metrics = WriteMetrics(reward_key=("next", "reward"))
    rewards = []
    for size in (5, 1, 8, 30):
        data = TensorDict({"next": {"reward": torch.randn(size, 1)}}, [size])
        rewards += data["next", "reward"].flatten().tolist()
        metrics.on_post_extend(rb, data, rb.extend(data))
    single = TensorDict({"next": {"reward": torch.tensor([2.5])}}, [])
    metrics.on_post_add(rb, single, rb.add(single))
    rewards.append(2.5)
    assert metrics.counters() == {"write_count": 45, "writes": 5, "items_written": 45}
    assert rb.write_count == 45
    stats = metrics.stats()
    assert stats["writes"] == 5 and 0 <= stats["seconds_since_last_write"] < 60
    payload = metrics.pull()
    assert payload["writes"] == 5.0 and payload["items_written"] == 45.0
    assert payload["reward"].finalize() == pytest.approx(
        {
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "reward_min": min(rewards),
            "reward_max": max(rewards),
        }
    )
    assert metrics.pull()["reward"].finalize() == {}


def test_write_metrics_masked_trajectories_and_missing_keys():
    metrics = WriteMetrics(reward_key=("next", "reward"))
    data = TensorDict(
        {
            "next": {"reward": torch.tensor([[1.0], [2.0], [9.0]])},
            "collector": {"mask": torch.tensor([True, True, False])},
        },
        [3],
    )
    metrics.on_post_extend(None, data, None)
    assert metrics.pull()["reward"].finalize()["reward_max"] == 2.0
    with pytest.raises(KeyError, match=r"reward_key=\('next', 'reward'\).*'a'"):
        metrics.on_post_extend(None, TensorDict({"a": torch.zeros(2)}, [2]), None)
    with pytest.raises(TypeError, match="needs TensorDict data"):
        metrics.on_post_extend(None, torch.zeros(2), None)
    assert WriteMetrics().stats() == {"writes": 0, "items_written": 0}


def test_write_metrics_state_dict_and_pickle():
    metrics = WriteMetrics()
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    data = torch.arange(5)
    metrics.on_post_extend(rb, data, rb.extend(data))
    clone = pickle.loads(pickle.dumps(metrics))
    resumed = WriteMetrics()
    resumed.load_state_dict(metrics.state_dict())
    for m in (clone, resumed):
        m.on_post_extend(rb, data, rb.extend(data))
        assert m.counters() == {"write_count": 10, "writes": 2, "items_written": 10}


def test_warnings_are_not_emitted_on_the_normal_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rb = ReplayBuffer(storage=LazyTensorStorage(4))
        metrics = SampleMetrics()
        data = torch.arange(3)
        metrics.on_post_extend(rb, data, rb.extend(data))
        metrics.on_post_sample(rb, *rb.sample(2, return_info=True))
        metrics.pull()


def test_sample_age_is_disabled_rather_than_syncing_for_unbounded_device_storages():
    rb = ReplayBuffer(storage=ListStorage())  # unbounded: stamps would need the largest index
    metrics = SampleMetrics()
    with pytest.warns(UserWarning, match="sample_age is disabled"):
        metrics.on_post_extend(rb, None, torch.arange(3, device="meta"))
    metrics.on_post_extend(rb, None, torch.arange(3, 6, device="meta"))  # warns once
    metrics.on_post_sample(rb, None, {"index": torch.arange(2, device="meta")})
    assert metrics.pull()["sample_age"].count == 0


def test_write_metrics_read_back_from_a_round_robin_storage():
    # Rewards wait in the storage between pulls; unobserved writes in between, empty(), a
    # pickle, a state_dict and a write of 3/4 of the storage keep the statistics exact.
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(64))
    metrics = WriteMetrics(reward_key=("next", "reward"))
    gen = torch.Generator().manual_seed(0)
    rewards: list[float] = []
    for step in range(120):
        size = 48 if step == 77 else 1 + step % 9  # 48: folded from its data
        data = TensorDict({"next": {"reward": torch.randn(size, 1, generator=gen)}}, [size])
        if step % 13 == 5:
            rb.extend(data)  # not observed: another writer
            continue
        if step == 50:
            rb.empty()
        metrics.on_post_extend(rb, data, rb.extend(data))
        rewards += data["next", "reward"].flatten().tolist()
        if step == 30:
            metrics = pickle.loads(pickle.dumps(metrics))
        if step == 60:
            metrics.state_dict()
        if step in (40, 77, 119):
            got = metrics.pull()["reward"].finalize()
            assert got == pytest.approx(
                {
                    "reward_mean": statistics.fmean(rewards),
                    "reward_std": statistics.pstdev(rewards),
                    "reward_min": min(rewards),
                    "reward_max": max(rewards),
                }
            ), step
            rewards = []


def test_write_metrics_read_back_with_a_mask():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    metrics = WriteMetrics(reward_key=("next", "reward"))
    kept = []
    for step in range(6):
        reward = torch.arange(8.0).unsqueeze(-1) + 10 * step
        mask = torch.arange(8) % 3 != 0
        data = TensorDict({"next": {"reward": reward}, "collector": {"mask": mask}}, [8])
        metrics.on_post_extend(rb, data, rb.extend(data))
        kept += reward[mask].flatten().tolist()
    assert metrics.pull()["reward"].finalize() == pytest.approx(
        {
            "reward_mean": statistics.fmean(kept),
            "reward_std": statistics.pstdev(kept),
            "reward_min": min(kept),
            "reward_max": max(kept),
        }
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buffer_metrics_add_no_sync_to_writes_and_samples():
    # torchrl's own extend/sample synchronise; the observers must add none (counted, not refused)
    from rl_observers import Every, LoggerObserver

    from .helpers import RecordingLogger

    def data(k):
        reward = torch.full((256, 1), float(k), device="cuda")
        return TensorDict({"obs": torch.randn(256, 4, device="cuda"), ("next", "reward"): reward}, [256])

    def syncs(rb, rounds):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for k in range(rounds):
                    rb.extend(data(k))
                    for _ in range(4):
                        rb.sample(128)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    def buffer():
        return TensorDictReplayBuffer(storage=LazyTensorStorage(100_000, device="cuda"), batch_size=128)

    bare, observed = buffer(), buffer()
    logger = RecordingLogger()
    observer = LoggerObserver(
        logger,
        metrics=[WriteMetrics(reward_key=("next", "reward")), SampleMetrics()],
        schedule=Every.counter("write_count", 10**9),  # no window inside the counted rounds
    )
    observed.add_observer(observer)
    syncs(bare, 3)  # warm-up
    syncs(observed, 3)
    assert syncs(observed, 20) <= syncs(bare, 20)
    observed.remove_observer(observer)  # the window: one transfer, outside the count


def test_sample_age_after_load_state_dict_in_the_middle_of_a_stage():
    # load_state_dict drops the staged window: the cursor runs staged before it must not
    # age the samples staged after it (here a run at cursor 20 would age slot 24 as 45).
    rb = ReplayBuffer(storage=LazyTensorStorage(50))
    metrics = SampleMetrics()
    metrics.bind(rb)
    rb.extend(torch.arange(20))
    state = metrics.state_dict()
    metrics.on_post_sample(rb, None, {"index": torch.tensor([5])})  # a run at cursor 20
    rb.extend(torch.arange(5))  # the cursor moves to 25
    metrics.on_post_sample(rb, None, {"index": torch.tensor([3])})  # a run at cursor 25
    metrics.load_state_dict(state)
    metrics.on_post_sample(rb, None, {"index": torch.tensor([24])})  # the newest item: age 0
    got = metrics.pull()["sample_age"].finalize()
    assert got == pytest.approx({"sample_age_mean": 0, "sample_age_min": 0, "sample_age_max": 0})
