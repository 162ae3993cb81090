"""Attaching observers: the API, validation at attach time, order, error policy, lifetimes."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer

import rl_observers
from rl_observers import Observer, ObserverHandle, signals
from rl_observers.targets import install
from rl_observers.testing import EventRecorder


@pytest.fixture
def rb():
    buffer = ReplayBuffer(storage=LazyTensorStorage(100))
    buffer.extend(torch.arange(20))
    return buffer


class Appends:
    def __init__(self, log, name):
        self.log = log
        self.name = name

    def on_post_extend(self, source, data, index):
        self.log.append(self.name)

    def on_post_sample(self, source, batch, info):
        self.log.append(self.name)


def test_every_event_has_a_recorder_method():
    methods = {n[3:] for n in vars(EventRecorder) if n.startswith("on_")}
    assert methods == set(signals.EVENT_PAYLOADS)


def test_install_is_idempotent(rb):
    install()
    install()
    recorder = EventRecorder()
    rb.add_observer(recorder)
    rb.extend(torch.arange(3))
    assert recorder.events == ["post_extend"]


def test_unobserved_source_runs_torchrl_code(rb):
    base = type(rb)
    assert base is ReplayBuffer
    handle = rb.add_observer(EventRecorder())
    assert type(rb) is not ReplayBuffer and isinstance(rb, ReplayBuffer)
    assert type(rb).extend is not ReplayBuffer.extend
    handle.remove()
    assert type(rb) is ReplayBuffer
    assert rb.extend.__func__ is ReplayBuffer.extend
    assert rb._sample.__func__ is ReplayBuffer._sample
    assert "_rl_observers" not in vars(rb)


def test_unobserved_collector_runs_torchrl_code(counting_env, make_collector):
    collector = make_collector(counting_env)
    handle = collector.add_observer(EventRecorder())
    assert type(collector) is not Collector
    handle.remove()
    assert type(collector) is Collector
    assert type(collector).pre_collect_hook is Collector.pre_collect_hook
    assert collector.post_collect_hook is None
    assert "_rl_observers" not in vars(collector)


def test_registration_order_and_observers_tuple(rb):
    log = []
    first, second, third = Appends(log, "a"), Appends(log, "b"), Appends(log, "c")
    for obs in (first, second, third):
        rb.add_observer(obs)
    assert rb.observers == (first, second, third)
    rb.extend(torch.arange(2))
    assert log == ["a", "b", "c"]
    rb.remove_observer(second)
    log.clear()
    rb.sample(2)
    assert log == ["a", "c"]
    assert rb.observers == (first, third)


def test_handle_is_a_context_manager_and_removes_once(rb):
    recorder = EventRecorder()
    with rb.add_observer(recorder) as handle:
        assert isinstance(handle, ObserverHandle)
        assert handle.observer is recorder and handle.target is rb
        rb.sample(2)
    rb.sample(2)
    handle.remove()  # twice is harmless
    assert recorder.events == ["post_sample"]
    assert rb.observers == ()


def test_remove_unknown_observer_raises(rb):
    with pytest.raises(ValueError, match="is not attached"):
        rb.remove_observer(EventRecorder())


def test_plain_callable_receives_post_collect_batch(counting_env, make_collector):
    collector = make_collector(counting_env, frames_per_batch=8, total_frames=24)
    batches = []
    collector.add_observer(batches.append)
    yielded = list(collector)
    assert len(batches) == 3
    assert all(seen is out for seen, out in zip(batches, yielded))


def test_only_defined_events_are_wired(rb):
    class SampleOnly:
        def on_post_sample(self, source, batch, info):
            pass

    rb.add_observer(SampleOnly())
    entry = rb._rl_observers.entries[0]
    assert set(entry.calls) == {"post_sample"}
    assert rb._rl_observers._calls["post_extend"] == ()


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (42, TypeError, r"must define on_<event> methods or be a callable.*got 42"),
        (object(), TypeError, "must define on_<event> methods"),
        (EventRecorder, TypeError, "observer instance, got the class EventRecorder"),
    ],
)
def test_bad_observers_fail_at_attach_time(rb, bad, error, match):
    with pytest.raises(error, match=match):
        rb.add_observer(bad)
    assert type(rb) is ReplayBuffer  # a failed attach leaves the source untouched


def test_typo_in_event_name_is_reported_with_a_suggestion(rb):
    class Typo:
        def on_post_sampel(self, source, batch, info):
            pass

    with pytest.raises(ValueError, match=r"on_post_sampel is not an event.*on_post_sample"):
        rb.add_observer(Typo())


def test_wrong_signature_is_reported(rb):
    class Wrong:
        def on_post_sample(self, batch):
            pass

    with pytest.raises(TypeError, match=r"on_post_sample must accept \(source, batch, info\)"):
        rb.add_observer(Wrong())


def test_same_observer_twice_is_refused(rb):
    recorder = EventRecorder()
    rb.add_observer(recorder)
    with pytest.raises(ValueError, match="already attached"):
        rb.add_observer(recorder)
    assert rb.observers == (recorder,)


def test_collector_observer_on_replay_buffer_is_refused(rb):
    class CollectorOnly:
        def on_post_collect(self, source, batch):
            pass

    with pytest.raises(TypeError, match="observes post_collect, none of which a replay buffer"):
        rb.add_observer(CollectorOnly())
    with pytest.raises(TypeError, match="plain callable is a post_collect receiver"):
        rb.add_observer(lambda batch: None)


def test_bad_on_error_is_refused(rb):
    with pytest.raises(ValueError, match="on_error must be one of 'warn', 'raise' or 'ignore', got 'loud'"):
        rb.add_observer(EventRecorder(), on_error="loud")


class Failing:
    def __init__(self, fail_times=10**9):
        self.calls = 0
        self.fail_times = fail_times

    def on_post_sample(self, source, batch, info):
        self.calls += 1
        if self.calls <= self.fail_times:
            raise RuntimeError(f"boom {self.calls}")


def test_warn_policy_warns_once_per_streak_and_goes_on(rb, caplog):
    failing = Failing(fail_times=3)
    recorder = EventRecorder()
    rb.add_observer(failing)  # default "warn"
    rb.add_observer(recorder)
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        for _ in range(5):
            rb.sample(2)
        warnings_first = [r for r in caplog.records if "boom" in r.getMessage()]
        assert len(warnings_first) == 1
        failing.fail_times = 10**9  # a second streak
        rb.sample(2)
        rb.sample(2)
    streaks = [r for r in caplog.records if "boom" in r.getMessage()]
    assert len(streaks) == 2
    assert recorder.count("post_sample") == 7  # the other observer always ran


def test_raise_policy_propagates(rb):
    rb.add_observer(Failing(), on_error="raise")
    with pytest.raises(RuntimeError, match="boom 1"):
        rb.sample(2)


def test_ignore_policy_is_silent(rb, caplog):
    recorder = EventRecorder()
    rb.add_observer(Failing(), on_error="ignore")
    rb.add_observer(recorder)
    with caplog.at_level(logging.WARNING, logger="torchrl"):
        rb.sample(2)
    assert not [r for r in caplog.records if "boom" in r.getMessage()]
    assert recorder.events == ["post_sample"]


def test_observer_on_error_attribute_is_the_default(rb):
    failing = Failing()
    failing.on_error = "raise"
    rb.add_observer(failing)
    with pytest.raises(RuntimeError):
        rb.sample(2)


def test_observer_base_class_lifecycle(rb):
    class Life(Observer):
        def __init__(self):
            self.log = []

        def attached(self, source):
            self.log.append(("attached", source))

        def detached(self, source):
            self.log.append(("detached", source))

        def on_empty(self, source):
            self.log.append("empty")

    life = Life()
    with rb.add_observer(life):
        rb.empty()
    assert life.log == [("attached", rb), "empty", ("detached", rb)]


def test_registrations_do_not_keep_targets_alive():
    buffer = ReplayBuffer(storage=LazyTensorStorage(10))
    recorder = EventRecorder()
    handle = buffer.add_observer(recorder)
    signals.post_sample.connect(lambda sender, **kw: None, sender=buffer)
    ref = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert ref() is None
    assert handle.target is None
    handle.remove()  # harmless once the target is gone


def test_collector_is_freed_with_observers(counting_env):
    from torchrl.envs.utils import RandomPolicy

    collector = Collector(counting_env, RandomPolicy(counting_env.action_spec), frames_per_batch=4, total_frames=8)
    handle = collector.add_observer(EventRecorder())
    ref = weakref.ref(collector)
    del collector
    gc.collect()
    assert ref() is None and handle.target is None


def test_signals_for_one_source_and_for_all(rb):
    other = ReplayBuffer(storage=LazyTensorStorage(10))
    other.extend(torch.arange(5))
    mine, everyone = [], []

    def for_rb(sender, batch, info):
        mine.append(sender)

    def for_all(sender, batch, info):
        everyone.append(sender)

    signals.post_sample.connect(for_rb, sender=rb)
    signals.post_sample.connect(for_all)
    try:
        assert type(rb) is not ReplayBuffer  # a source-specific receiver makes it emit
        other.add_observer(EventRecorder())
        rb.sample(2)
        other.sample(2)
    finally:
        signals.post_sample.disconnect(for_rb, sender=rb)
        signals.post_sample.disconnect(for_all)
    assert mine == [rb]
    assert everyone == [rb, other]
    assert type(rb) is ReplayBuffer  # released once nothing listens


def test_public_api_is_exported():
    for name in rl_observers.__all__:
        assert hasattr(rl_observers, name), name
