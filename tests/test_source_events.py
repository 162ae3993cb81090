"""Events from real torchrl collectors and replay buffers, in this process."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy

from rl_observers.testing import EventRecorder

STORAGES = {
    "lazy_tensor": lambda tmp: LazyTensorStorage(64),
    "lazy_memmap": lambda tmp: LazyMemmapStorage(64, scratch_dir=tmp),
    "list": lambda tmp: ListStorage(64),
}
BUFFERS = {
    "ReplayBuffer": lambda storage: ReplayBuffer(storage=storage),
    "TensorDictReplayBuffer": lambda storage: TensorDictReplayBuffer(storage=storage),
    "PrioritizedReplayBuffer": lambda storage: PrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=storage
    ),
    "TensorDictPrioritizedReplayBuffer": lambda storage: TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=storage
    ),
}


def _rows(n, start=0):
    return TensorDict(
        obs=torch.arange(start, start + n, dtype=torch.float32).unsqueeze(-1),
        reward=torch.ones(n, 1),
        batch_size=[n],
    )


@pytest.mark.parametrize("storage_name", sorted(STORAGES))
@pytest.mark.parametrize("buffer_name", sorted(BUFFERS))
def test_replay_buffer_events_and_payloads(buffer_name, storage_name, tmp_path):
    rb = BUFFERS[buffer_name](STORAGES[storage_name](tmp_path))
    recorder = EventRecorder(keep_payloads=True)
    rb.add_observer(recorder)
    data = _rows(10)
    index = rb.extend(data)
    single = _rows(1, start=10)[0]
    added = rb.add(single)
    batch, info = rb.sample(4, return_info=True)
    plain = rb.sample(3)
    rb.empty()
    assert recorder.events == ["post_extend", "post_add", "post_sample", "post_sample", "empty"]
    extended_data, extended_index = recorder.payloads[0]
    assert extended_data is data and extended_index is index
    added_data, added_index = recorder.payloads[1]
    assert added_data is single and added_index is added
    sampled, sampled_info = recorder.payloads[2]
    assert sampled is batch
    assert isinstance(sampled_info, dict) and "index" in sampled_info
    # the info dict arrives even when the caller did not ask for it
    sampled_plain, plain_info = recorder.payloads[3]
    assert sampled_plain is plain and "index" in plain_info
    assert recorder.sizes[2] == 4


def test_replay_buffer_shutdown_is_emitted_once():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    recorder = EventRecorder()
    rb.add_observer(recorder)
    rb.shutdown()
    rb.shutdown()
    assert recorder.events == ["shutdown"]


def test_collector_events_iterator(counting_env, make_collector):
    collector = make_collector(counting_env, frames_per_batch=8, total_frames=32)
    recorder = EventRecorder(keep_payloads=True)
    collector.add_observer(recorder)
    yielded = list(collector)
    collector.shutdown()
    collector.shutdown()
    assert recorder.events == ["pre_collect", "post_collect"] * 4 + ["shutdown"]
    batches = [p[0] for p in recorder.payloads if p]
    assert all(a is b for a, b in zip(batches, yielded))


def test_collector_with_gymnasium_cartpole(make_collector):
    env = GymEnv("CartPole-v1")
    collector = make_collector(env, frames_per_batch=50, total_frames=200)
    recorder = EventRecorder()
    collector.add_observer(recorder)
    frames = sum(batch.numel() for batch in collector)
    assert frames == 200
    assert recorder.count("post_collect") == 4
    assert sum(s for s in recorder.sizes if s) == 200


def test_collector_writing_into_observed_replay_buffer(counting_env, make_collector):
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    collector = make_collector(counting_env, frames_per_batch=10, total_frames=40, replay_buffer=rb)
    on_collector, on_buffer = EventRecorder(), EventRecorder()
    collector.add_observer(on_collector)
    rb.add_observer(on_buffer)
    for out in collector:
        assert out is None
    assert on_collector.count("post_collect") == 4
    assert on_buffer.events == ["post_extend"] * 4
    assert sum(on_buffer.sizes) == len(rb) == 40


@pytest.mark.timeout(60)
def test_started_collector_is_observed(counting_env):
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    collector = Collector(
        counting_env,
        RandomPolicy(counting_env.action_spec),
        frames_per_batch=10,
        total_frames=-1,
        replay_buffer=rb,
    )
    on_collector, on_buffer = EventRecorder(), EventRecorder()
    collector.add_observer(on_collector)
    rb.add_observer(on_buffer)
    collector.start()
    deadline = time.monotonic() + 30
    while len(rb) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    collector.async_shutdown()
    assert len(rb) >= 100
    assert on_buffer.count("post_extend") * 10 == rb.write_count
    assert on_collector.count("post_collect") == on_buffer.count("post_extend")
    assert on_collector.events[-1] == "shutdown"


def test_user_hooks_and_observers_coexist(counting_env, make_collector):
    collector = make_collector(counting_env, frames_per_batch=8, total_frames=32)
    log = []
    collector.pre_collect_hook = lambda: log.append("user_pre")
    recorder = EventRecorder()
    handle = collector.add_observer(recorder)
    collector.post_collect_hook = lambda batch: log.append("user_post")  # after: no eviction
    it = iter(collector)
    next(it)
    assert log == ["user_pre", "user_post"] and recorder.events == ["pre_collect", "post_collect"]
    handle.remove()  # the user's hooks stay
    next(it)
    assert log == ["user_pre", "user_post"] * 2 and len(recorder.events) == 2
    assert collector.post_collect_hook is not None
    collector.post_collect_hook = None
    collector.add_observer(recorder)  # observers added mid-iteration apply from the next batch
    next(it)
    assert recorder.events[-1] == "post_collect"


def test_observers_do_not_change_data(tmp_path):
    """Same seeded collection, writes and sampling with and without observers."""

    class ReadsEverything:
        def __init__(self):
            self.total = 0.0

        def _read(self, td):
            if isinstance(td, TensorDict) or hasattr(td, "items"):
                for value in td.values(True, True):
                    self.total += float(value.float().sum())

        def on_post_collect(self, source, batch):
            self._read(batch)

        def on_post_extend(self, source, data, index):
            self._read(data)

        def on_post_sample(self, source, batch, info):
            self._read(batch)

    def run(observe):
        torch.manual_seed(0)
        env = GymEnv("CartPole-v1")
        env.set_seed(0)
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(1000))
        rb.set_rng(torch.Generator().manual_seed(1))
        collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=150)
        if observe:
            for target in (collector, rb):
                target.add_observer(ReadsEverything())
                target.add_observer(EventRecorder())
        batches, samples = [], []
        for batch in collector:
            batches.append(batch.clone())
            rb.extend(batch)
            samples.append(rb.sample(32).clone())
        collector.shutdown()
        return batches, samples, rb, torch.random.get_rng_state()

    plain = run(False)
    observed = run(True)
    assert len(plain[0]) == len(observed[0]) == 3
    for a, b in zip(plain[0] + plain[1], observed[0] + observed[1]):
        assert (a == b).all()
    assert (plain[2][:] == observed[2][:]).all()  # storage contents
    assert torch.equal(plain[2]._rng.get_state(), observed[2]._rng.get_state())
    slots = torch.arange(len(plain[2]))
    priorities = plain[2]._sampler._sum_tree[slots], observed[2]._sampler._sum_tree[slots]
    assert torch.equal(*priorities)
    assert torch.equal(plain[3], observed[3])  # global RNG


@pytest.mark.timeout(60)
def test_threads_extending_and_sampling_lose_no_event():
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    rb.extend(torch.arange(100))
    recorder = EventRecorder()
    rb.add_observer(recorder)
    per_thread = 200

    def writer():
        for _ in range(per_thread):
            rb.extend(torch.arange(5))

    def sampler():
        for _ in range(per_thread):
            rb.sample(8)

    threads = [threading.Thread(target=f) for f in (writer, writer, sampler, sampler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert recorder.count("post_extend") == 2 * per_thread
    assert recorder.count("post_sample") == 2 * per_thread
    assert rb.write_count == 100 + 2 * per_thread * 5


def test_observed_buffer_pickles_with_its_observers():
    rb = ReplayBuffer(storage=LazyTensorStorage(16))
    rb.add_observer(EventRecorder())
    clone = pickle.loads(pickle.dumps(rb))
    (copied,) = clone.observers
    assert isinstance(copied, EventRecorder)
    clone.extend(torch.arange(3))
    assert copied.events == ["post_extend"]
    assert rb.observers[0].events == []


def _extend_in_child(rb, queue):
    rb.extend(_rows(4))
    rb.sample(2)
    (recorder,) = rb.observers
    queue.put((recorder.events, recorder.pid, type(rb).__name__))


@pytest.mark.timeout(120)
def test_observed_buffer_travels_to_a_spawned_process():
    ctx = mp.get_context("spawn")
    rb = ReplayBuffer(storage=LazyTensorStorage(16), shared=True)
    rb.extend(_rows(4))  # a shared storage is initialised before it travels
    rb.add_observer(EventRecorder())
    queue = ctx.Queue()
    proc = ctx.Process(target=_extend_in_child, args=(rb, queue))
    proc.start()
    events, pid, name = queue.get(timeout=100)
    proc.join(timeout=20)
    assert events == ["post_extend", "post_sample"]
    assert pid == proc.pid
    assert name == "ReplayBuffer"
