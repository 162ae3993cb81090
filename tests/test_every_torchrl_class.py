"""No silent attach: every collector and replay-buffer class torchrl exports is heard or refused.

The classes are enumerated from ``torchrl.collectors``,
``torchrl.collectors.distributed`` and ``torchrl.data`` (every exported
subclass of ``BaseCollector`` or ``ReplayBuffer``). Each is either observed
(a real object is built here and its events checked, or the test that
checks them elsewhere is named and must exist) or refused by
``add_observer`` with a message naming what to use. A class torchrl adds in
a later release lands in neither list: it must then be refused, and this
test says so until someone decides.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import (
    AsyncBatchedCollector,
    AsyncCollector,
    BaseCollector,
    Collector,
    MultiAsyncCollector,
)
from torchrl.data import (
    HERReplayBuffer,
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    RemoteTensorDictReplayBuffer,
    ReplayBuffer,
    ReplayBufferEnsemble,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.envs.utils import RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv

from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from rl_observers.sources.observed import how_observed, refusal
from tests.helpers import RecordingLogger, start_method

TESTS = Path(__file__).resolve().parent


def exported_classes() -> list[type]:
    import torchrl.collectors
    import torchrl.collectors.distributed
    import torchrl.data

    found: dict[str, type] = {}
    for module in (torchrl.collectors, torchrl.collectors.distributed, torchrl.data):
        for name in module.__all__:
            value = getattr(module, name, None)
            if inspect.isclass(value) and issubclass(value, (BaseCollector, ReplayBuffer)):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return sorted(found.values(), key=lambda cls: cls.__qualname__)


# -- what each class does -----------------------------------------------------------------------


class _Seen:
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_pre_collect(self, source):
        self.events.append("pre_collect")

    def on_post_collect(self, source, batch):
        self.events.append("post_collect")

    def on_post_add(self, source, data, index):
        self.events.append("post_add")

    def on_post_extend(self, source, data, index):
        self.events.append("post_extend")

    def on_post_sample(self, source, batch, info):
        self.events.append("post_sample")


def _collector_events(collector) -> list[str]:
    seen = _Seen()
    handle = collector.add_observer(seen)
    try:
        for _ in collector:
            pass
    finally:
        handle.remove()
        collector.shutdown()
    return seen.events


def _collector():
    env = CountingEnv(max_steps=7)
    return _collector_events(Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=16))


def _async_batched():
    import functools

    from tests.test_collector_metrics import _async_batched as build
    from tests.test_collector_metrics import _interleaving_env

    collector = build([functools.partial(_interleaving_env, s) for s in (1, 2)], 30, 60)
    return _collector_events(collector)


def _multiprocess(cls, envs: int):
    """Events in worker processes: what their copies fold reaches the driver's channel."""

    def build():
        env = CountingEnv(max_steps=7)
        logger = RecordingLogger()
        channel = MetricsChannel(logger)
        make_env = [lambda: CountingEnv(max_steps=7)] * envs if envs > 1 else (lambda: CountingEnv(max_steps=7))
        with start_method("fork"):
            collector = cls(make_env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32)
        try:
            collector.add_observer(
                LoggerObserver(channel, schedule=Every.counter("frames", 10**9), metrics=CollectorBatchMetrics())
            )
            received = sum(batch.numel() for batch in collector)
        finally:
            collector.shutdown()
        assert channel.flush(timeout=30)
        channel.close()
        frames = [m["collector/frames"] for m, _ in logger.user_calls() if "collector/frames" in m]
        # async workers may collect ahead of what the driver received, never less
        return ["post_collect"] if frames and frames[-1] >= received >= 32 else [f"frames {frames}"]

    return build


def _buffer_events(rb, data) -> list[str]:
    seen = _Seen()
    with rb.add_observer(seen):
        rb.extend(data)
        rb.add(data[0])
        rb.sample(2)
    return seen.events


def _td(n: int = 4) -> TensorDict:
    return TensorDict({"obs": torch.arange(float(n)), ("next", "done"): torch.zeros(n, 1, dtype=torch.bool)}, [n])


def _events_of_class(cls, **kwargs):
    def build():
        data = _td() if issubclass(cls, TensorDictReplayBuffer) else torch.arange(4.0)
        return _buffer_events(cls(storage=LazyTensorStorage(16), batch_size=2, **kwargs), data)

    return build


def _her():
    rb = HERReplayBuffer(reward_fn=lambda td: torch.zeros(td.shape + (1,)), storage=LazyTensorStorage(16), batch_size=2)
    data = TensorDict(
        {
            "desired_goal": torch.zeros(4, 3),
            "achieved_goal": torch.randn(4, 3),
            "next": {
                "desired_goal": torch.zeros(4, 3),
                "achieved_goal": torch.randn(4, 3),
                "reward": torch.zeros(4, 1),
                "done": torch.tensor([[False], [False], [False], [True]]),
            },
        },
        [4],
    )
    return _buffer_events(rb, data)


def _ensemble():
    members = [TensorDictReplayBuffer(storage=LazyTensorStorage(16)) for _ in range(2)]
    for member in members:
        member.extend(_td())
    rb = ReplayBufferEnsemble(*members, batch_size=4)
    seen = _Seen()
    with rb.add_observer(seen):
        rb.sample()
    return seen.events


_WRITES_AND_SAMPLES = ["post_extend", "post_add", "post_sample"]

#: Classes whose events are checked here, on a real object: (build and run, events expected).
HEARD_HERE = {
    Collector: (_collector, ["pre_collect", "post_collect"] * 2),
    AsyncBatchedCollector: (_async_batched, ["post_collect"] * 2),  # torchrl reads no pre_collect_hook there
    AsyncCollector: (_multiprocess(AsyncCollector, 1), ["post_collect"]),
    MultiAsyncCollector: (_multiprocess(MultiAsyncCollector, 2), ["post_collect"]),
    ReplayBuffer: (_events_of_class(ReplayBuffer), _WRITES_AND_SAMPLES),
    PrioritizedReplayBuffer: (_events_of_class(PrioritizedReplayBuffer, alpha=0.7, beta=0.5), _WRITES_AND_SAMPLES),
    TensorDictReplayBuffer: (_events_of_class(TensorDictReplayBuffer), _WRITES_AND_SAMPLES),
    TensorDictPrioritizedReplayBuffer: (
        _events_of_class(TensorDictPrioritizedReplayBuffer, alpha=0.7, beta=0.5),
        _WRITES_AND_SAMPLES,
    ),
    RemoteTensorDictReplayBuffer: (_events_of_class(RemoteTensorDictReplayBuffer), _WRITES_AND_SAMPLES),
    HERReplayBuffer: (_her, _WRITES_AND_SAMPLES),
    ReplayBufferEnsemble: (_ensemble, ["post_sample"]),
}

#: Classes whose events need worker processes, Ray or torch.distributed: the tests that check them.
HEARD_ELSEWHERE = {
    "MultiSyncCollector": "remote/test_shipping.py::test_multisync_observers_run_in_every_worker",
    "MultiCollector": "remote/test_shipping.py::test_multisync_observers_run_in_every_worker",
    "RayCollector": "remote/test_shipping.py::test_ray_collector_observers_run_in_each_remote_collector",
    "RayReplayBuffer": "remote/test_shipping.py::test_ray_replay_buffer_observers_run_in_its_actor",
    "DistributedCollector": "remote/test_torch_distributed.py::test_observers_hear_every_batch_the_driver_receives",
    "DistributedSyncCollector": "remote/test_torch_distributed.py::test_observers_hear_every_batch_the_driver_receives",
    "RPCCollector": "remote/test_torch_distributed.py::test_observers_hear_every_batch_the_driver_receives",
}

#: Exported classes that are refused: ``BaseCollector`` is abstract; what derives from it
#: directly is a collection loop rl_observers does not know.
REFUSED = {BaseCollector}


def _test_exists(node_id: str) -> bool:
    file, _, name = node_id.partition("::")
    tree = ast.parse((TESTS / file).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


CLASSES = exported_classes()


@pytest.mark.real_collector
def test_the_enumeration_finds_torchrls_collectors_and_buffers():
    names = {cls.__qualname__ for cls in CLASSES}
    assert {"Collector", "MultiSyncCollector", "RayCollector", "RPCCollector", "ReplayBuffer", "RayReplayBuffer"} <= names


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__qualname__)
def test_every_exported_class_is_heard_or_refused(cls):
    if cls in HEARD_HERE:
        build, expected = HEARD_HERE[cls]
        assert how_observed(cls) is not None
        assert build() == expected
    elif cls.__qualname__ in HEARD_ELSEWHERE:
        assert how_observed(cls) is not None
        assert _test_exists(HEARD_ELSEWHERE[cls.__qualname__]), HEARD_ELSEWHERE[cls.__qualname__]
    else:
        # BaseCollector, or a class of a torchrl release newer than the table: refused, with help.
        assert cls in REFUSED or how_observed(cls) is None, (
            f"{cls.__qualname__} is observed but no test checks that its events arrive"
        )
        message = refusal(cls)
        assert "rl_observers.targets" in message and cls.__qualname__ in message


# -- classes the table does not know: refused at add_observer, never mute ------------------------


def _env():
    return CountingEnv(max_steps=7)


class _OwnLoop(Collector):
    """A user's collector that replaces the collection loop: observers would never be called."""

    def iterator(self):
        while True:
            yield self.rollout()


class _Tweaked(Collector):
    """A user's collector that keeps torchrl's loop: observed as a Collector."""

    def describe(self) -> str:
        return "tweaked"


class _FromScratch(BaseCollector):
    """A collection loop written from ``BaseCollector`` up."""

    def __init__(self) -> None:
        pass

    def iterator(self):
        yield from ()

    def shutdown(self, *args, **kwargs):
        pass

    def set_seed(self, seed, static_seed=False):
        return seed

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass

    def _get_policy_and_device(self, *args, **kwargs):
        return None, None


class _FutureBuffer(TensorDictReplayBuffer):
    """Stands for a replay buffer class of a later torchrl release."""


_FutureBuffer.__module__ = "torchrl.data.replay_buffers.future"


def test_a_subclass_that_replaces_the_collection_loop_is_refused_with_what_to_use():
    env = _env()
    collector = _OwnLoop(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=16)
    try:
        with pytest.raises(TypeError, match=r"_OwnLoop replaces iterator of torchrl's Collector.*hear nothing.*rl_observers\.targets"):
            collector.add_observer(lambda batch: None)
        assert collector.observers == () and type(collector) is _OwnLoop
    finally:
        collector.shutdown()


def test_a_subclass_that_keeps_torchrls_loop_is_observed():
    env = _env()
    collector = _Tweaked(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=16)
    assert _collector_events(collector) == ["pre_collect", "post_collect"] * 2


def test_a_collection_loop_from_basecollector_and_an_unknown_torchrl_class_are_refused():
    with pytest.raises(TypeError, match=r"_FromScratch derives from torchrl's BaseCollector.*rl_observers\.targets"):
        _FromScratch().add_observer(lambda batch: None)
    rb = _FutureBuffer(storage=LazyTensorStorage(4))
    with pytest.raises(TypeError, match=r"does not know how to observe"):
        rb.add_observer(lambda batch: None)
    assert rb.observers == () and type(rb) is _FutureBuffer
