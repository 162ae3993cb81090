"""Observers where the data lives: multiprocessing workers, shared buffers, Ray actors.

Real worker processes (``fork`` and ``spawn``) and a real local Ray cluster.
Observer copies cannot be read back from their processes, so the observers of
these tests (``tests/remote/_remote_observers.py``) append one line per event to a
file, with the process and worker they ran in.

Which counter means what:

* multiprocessing collectors: the frames the workers' observers saw are the
  frames the driver received (``collector.stats()["frames"]``) when iterating;
  a collector running free after ``start()`` may drop a rollout that a control
  message interrupted, so its observers may see more frames than were written.
* asynchronous ``RayCollector``: each remote collector prefetches one batch
  that the driver discards when it stops, so the sources' observers see
  ``num_collectors`` more batches than the driver received.
* shared replay buffers: the buffer's observers in the workers see exactly
  the items counted by ``rb.write_count``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers import Every, LoggerObserver, MetricsChannel, SampleMetrics, WriteMetrics
from rl_observers.remote.shipping import RemoteAttachError, attach_here, detach_here, kind_of
from rl_observers.sources.observed import observed_class
from rl_observers.sources.placement import SourceInfo, source_info
from tests.helpers import (
    CountingHandle,
    counting_rpcs,
    make_multi,
    scalars,
    wait_for,
)

HERE = Path(__file__).parent
# the user hooks torchrl hands to Ray travel by value: the module the ``helpers`` fixture imports
RAY_BY_VALUE = ("helpers",)
DRIVER = os.getpid()


# -- fixtures and helpers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helpers() -> Iterator[Any]:
    """The recording observers, importable by name in ``spawn`` workers, shipped by value to Ray."""
    sys.path.insert(0, str(HERE))
    module = importlib.import_module("_remote_observers")
    cloudpickle.register_pickle_by_value(module)
    try:
        yield module
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        with contextlib.suppress(ValueError):
            sys.path.remove(str(HERE))


def totals(lines: list[Any], tag: str, event: str) -> Counter[int]:
    """Sum of the counts of ``tag``'s ``event`` lines, per worker index."""
    out: Counter[int] = Counter()
    for line in lines:
        if line.tag == tag and line.event == event:
            out[line.worker] += line.count
    return out


def events(lines: list[Any], tag: str, event: str) -> Counter[int]:
    """Number of ``tag``'s ``event`` lines, per worker index."""
    return Counter(line.worker for line in lines if line.tag == tag and line.event == event)


def remote_lines(lines: list[Any]) -> list[Any]:
    return [line for line in lines if line.pid != DRIVER]


# -- multiprocessing collectors --------------------------------------------------------------------


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multisync_observers_run_in_every_worker(helpers, tmp_path, method):
    log = tmp_path / "events.txt"
    # 5 batches of 20 frames: 10 frames from each of the 2 workers per batch.
    collector = make_multi(MultiSyncCollector, method, frames_per_batch=20, total_frames=100)
    kept = helpers.CollectorLog(log, "kept")
    removed = helpers.CollectorLog(log, "removed")
    late = helpers.CollectorLog(log, "late")
    try:
        collector.pre_collect_hook = helpers.HookLog(log, "user_pre")  # set before the observers
        handle = collector.add_observer(kept)
        collector.add_observer(removed)
        collector.post_collect_hook = helpers.HookLog(log, "user_post")  # set after: evicts nothing
        assert collector.observers == (kept, removed)
        received = 0
        for i, batch in enumerate(collector):
            received += batch.numel()
            if i == 1:  # between two batches
                collector.remove_observer(removed)
                collector.add_observer(late)
                assert collector.observers == (kept, late)
        frames = collector.stats()["frames"]
    finally:
        collector.shutdown()

    lines = helpers.read_lines(log)
    kept_lines = [line for line in lines if line.tag == "kept"]
    pids = {line.pid for line in kept_lines}
    assert len(pids) == 2 and DRIVER not in pids
    assert {(line.worker, line.num_workers, line.remote) for line in kept_lines} == {(0, 2, True), (1, 2, True)}
    # every frame the driver received was seen by the observer of the worker that made it
    assert received == frames == 100
    assert totals(lines, "kept", "post_collect") == {0: 50, 1: 50}
    assert events(lines, "kept", "pre_collect") == {0: 5, 1: 5}
    assert events(lines, "removed", "post_collect") == {0: 2, 1: 2}
    assert events(lines, "late", "post_collect") == {0: 3, 1: 3}
    # the user's hooks ran in the same workers, on every batch, next to the observers
    hook_pids = Counter(line.pid for line in lines if line.tag == "user_pre")
    assert set(hook_pids) == pids and set(hook_pids.values()) == {5}
    assert sum(line.count for line in lines if line.tag == "user_post") == 100
    # closing the workers emitted shutdown in each, once, for the observers still attached
    assert events(lines, "kept", "shutdown") == {0: 1, 1: 1}
    assert events(lines, "late", "shutdown") == {0: 1, 1: 1}
    assert events(lines, "removed", "shutdown") == {}
    # the driver's originals never ran: copies did
    assert kept.events_seen == 0
    handle.remove()  # after shutdown: only the driver's record is dropped
    assert collector.observers == (late,)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_buffer_observers_see_writes_from_every_process(helpers, tmp_path, method):
    log = tmp_path / "events.txt"
    rb = ReplayBuffer(storage=LazyTensorStorage(200_000), shared=True)
    before = helpers.BufferLog(log, "before")
    rb.add_observer(before)  # travels to the workers with the buffer
    collector = make_multi(
        MultiAsyncCollector, method, frames_per_batch=20, total_frames=-1, replay_buffer=rb
    )

    def worker_items(tag: str) -> int:
        return sum(totals(remote_lines(helpers.read_lines(log)), tag, "post_extend").values())

    try:
        collector.start()
        assert wait_for(lambda: rb.write_count >= 200, timeout=60)
        with collector.pause():
            first = rb.write_count
            assert worker_items("before") == first
            after = helpers.BufferLog(log, "after")
            rb.add_observer(after)  # propagated to the buffer copies in the running workers
        watcher = helpers.CollectorLog(log, "watcher")
        collector.add_observer(watcher)  # while the collector runs free
        collector.post_collect_hook = helpers.HookLog(log, "user_post")  # and a user hook next to it
        assert wait_for(lambda: worker_items("after") >= 400 and len(events(helpers.read_lines(log), "watcher", "post_collect")) == 2, timeout=60)
        with collector.pause():
            second = rb.write_count
            assert worker_items("before") == second
            assert worker_items("after") == second - first
            rb.remove_observer(before)  # removed from every copy too
        assert rb.observers == (after,)
        assert wait_for(lambda: rb.write_count >= second + 200, timeout=60)
        with collector.pause():
            third = rb.write_count
            assert worker_items("before") == second
            assert worker_items("after") == third - first
    finally:
        collector.shutdown()

    lines = helpers.read_lines(log)
    workers = remote_lines(lines)
    assert {line.worker for line in workers if line.tag in ("before", "after")} == {0, 1}
    assert all(line.remote for line in workers)
    # both workers collected for the watcher and ran the user's hook; at least what was written
    assert set(events(lines, "watcher", "post_collect")) == {0, 1}
    assert sum(line.count for line in lines if line.tag == "user_post") > 0
    assert events(lines, "watcher", "shutdown") == {0: 1, 1: 1}
    # on the driver, torchrl initialises the lazy storage with one fake write, then empties it:
    # not data, so no event
    driver = [(line.tag, line.event) for line in lines if line.pid == DRIVER]
    assert driver == []


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_iterated_multiasync_refuses_observers(helpers, tmp_path):
    collector = make_multi(MultiAsyncCollector, "fork", frames_per_batch=10, total_frames=60)
    try:
        batches = iter(collector)
        next(batches)
        with pytest.raises(RuntimeError, match="while it is being iterated"):
            collector.add_observer(helpers.CollectorLog(tmp_path / "log.txt", "late"))
        assert collector.observers == ()
        assert sum(batch.numel() for batch in batches) == 50  # the collection went on untouched
    finally:
        collector.shutdown()


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_profiler_user_hook_and_observers_coexist_in_workers(helpers, tmp_path):
    log = tmp_path / "events.txt"
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=100)
    try:
        collector.post_collect_hook = helpers.HookLog(log, "user_post")
        observer = helpers.CollectorLog(log, "observer")
        collector.add_observer(observer)
        collector.enable_profile(
            workers=[0],
            num_rollouts=2,
            warmup_rollouts=1,
            activities=["cpu"],
            with_stack=False,
            save_path=str(tmp_path / "trace_{worker_idx}.json"),
        )
        for _ in collector:
            pass
        collector.disable_profile()
        assert collector.observers == (observer,)
    finally:
        collector.shutdown()
    lines = helpers.read_lines(log)
    assert events(lines, "observer", "post_collect") == {0: 5, 1: 5}
    assert sorted(Counter(line.pid for line in lines if line.tag == "user_post").values()) == [5, 5]
    assert sorted(p.name for p in tmp_path.glob("trace_*.json")) == ["trace_0.json"]


class _Unpicklable:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def on_post_collect(self, source, batch):
        pass


class _UnpicklableBufferObserver:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def on_post_extend(self, source, data, index):
        pass


class _SamplesOnly:
    def on_post_sample(self, source, batch, info):
        pass


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_attach_errors_are_raised_on_the_driver(helpers, tmp_path):
    log = tmp_path / "events.txt"
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=60)
    try:
        with pytest.raises(TypeError, match="must be picklable"):
            collector.add_observer(_Unpicklable())
        with pytest.raises(TypeError, match="none of which a collector emits"):
            collector.add_observer(_SamplesOnly())
        # raising in a worker would kill it: the driver would never see the observer's error
        with pytest.raises(ValueError, match="on_error='raise' cannot be honoured .* MultiSyncCollector"):
            collector.add_observer(helpers.CollectorLog(log, "raising"), on_error="raise")
        with pytest.raises(RemoteAttachError, match="worker 1 refuses this observer"):
            collector.add_observer(helpers.FailsToAttach(log, "failing", failing_worker=1))
        with pytest.raises(ValueError, match="not attached"):
            collector.remove_observer(_SamplesOnly())
        # a plain callable, the one-line migration from post_collect_hook, runs in the workers too
        path = str(log)
        plain = lambda batch: open(path, "a").write(f"plain post_collect {os.getpid()} None None True {batch.numel()}\n")  # noqa: E731
        collector.add_observer(plain)
        with pytest.raises(ValueError, match="already attached"):
            collector.add_observer(plain)
        assert collector.observers == (plain,)
        assert sum(batch.numel() for batch in collector) == 60  # the workers survived it all
    finally:
        collector.shutdown()
    lines = helpers.read_lines(log)
    assert [line for line in lines if line.tag == "failing"] == []  # undone in worker 0 as well
    plain_pids = Counter(line.pid for line in lines if line.tag == "plain")
    assert len(plain_pids) == 2 and DRIVER not in plain_pids and set(plain_pids.values()) == {3}
    with pytest.raises(RuntimeError, match="shut down"):
        collector.add_observer(helpers.CollectorLog(log, "too_late"))
    # a LoggerObserver refused there leaves its namespace free on the logger
    logger = CSVLogger(exp_name="refused", log_dir=str(tmp_path))
    refused = LoggerObserver(logger)
    with pytest.raises(RuntimeError, match="shut down"):
        collector.add_observer(refused)
    other = Collector(CountingEnv(), None, frames_per_batch=10, total_frames=10)
    other.add_observer(LoggerObserver(logger))  # the same default namespace: accepted
    other.shutdown()
    MetricsChannel.for_logger(logger).close(10)


@pytest.mark.real_collector
def test_on_error_raise_is_refused_for_a_buffer_written_in_workers():
    # Its copies run in the workers, where "raise" would kill them: refused when the buffer is
    # shared, or when a collector is about to start workers writing into it.
    class Writes:
        def on_post_extend(self, source, data, index):
            pass

    shared = ReplayBuffer(storage=LazyTensorStorage(100), shared=True)
    with pytest.raises(ValueError, match="on_error='raise' cannot be honoured for an observer of a shared"):
        shared.add_observer(Writes(), on_error="raise")
    assert shared.observers == ()
    local = ReplayBuffer(storage=LazyTensorStorage(100))
    observer = Writes()
    local.add_observer(observer, on_error="raise")  # no worker writes into it yet: accepted
    with pytest.raises(ValueError, match="Use on_error='warn'"):
        MultiSyncCollector(
            [CountingEnv] * 2,
            RandomPolicy(CountingEnv().action_spec),
            frames_per_batch=8,
            total_frames=16,
            replay_buffer=local,
        )
    local.remove_observer(observer)
    local.add_observer(observer)  # "warn": the collector starts
    collector = MultiSyncCollector(
        [CountingEnv] * 2,
        RandomPolicy(CountingEnv().action_spec),
        frames_per_batch=8,
        total_frames=16,
        replay_buffer=local,
    )
    collector.shutdown()


# -- replay buffers inside a Ray actor, without Ray ------------------------------------------------

_BUFFERS = {
    "ReplayBuffer": (ReplayBuffer, {}),
    "TensorDictReplayBuffer": (TensorDictReplayBuffer, {}),
    "PrioritizedReplayBuffer": (PrioritizedReplayBuffer, {"alpha": 0.7, "beta": 0.5}),
    "PrioritizedReplayBuffer-async": (PrioritizedReplayBuffer, {"alpha": 0.7, "beta": 0.5, "sync": False}),
    "TensorDictPrioritizedReplayBuffer": (TensorDictPrioritizedReplayBuffer, {"alpha": 0.7, "beta": 0.5}),
    "TensorDictPrioritizedReplayBuffer-async": (
        TensorDictPrioritizedReplayBuffer,
        {"alpha": 0.7, "beta": 0.5, "sync": False},
    ),
}


class _Record:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_post_add(self, source, data, index):
        self.seen.append(("add", 1))

    def on_post_extend(self, source, data, index):
        self.seen.append(("extend", len(index)))

    def on_post_sample(self, source, batch, info):
        self.seen.append(("sample", len(batch)))


@pytest.mark.parametrize("name", list(_BUFFERS))
def test_actor_side_buffers_emit_once_per_public_call(name):
    """Calls the public methods the way a Ray actor does: the class's own functions."""
    cls, kwargs = _BUFFERS[name]
    rb = cls(storage=LazyTensorStorage(100), batch_size=4, **kwargs)
    attach_here(rb, cloudpickle.dumps(_Record()), "raise", 7, None, None, "ray_actor")
    assert type(rb) is observed_class(cls, "ray_actor")
    assert type(rb) is not observed_class(cls)  # the in-process classes are another family
    (copy,) = rb.observers
    cls.extend(rb, TensorDict({"a": torch.arange(10)}, [10]))
    cls.add(rb, TensorDict({"a": torch.tensor(3)}, []))
    cls.sample(rb)
    assert copy.seen == [("extend", 10), ("add", 1), ("sample", 4)]
    assert source_info(rb) == SourceInfo("replay_buffer", None, None, os.getpid(), True)
    detach_here(rb, 7)
    assert type(rb) is cls and rb.observers == ()


def test_kinds():
    env = CountingEnv()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=4, total_frames=4)
    assert kind_of(collector) is None and kind_of(ReplayBuffer()) is None
    assert source_info(collector) == SourceInfo("collector", None, None, DRIVER, False)
    collector.shutdown()


# -- Ray -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("buffer_cls", [ReplayBuffer, TensorDictReplayBuffer])
def test_ray_replay_buffer_observers_run_in_its_actor(ray_cluster, helpers, tmp_path, buffer_cls):
    from torchrl.data import RayReplayBuffer

    log = tmp_path / "events.txt"
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 1000),
        batch_size=8,
        replay_buffer_cls=buffer_cls,
        remote_config={"num_cpus": 0},
    )
    data = TensorDict({"obs": torch.arange(10)}, [10])
    try:
        rb.extend(data)
        with counting_rpcs(rb) as bare:
            for _ in range(20):
                rb.extend(data)
            rb.add(TensorDict({"obs": torch.tensor(1)}, []))
            for _ in range(5):
                rb.sample()
            rb.stats()
        with pytest.raises(TypeError, match="must be picklable"):
            rb.add_observer(_UnpicklableBufferObserver())
        with pytest.raises(RemoteAttachError, match="refuses this observer"):
            rb.add_observer(helpers.BufferRefusesToAttach(log, "refused"))
        assert type(rb) is RayReplayBuffer and rb.observers == ()
        observer = helpers.BufferLog(log, "rb")
        handle = rb.add_observer(observer)
        assert rb.observers == (observer,)
        with counting_rpcs(rb) as observed:
            for _ in range(20):
                rb.extend(data)
            rb.add(TensorDict({"obs": torch.tensor(1)}, []))
            for _ in range(5):
                rb.sample()
            stats = rb.stats()
        # no extra call per write or sample; stats stays one round trip, now with the observer's entries
        assert bare == Counter(extend=20, add=1, sample=5, stats=1)
        assert observed == Counter(extend=20, add=1, sample=5, __ray_call__=1)
        assert stats["rb/items_written"] == 201 and stats["write_count"] == 10 + 2 * 201
        lines = helpers.read_lines(log)
        assert {(line.worker, line.remote) for line in lines} == {(None, True)}
        assert len({line.pid for line in lines}) == 1 and lines[0].pid != DRIVER
        assert [line.count for line in lines if line.event == "post_extend"] == [10] * 20
        assert [line.event for line in lines].count("post_add") == 1
        assert [line.count for line in lines if line.event == "post_sample"] == [8] * 5
        rb.empty()
        assert helpers.read_lines(log)[-1].event == "empty" and rb.stats()["write_count"] == 0
        handle.remove()
        assert type(rb) is RayReplayBuffer and rb.observers == ()
        rb.extend(data)
        assert len(helpers.read_lines(log)) == len(lines) + 1  # only the empty
        assert "rb/items_written" not in rb.stats()
        # in the actor, "raise" reaches the caller (Ray forwards the error; the actor lives on)
        raising = rb.add_observer(helpers.RaisesOnSample(), on_error="raise")
        with pytest.raises(RuntimeError, match="refuses this sample"):
            rb.sample()
        raising.remove()
        assert len(rb.sample()) == 8
        rb.add_observer(helpers.BufferLog(log, "closing"))
    finally:
        rb.close()
    assert [(line.tag, line.event) for line in helpers.read_lines(log)][-1] == ("closing", "shutdown")
    with pytest.raises(RuntimeError, match="closed"):
        rb.add_observer(helpers.BufferLog(log, "too_late"))


@contextlib.contextmanager
def counting_client_rpcs(client: Any) -> Iterator[Counter[str]]:
    """Counts every call ``client`` (from ``rb.client()``) makes to its buffer's actor."""
    counts: Counter[str] = Counter()
    handle = client._actor
    client._actor = CountingHandle(handle, counts)
    try:
        yield counts
    finally:
        client._actor = handle


def rewards(value: float, n: int) -> TensorDict:
    return TensorDict({"reward": torch.full((n,), value)}, [n])


# Nothing is logged before the observer goes: the rows come from its last window.
_NO_ROW = Every.counter("items_written", 10**12)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_replay_buffer_client_stats_carry_the_observers_entries(ray_cluster, helpers, tmp_path):
    """``client.stats()`` is the buffer's: torchrl's entries and the observers', in one call, in any process."""
    from torchrl.data import RayReplayBuffer
    from torchrl.data.replay_buffers.ray_buffer import _RayReplayBufferClient

    logger = CSVLogger(exp_name="client_stats", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100),
        batch_size=4,
        replay_buffer_cls=TensorDictReplayBuffer,
        remote_config={"num_cpus": 0},
    )

    @ray_cluster.remote(num_cpus=0)
    def use_elsewhere(client: Any) -> tuple[dict[str, Any], bool]:
        client.extend(rewards(3.0, 10))
        client.sample()
        return client.stats(), hasattr(client, "add_observer")

    try:
        assert type(rb.client()) is _RayReplayBufferClient  # no observer: torchrl's own client
        logged = LoggerObserver(
            channel, name="rb", schedule=_NO_ROW, metrics=[WriteMetrics(reward_key="reward"), SampleMetrics()]
        )
        handles = [rb.add_observer(logged), rb.add_observer(helpers.BufferLog(tmp_path / "events.txt", "log"))]
        client, sent = rb.clients(2)
        assert isinstance(client, _RayReplayBufferClient) and repr(type(client)) == repr(_RayReplayBufferClient)
        with counting_client_rpcs(client) as writes_and_samples:
            client.extend(rewards(1.0, 10))
            client.add(TensorDict({"reward": torch.tensor(2.0)}, []))
            client.sample()
        assert writes_and_samples == Counter(extend=1, add=1, sample=1)  # torchrl's calls, no extra one
        with counting_client_rpcs(client) as counts:
            stats = client.stats()
        assert {key: stats[key] for key in ("size", "write_count", "initialized", "capacity")} == {
            "size": 11,
            "write_count": 11,
            "initialized": True,
            "capacity": 100,
        }
        assert (stats["writes"], stats["items_written"], stats["log/items_written"]) == (2, 11, 11)
        assert (stats["sample_calls"], stats["samples_returned"]) == (1, 4)
        assert stats.keys() == rb.stats().keys()
        assert counts == Counter(__ray_call__=1)  # the same single call as rb.stats()
        # a client pickled into another Ray process: its writes, samples and stats() reach them too
        remote_stats, can_attach = ray_cluster.get(use_elsewhere.remote(sent))
        assert (remote_stats["writes"], remote_stats["items_written"], remote_stats["log/items_written"]) == (3, 21, 21)
        assert (remote_stats["sample_calls"], remote_stats["write_count"]) == (2, 21)
        # observers are attached to the buffer: a client refuses, instead of attaching one in the actor
        assert not can_attach
        with pytest.raises(AttributeError, match="attach observers to the RayReplayBuffer itself"):
            client.add_observer(helpers.BufferLog(tmp_path / "events.txt", "refused"))
        for handle in handles:
            handle.remove()
        # no observer left: torchrl's answer (still one call), and new clients are torchrl's again
        assert "items_written" not in client.stats() and client.stats()["write_count"] == 21
        assert type(rb.client()) is _RayReplayBufferClient
    finally:
        rb.close()
    assert channel.close(timeout=60)
    assert scalars(logger, "rb/items_written")[-1][1] == 21
    assert scalars(logger, "rb/sample_calls")[-1][1] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_replay_buffer_client_empty_emits_empty(ray_cluster, helpers, tmp_path):
    """``client.empty()`` emits ``empty`` in the actor once, so WriteMetrics folds the rows it kept pending."""
    from torchrl.data import RayReplayBuffer

    logger = CSVLogger(exp_name="client_empty", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    log = tmp_path / "events.txt"
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100),
        batch_size=4,
        replay_buffer_cls=TensorDictReplayBuffer,
        remote_config={"num_cpus": 0},
    )

    @ray_cluster.remote(num_cpus=0)
    def empty_elsewhere(client: Any) -> int:
        client.extend(rewards(3.0, 10))  # pending again, in slots 0-9 of the emptied storage
        client.empty(empty_write_count=False)
        return client.write_count

    try:
        # a long report interval: the actor's copy keeps every window until it is removed
        rb.add_observer(
            LoggerObserver(
                channel,
                name="rb",
                schedule=_NO_ROW,
                report_interval=3600,
                metrics=[WriteMetrics(reward_key="reward")],
            )
        )
        rb.add_observer(helpers.BufferLog(log, "log"))
        client, sent = rb.clients(2)
        # after a first write (folded from its data), a round-robin writer's rows wait in the
        # storage: their rewards are read at a window's end, or at empty() before later writes
        # overwrite them
        client.extend(rewards(0.0, 10))
        client.extend(rewards(1.0, 10))  # pending, in slots 10-19
        with counting_client_rpcs(client) as counts:
            client.empty()
        assert [line.event for line in helpers.read_lines(log)] == ["post_extend", "post_extend", "empty"]
        assert counts == Counter(__ray_call__=1)  # the same single call as rb.empty()
        assert rb.stats()["write_count"] == 0 and len(client) == 0
        client.extend(rewards(5.0, 30))  # slots 0-29: overwrites the 1.0 rewards
        assert ray_cluster.get(empty_elsewhere.remote(sent)) == 40
        events = [line.event for line in helpers.read_lines(log)]
        assert events == ["post_extend", "post_extend", "empty", "post_extend", "post_extend", "empty"]
    finally:
        rb.close()
    assert channel.close(timeout=60)
    # every written reward once: 10 x 0.0, 10 x 1.0, 30 x 5.0, 10 x 3.0
    assert scalars(logger, "rb/items_written")[-1][1] == 60
    assert scalars(logger, "rb/reward_min")[-1][1] == 0.0
    assert scalars(logger, "rb/reward_max")[-1][1] == 5.0
    assert scalars(logger, "rb/reward_mean")[-1][1] == pytest.approx((10 * 1.0 + 30 * 5.0 + 10 * 3.0) / 60)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_ray_collector_observers_run_in_each_remote_collector(ray_cluster, helpers, tmp_path, sync):
    from torchrl.collectors.distributed import RayCollector

    log = tmp_path / "events.txt"
    env = CountingEnv()
    # async: one 10-frame batch from either actor per iteration; sync: 10 frames from each
    frames_per_batch = 20 if sync else 10
    with warnings.catch_warnings():  # a non-module policy has no weights to synchronise
        warnings.simplefilter("ignore", UserWarning)
        collector = RayCollector(
            [CountingEnv, CountingEnv],
            RandomPolicy(env.action_spec),
            frames_per_batch=frames_per_batch,
            total_frames=100,
            sync=sync,
            remote_configs={"num_cpus": 1},
            post_collect_hook=helpers.HookLog(log, "user_post"),  # forwarded to the actors by torchrl
        )
    kept = helpers.CollectorLog(log, "kept")
    removed = helpers.CollectorLog(log, "removed")
    try:
        # raising in a remote collector kills the actor: the driver would see ActorDiedError only
        with pytest.raises(ValueError, match="on_error='raise' cannot be honoured .* RayCollector"):
            collector.add_observer(helpers.CollectorLog(log, "raising"), on_error="raise")
        collector.add_observer(kept)
        handle = collector.add_observer(removed)
        assert collector.observers == (kept, removed)
        received = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for i, batch in enumerate(collector):
                received += batch.numel()
                if i == 1:
                    handle.remove()  # reaches each actor after its batch in flight
                    assert collector.observers == (kept,)
    finally:
        collector.shutdown()

    lines = helpers.read_lines(log)
    kept_lines = [line for line in lines if line.tag == "kept"]
    pids = {line.pid for line in kept_lines}
    assert len(pids) == 2 and DRIVER not in pids
    assert {(line.worker, line.num_workers, line.remote) for line in kept_lines} == {(0, 2, True), (1, 2, True)}
    # observers get what the driver received; async: each remote collector also prefetched one
    # 10-frame batch that the driver never received, which the user's hook saw and they did not
    assert received == 100
    assert sum(totals(lines, "kept", "post_collect").values()) == received
    prefetched = 0 if sync else 1
    posts = events(lines, "kept", "post_collect")
    assert events(lines, "kept", "pre_collect") == {worker: n + prefetched for worker, n in posts.items()}
    hooks = Counter(line.pid for line in lines if line.tag == "user_post")
    observed = Counter(line.pid for line in kept_lines if line.event == "post_collect")
    assert hooks == {pid: n + prefetched for pid, n in observed.items()}
    removed_batches = sum(events(lines, "removed", "post_collect").values())
    assert 0 < removed_batches < sum(events(lines, "kept", "post_collect").values())
    # the actors emitted shutdown before torchrl killed them
    assert events(lines, "kept", "shutdown") == {0: 1, 1: 1}
    assert events(lines, "removed", "shutdown") == {}
    assert type(collector) is not RayCollector  # still observed: only the driver's record remains
    with pytest.raises(RuntimeError, match="without remote collectors"):
        collector.add_observer(helpers.CollectorLog(log, "too_late"))


def _observers_in_actor(collector: Any) -> list[tuple[str, str]]:
    observers = collector._rl_observers
    return [(entry.observer.tag, entry.on_error) for entry in observers.entries]


def _one_actor_ray_collector(total_frames):
    """An async RayCollector with one actor, 10-frame batches."""
    from torchrl.collectors.distributed import RayCollector

    env = CountingEnv()
    with warnings.catch_warnings():  # a non-module policy has no weights to synchronise
        warnings.simplefilter("ignore", UserWarning)
        return RayCollector(
            [CountingEnv], RandomPolicy(env.action_spec), frames_per_batch=10,
            total_frames=total_frames, sync=False, remote_configs={"num_cpus": 0.5},
        )


def _add_one_actor(collector):
    """torchrl's add_collectors with one more actor built like the first."""
    collector.add_collectors(
        [CountingEnv], 1, collector.policy, [dict(collector.collector_kwargs[0])], [{"num_cpus": 0.5}]
    )


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ray_collectors_added_later_get_every_attached_observer(ray_cluster, helpers, tmp_path):
    log = tmp_path / "events.txt"
    collector = _one_actor_ray_collector(total_frames=80)
    first, removed, last = (helpers.CollectorLog(log, tag) for tag in ("first", "removed", "last"))
    try:
        collector.add_observer(first)
        collector.add_observer(removed)
        collector.add_observer(last, on_error="ignore")
        _add_one_actor(collector)
        assert len(collector.remote_collectors) == 2
        assert collector.observers == (first, removed, last)
        in_actors = ray_cluster.get([a.__ray_call__.remote(_observers_in_actor) for a in collector.remote_collectors])
        expected = [("first", "warn"), ("removed", "warn"), ("last", "ignore")]
        assert in_actors == [expected, expected]
        collector.remove_observer(removed)  # reaches the added actor too
        in_actors = ray_cluster.get([a.__ray_call__.remote(_observers_in_actor) for a in collector.remote_collectors])
        assert in_actors == [expected[::2], expected[::2]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            received = sum(batch.numel() for batch in collector)
    finally:
        collector.shutdown()
    lines = helpers.read_lines(log)
    assert received == 80
    assert not [line for line in lines if line.tag == "removed"]
    by_pid = {}
    for line in lines:
        by_pid.setdefault(line.pid, []).append((line.tag, line.event))
    assert len(by_pid) == 2 and DRIVER not in by_pid
    for seen in by_pid.values():  # each actor, the added one included, calls both in order
        post = [tag for tag, event in seen if event == "post_collect"]
        assert post and post == ["first", "last"] * (len(post) // 2)
        assert seen[-2:] == [("first", "shutdown"), ("last", "shutdown")]
    # the added actor is worker 1 of 2
    assert {(line.worker, line.num_workers) for line in lines if line.event == "post_collect"} == {(0, 1), (1, 2)}


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ray_collectors_added_are_dropped_when_an_observer_cannot_attach(ray_cluster, helpers, tmp_path):
    log = tmp_path / "events.txt"
    collector = _one_actor_ray_collector(total_frames=20)
    try:
        collector.add_observer(helpers.CollectorLog(log, "kept"))
        collector.add_observer(helpers.FailsToAttach(log, "refuses_worker_1", failing_worker=1))
        with pytest.raises(RemoteAttachError, match="being added were stopped"):
            _add_one_actor(collector)
        assert len(collector.remote_collectors) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            assert sum(batch.numel() for batch in collector) == 20
    finally:
        collector.shutdown()
