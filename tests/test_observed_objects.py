"""Observed objects behave like torchrl's: type, repr, isinstance, calling the type, copy, deepcopy, pickle."""

from __future__ import annotations

import copy
import logging
import pickle
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers import signals


class Sources:
    """Records the ``source`` of every event it receives."""

    def __init__(self) -> None:
        self.sources: list[Any] = []

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        self.sources.append(source)


def observed_buffer(cls: type = ReplayBuffer) -> tuple[Any, Sources]:
    rb = cls(storage=LazyTensorStorage(20))
    observer = Sources()
    rb.add_observer(observer)
    return rb, observer


@pytest.mark.parametrize("cls", [ReplayBuffer, TensorDictReplayBuffer])
def test_type_names_torchrl_class_and_isinstance_holds(cls):
    rb, _ = observed_buffer(cls)
    assert repr(type(rb)) == repr(cls)
    assert type(rb).__name__ == cls.__name__
    assert isinstance(rb, cls)
    assert issubclass(type(rb), cls)


def test_calling_the_type_builds_a_plain_torchrl_object():
    rb, _ = observed_buffer()
    other = type(rb)(storage=LazyTensorStorage(5))
    assert type(other) is ReplayBuffer
    assert other.observers == ()
    other.extend(torch.arange(3))
    assert len(other) == 3 and other.stats()["write_count"] == 3


def test_calling_an_observed_collector_type_passes_torchrl_metaclass():
    env = CountingEnv()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=4, total_frames=8)
    other = None
    try:
        collector.add_observer(lambda batch: None)
        other = type(collector)(env, RandomPolicy(env.action_spec), frames_per_batch=4, total_frames=8)
        assert type(other) is Collector
        assert sum(batch.numel() for batch in other) == 8
        other.shutdown()
        assert other.stats()["frames"] == 8
    finally:
        collector.shutdown()
        if other is not None:
            other.shutdown()


def test_shallow_copy_has_its_own_list_with_the_same_observers():
    rb, observer = observed_buffer()
    clone = copy.copy(rb)
    assert clone.observers == (observer,)
    clone.extend(torch.arange(2))
    rb.extend(torch.arange(2))
    assert observer.sources == [clone, rb]
    # registrations on one leave the other alone
    extra = Sources()
    clone.add_observer(extra)
    assert rb.observers == (observer,)
    rb.remove_observer(observer)
    assert clone.observers == (observer, extra)
    assert type(rb) is ReplayBuffer


def test_deep_copy_carries_copies_of_its_observers():
    rb, observer = observed_buffer()
    clone = copy.deepcopy(rb)
    (copied,) = clone.observers
    assert copied is not observer and isinstance(copied, Sources)
    clone.extend(torch.arange(2))
    assert copied.sources == [clone]
    assert observer.sources == []


def test_pickle_round_trips_observed():
    rb, observer = observed_buffer()
    rb.extend(torch.arange(4))
    back = pickle.loads(pickle.dumps(rb))
    assert repr(type(back)) == repr(ReplayBuffer)
    (copied,) = back.observers
    assert len(copied.sources) == 1 and copied.sources[0] is back
    back.extend(torch.arange(2))
    assert copied.sources[-1] is back and len(back) == 6


def test_a_plain_copy_stays_plain():
    rb = ReplayBuffer(storage=LazyTensorStorage(5))
    assert type(copy.copy(rb)) is ReplayBuffer
    assert type(copy.deepcopy(rb)) is ReplayBuffer


def test_a_receiver_for_one_source_gets_the_observers_error_policy(caplog):
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    calls = []

    def broken(sender: Any, data: Any, index: Any) -> None:
        calls.append(sender)
        raise RuntimeError("receiver bug")

    signals.post_extend.connect(broken, sender=rb)
    try:
        with caplog.at_level(logging.WARNING):
            rb.extend(torch.arange(2))  # does not raise out of extend
            rb.extend(torch.arange(2))
        assert calls == [rb, rb]
        warnings = [r for r in caplog.records if "receiver bug" in r.getMessage()]
        assert len(warnings) == 1  # once per failure streak
        assert len(rb) == 4
    finally:
        signals.post_extend.disconnect(broken, sender=rb)
    assert type(rb) is ReplayBuffer


def test_a_receiver_can_ask_for_raise():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))

    def strict(sender: Any, data: Any, index: Any) -> None:
        raise RuntimeError("strict receiver")

    strict.on_error = "raise"  # type: ignore[attr-defined]
    signals.post_extend.connect(strict, sender=rb)
    try:
        with pytest.raises(RuntimeError, match="strict receiver"):
            rb.extend(torch.arange(2))
    finally:
        signals.post_extend.disconnect(strict, sender=rb)


@pytest.mark.parametrize(
    ("name", "meant"),
    [("attach", "attached"), ("detach", "detached"), ("stat", "stats"), ("prepare_copie", "prepare_copies"),
     ("copies_remove", "copies_removed"), ("observed_event", "observed_events")],
)
def test_a_misspelled_optional_hook_is_refused_with_a_suggestion(name, meant):
    observer = type("Misspelled", (), {"on_post_extend": lambda self, source, data, index: None, name: lambda self, s: None})()
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(ValueError, match=f"Did you mean {meant!r}"):
        rb.add_observer(observer)
    assert rb.observers == () and type(rb) is ReplayBuffer


def test_a_misspelled_on_error_method_suggests_on_error():
    observer = type("Misspelled", (), {"on_post_extend": lambda self, source, data, index: None, "on_eror": "warn"})()
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(ValueError, match="Did you mean 'on_error'"):
        rb.add_observer(observer)


def test_writes_passed_by_keyword_emit_their_data():
    # torchrl names the data "tensordicts" (TensorDictReplayBuffer.extend) or "data":
    # an observed buffer accepts both as torchrl does, and its events carry the data.
    seen = []

    class Writes:
        def on_post_add(self, source, data, index):
            seen.append(("add", data, index))

        def on_post_extend(self, source, data, index):
            seen.append(("extend", data, index))

    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.add_observer(Writes())
    rb.extend(data=torch.arange(3))
    rb.add(data=torch.tensor(7))
    td_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
    td_rb.add_observer(Writes())
    td_rb.extend(tensordicts=TensorDict({"a": torch.zeros(2)}, [2]))
    assert [(kind, type(data).__name__) for kind, data, _ in seen] == [
        ("extend", "Tensor"),
        ("add", "Tensor"),
        ("extend", "TensorDict"),
    ]
    assert seen[0][1].tolist() == [0, 1, 2] and seen[1][2] == 3
    assert type(td_rb).extend.__qualname__ == "ObservedReplayBuffer.extend"
