"""Observer faults: observers that raise, refuse their source, are slow, or cannot travel.

Real ``Collector`` and replay buffer, every error policy. With ``"warn"``
and ``"ignore"`` the loop's data is identical to a run without observers and
the other observers see every event; ``"warn"`` tells the user once per
failure streak. With ``"raise"`` the error reaches the caller, and the source
stays usable (and shuts down).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from tensordict import TensorDict

from rl_observers import LoggerObserver, MetricsChannel
from rl_observers.testing import EventRecorder
from tests.faults.conftest import (
    BATCHES,
    TOTAL_FRAMES,
    assert_same_data,
    make_buffer,
    run_loop,
    window_total,
)
from tests.helpers import RecordingLogger, make_collector


class Raising:
    """Raises in the events of ``raise_in`` on the calls ``fails(n)`` selects (n counts from 1)."""

    def __init__(self, raise_in: tuple[str, ...], fails=lambda n: True) -> None:
        self.raise_in = raise_in
        self.fails = fails
        self.calls: dict[str, int] = {}

    def _event(self, event: str) -> None:
        n = self.calls[event] = self.calls.get(event, 0) + 1
        if event in self.raise_in and self.fails(n):
            raise RuntimeError(f"observer failure in {event} #{n}")

    def on_pre_collect(self, source):
        self._event("pre_collect")

    def on_post_collect(self, source, batch):
        self._event("post_collect")

    def on_post_extend(self, source, data, index):
        self._event("post_extend")

    def on_post_sample(self, source, batch, info):
        self._event("post_sample")

    def on_shutdown(self, source):
        self._event("shutdown")

    def __repr__(self) -> str:
        return f"Raising({self.raise_in})"


ALL_EVENTS = ("pre_collect", "post_collect", "post_extend", "post_sample", "shutdown")
# mode -> (events that raise, which calls fail, failure streaks per source)
MODES = {
    "every_event": (ALL_EVENTS, lambda n: True, {"collector": 1, "buffer": 1}),
    "one_event": (("post_collect", "post_sample"), lambda n: True, {"collector": 1, "buffer": 1}),
    "first_batch_only": (("post_collect", "post_sample"), lambda n: n == 1, {"collector": 1, "buffer": 1}),
    "every_other_call": (("post_sample",), lambda n: n % 2 == 1, {"collector": 0, "buffer": BATCHES // 2}),
}


def observer_warnings(told: list[str]) -> list[str]:
    return [m for m in told if m.startswith("rl_observers: observer")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("on_error", ["warn", "ignore"])
def test_raising_observers_change_nothing_and_others_see_everything(reference, told, mode, on_error):
    raise_in, fails, streaks = MODES[mode]
    failing, recorders = {}, {}

    def attach(collector, rb):
        for name, target in (("collector", collector), ("buffer", rb)):
            failing[name] = Raising(raise_in, fails)
            recorders[name] = EventRecorder()
            target.add_observer(failing[name], on_error=on_error)
            target.add_observer(recorders[name])  # called after the failing one

    assert_same_data(reference, run_loop(attach))
    collector_events = recorders["collector"].events
    assert collector_events == ["pre_collect", "post_collect"] * BATCHES + ["shutdown"]
    assert recorders["buffer"].events == ["post_extend", "post_sample"] * BATCHES
    assert failing["collector"].calls["post_collect"] == BATCHES  # still called after failing
    expected = sum(streaks.values()) if on_error == "warn" else 0
    messages = observer_warnings(told)
    assert len(messages) == expected, messages
    if expected:
        assert "Raising(" in messages[0] and "observer failure in" in messages[0]


@pytest.mark.timeout(60)
def test_raise_policy_reaches_the_caller_and_the_collector_shuts_down_cleanly():
    collector = make_collector()
    failing = Raising(("post_collect",), lambda n: n == 1)
    recorder = EventRecorder()
    collector.add_observer(failing, on_error="raise")
    collector.add_observer(recorder)
    try:
        with pytest.raises(RuntimeError, match="observer failure in post_collect #1"):
            for _ in collector:
                pass
        # "raise" stops the walk at the failing observer: the next one missed that event; torchrl
        # shuts a collector down when its iteration raises, and the observers are told
        assert recorder.events == ["pre_collect", "shutdown"]
        assert collector.closed
    finally:
        collector.shutdown()
    assert recorder.count("shutdown") == 1


@pytest.mark.timeout(60)
def test_raise_policy_on_a_buffer_keeps_the_written_data():
    rb = make_buffer()
    rb.add_observer(Raising(("post_extend", "post_sample")), on_error="raise")
    data = TensorDict({"x": torch.arange(10)}, [10])
    with pytest.raises(RuntimeError, match="post_extend #1"):
        rb.extend(data)
    assert len(rb) == 10 and (rb[:]["x"] == data["x"]).all()  # the event comes after the write
    with pytest.raises(RuntimeError, match="post_sample #1"):
        rb.sample()
    assert len(rb) == 10 and rb.write_count == 10


@pytest.mark.timeout(60)
def test_an_observer_raising_at_shutdown_neither_stops_the_shutdown_nor_the_other_observers():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    collector = make_collector()
    rb = make_buffer()
    recorders = EventRecorder(), EventRecorder()
    for target, recorder in zip((collector, rb), recorders):
        target.add_observer(Raising(("shutdown",)), on_error="raise")
        target.add_observer(recorder)
        target.add_observer(LoggerObserver(channel, schedule=None, log_on_close=True))
    batch = next(iter(collector))
    rb.extend(batch)
    with pytest.raises(RuntimeError, match="observer failure in shutdown #1"):
        collector.shutdown()
    assert collector.closed  # torchrl's shutdown ran
    with pytest.raises(RuntimeError, match="observer failure in shutdown #1"):
        rb.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        rb.sample()  # torchrl's shutdown ran
    assert [r.events[-1] for r in recorders] == ["shutdown", "shutdown"]
    collector.shutdown()  # once is enough: no second event, no second error
    assert recorders[0].count("shutdown") == 1
    assert channel.close(timeout=10)
    assert logger.series("collector/frames") == [(16, 16.0)]


class RefusesSource(EventRecorder):
    def attached(self, source):
        raise ValueError(f"{type(source).__name__} is not for me")


@pytest.mark.parametrize("target", ["collector", "buffer"])
def test_an_observer_whose_attached_raises_is_not_left_attached(target):
    source = make_collector() if target == "collector" else make_buffer()
    plain = type(source)
    kept = EventRecorder()
    source.add_observer(kept)
    with pytest.raises(ValueError, match="is not for me"):
        source.add_observer(RefusesSource())
    assert source.observers == (kept,)
    source.remove_observer(kept)
    with pytest.raises(ValueError, match="is not for me"):
        source.add_observer(RefusesSource())
    assert source.observers == () and type(source) is plain  # torchrl's own class again
    if target == "collector":
        source.shutdown()


class Sleepy:
    """Takes 20 ms per event."""

    def __init__(self) -> None:
        self.events = 0

    def _sleep(self) -> None:
        self.events += 1
        time.sleep(0.02)

    def on_post_collect(self, source, batch):
        self._sleep()

    def on_post_extend(self, source, data, index):
        self._sleep()

    def on_post_sample(self, source, batch, info):
        self._sleep()


@pytest.mark.timeout(60)
def test_a_slow_observer_breaks_nothing_else(reference, told):
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    sleepy, recorder = Sleepy(), EventRecorder()

    def attach(collector, rb):
        collector.add_observer(LoggerObserver(channel, schedule=None))
        collector.add_observer(sleepy)
        rb.add_observer(sleepy)
        rb.add_observer(recorder)

    assert_same_data(reference, run_loop(attach))
    assert sleepy.events == 3 * BATCHES
    assert recorder.events == ["post_extend", "post_sample"] * BATCHES
    assert channel.close(timeout=10)
    assert logger.series("collector/frames")[-1][1] == TOTAL_FRAMES
    assert window_total(logger, "collector/episodes") == logger.series("collector/episodes_total")[-1][1]
    assert told == []


# -- observers that cannot travel to worker processes ----------------------------------------------

_DRIVER = os.getpid()


class UnpicklableInWorkers(EventRecorder):
    """Pickles fine; refuses to be unpickled in any process but the one that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.made_in = os.getpid()

    def __setstate__(self, state):
        if os.getpid() != state["made_in"]:
            raise RuntimeError("this observer cannot be unpickled in a worker")
        super().__setstate__(state)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_observer_failing_to_unpickle_in_workers_is_refused_at_add_observer():
    from torchrl.collectors import MultiSyncCollector

    from rl_observers.remote.shipping import RemoteAttachError
    from tests.helpers import make_multi

    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=20, total_frames=60)
    try:
        with pytest.raises(RemoteAttachError, match="cannot be unpickled in a worker"):
            collector.add_observer(UnpicklableInWorkers())
        assert collector.observers == ()
        assert sum(batch.numel() for batch in collector) == 60  # no worker died
    finally:
        collector.shutdown()


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_shared_buffer_observer_failing_to_unpickle_in_spawned_workers_is_left_behind_there(tmp_path, capfd):
    from torchrl.collectors import MultiSyncCollector
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs.utils import RandomPolicy
    from torchrl.testing.mocking_classes import CountingEnv

    import tests.remote._remote_observers as remote_observers
    from tests.helpers import start_method, wait_for

    def worker_items(tag: str) -> int:
        lines = remote_observers.read_lines(log)
        return sum(line.count for line in lines if line.tag == tag and line.event == "post_extend" and line.pid != _DRIVER)

    log = tmp_path / "events.txt"
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), shared=True)
    failing = UnpicklableInWorkers()
    kept = remote_observers.BufferLog(log, "kept")
    rb.add_observer(failing)  # travels to the spawned workers inside the buffer's pickle
    rb.add_observer(kept)
    env = CountingEnv()
    with start_method("spawn"):
        collector = MultiSyncCollector(
            [CountingEnv, CountingEnv],
            RandomPolicy(env.action_spec),
            frames_per_batch=20,
            total_frames=-1,
            replay_buffer=rb,
        )
    try:
        collector.start()  # the workers started: the observer was left behind, not fatal
        assert wait_for(lambda: rb.write_count >= 100, timeout=60)
        with collector.pause():
            assert worker_items("kept") == rb.write_count  # the buffer's other observer sees every write
            rb.remove_observer(failing)  # mirrored by position: the one left behind keeps its place
            assert rb.observers == (kept,)
            first = rb.write_count
        assert wait_for(lambda: rb.write_count >= first + 100, timeout=60)
        with collector.pause():
            assert worker_items("kept") == rb.write_count
            rb.remove_observer(kept)
            assert rb.observers == ()
            second = rb.write_count
        assert wait_for(lambda: rb.write_count >= second + 100, timeout=60)
        assert worker_items("kept") == second  # removed from the workers' copies too
    finally:
        collector.shutdown()
    assert failing.events == []  # on the driver: torchrl's lazy-storage set-up is no event
    # each worker said once which observer it left behind, and why
    out = capfd.readouterr()
    told = [line for line in (out.out + out.err).splitlines() if "could not be unpickled" in line]
    assert len(told) == 2, told
    assert all("UnpicklableInWorkers" in line and "cannot be unpickled in a worker" in line for line in told)


class FailsToUnpickle(EventRecorder):
    """Pickles fine; raises whenever it is unpickled."""

    def __setstate__(self, state):
        raise RuntimeError("this observer cannot be unpickled here")


class HoldsItsSource(EventRecorder):
    """Keeps its source: pickling it pickles the source, and the source's observers, again."""

    def attached(self, source):
        self.source = source


class _SpawningHere:
    """Stands for the ``Popen`` of a process being spawned, with file descriptors valid here."""

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return os.dup(fd)

    @staticmethod
    def DupFd(fd: int):  # noqa: N802 (multiprocessing's name)
        from multiprocessing.popen_spawn_posix import _DupFd

        return _DupFd(fd)


def pickled_for_a_new_process(obj) -> bytes:
    """``obj`` pickled the way ``Process.start()`` pickles it for a spawned process."""
    from multiprocessing.context import set_spawning_popen
    from multiprocessing.reduction import ForkingPickler

    set_spawning_popen(_SpawningHere())
    try:
        return bytes(ForkingPickler.dumps(obj))
    finally:
        set_spawning_popen(None)


def test_an_observer_failing_to_unpickle_in_a_new_process_is_left_behind_in_its_place(told):
    import pickle

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(100, shared_init=True))
    before, failing, after = EventRecorder(), FailsToUnpickle(), EventRecorder()
    for observer in (before, failing, after):
        rb.add_observer(observer)
    copy = pickle.loads(pickled_for_a_new_process(rb))
    assert [m for m in told if "could not be unpickled" in m] == [
        f"rl_observers: observer {failing!r} (tests.faults.test_observer_faults.FailsToUnpickle) of a "
        f"replay buffer could not be unpickled in process {os.getpid()} (RuntimeError: this observer "
        "cannot be unpickled here); it is left behind: the replay buffer and its other observers go on "
        "without it here."
    ]
    kept_before, left_behind, kept_after = copy.observers  # positions match the original's
    assert "left behind" in repr(left_behind) and "FailsToUnpickle" in repr(left_behind)
    copy.extend(torch.arange(4))
    assert kept_before.events == kept_after.events == ["post_extend"]
    copy.remove_observer(left_behind)
    assert copy.observers == (kept_before, kept_after)
    # elsewhere (here a plain pickle) the observers travel inline, and a failure is the caller's
    plain = make_buffer()
    plain.add_observer(FailsToUnpickle())
    with pytest.raises(RuntimeError, match="cannot be unpickled here"):
        pickle.loads(pickle.dumps(plain))


def test_an_observer_holding_its_source_pickles_for_a_new_process():
    import pickle

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(100, shared_init=True))
    holder = HoldsItsSource()
    rb.add_observer(holder)
    copy = pickle.loads(pickled_for_a_new_process(rb))  # inline: no recursion, one buffer
    (copied,) = copy.observers
    assert copied.source is copy
    copy.extend(torch.arange(4))
    assert copied.events == ["post_extend"]
