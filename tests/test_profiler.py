"""ProfilerObserver and the observer-based ``enable_profile()``, on real collectors and traces."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import record_function
from torchrl.collectors import (
    BaseCollector,
    Collector,
    MultiAsyncCollector,
    MultiSyncCollector,
    ProfileConfig,
)
from torchrl.envs.utils import RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers
from rl_observers import Observer, ProfilerObserver
from rl_observers.profiler import install_profiling
from rl_observers.sources import observers_of
from tests.helpers import make_collector

REPO = Path(__file__).resolve().parents[1]
# Small, fast traces: Python stacks make traces ~10x larger.
FAST = {"activities": ["cpu"], "with_stack": False, "record_shapes": False}


@pytest.fixture
def collectors():
    made: list[BaseCollector] = []

    def make(batches: int = 6, **kwargs):
        collector = make_collector(CountingEnv(max_steps=5), kwargs.pop("frames_per_batch", 8), batches=batches, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.shutdown(raise_on_error=False)


def trace_events(path: Path) -> list[dict]:
    with open(path) as file:
        trace = json.load(file)  # a valid Chrome trace is a JSON object with traceEvents
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def named(events: list[dict], prefix: str) -> list[dict]:
    return sorted((e for e in events if e["name"].startswith(prefix)), key=lambda e: e["ts"])


def steps(events: list[dict]) -> list[str]:
    return [e["name"] for e in named(events, "ProfilerStep#")]


def step_of(event: dict, events: list[dict]) -> str | None:
    """The profiler step whose range contains ``event``."""
    for step in named(events, "ProfilerStep#"):
        if step["ts"] <= event["ts"] and event["ts"] + event["dur"] <= step["ts"] + step["dur"]:
            return step["name"]
    return None


class Marker(Observer):
    """Emits a record_function range per event, named after the rollout it sees."""

    def __init__(self, calls: list | None = None, label: str = "marker") -> None:
        self.calls = calls if calls is not None else []
        self.label = label
        self.rollout = 0

    def on_pre_collect(self, source):
        with record_function(f"{self.label}/pre#{self.rollout}"):
            self.calls.append((f"{self.label}.pre", self.rollout))

    def on_post_collect(self, source, batch):
        with record_function(f"{self.label}/post#{self.rollout}"):
            self.calls.append((f"{self.label}.post", self.rollout))
        self.rollout += 1


# -- configuration ---------------------------------------------------------------------------------


def test_keywords_build_torchrl_profile_config():
    observer = ProfilerObserver(num_rollouts=5, warmup_rollouts=2, save_path="t_{worker_idx}.json")
    assert isinstance(observer.config, ProfileConfig)
    assert observer.config.workers == [0]
    assert observer.config.activities == ["cpu", "cuda"]
    assert observer.config.get_save_path(3) == Path("t_3.json")
    config = ProfileConfig(workers=[1], num_rollouts=2, warmup_rollouts=0)
    assert ProfilerObserver(config, record_observers=True).config is config


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_rollouts": 2, "warmup_rollouts": 2}, ValueError),
        ({"num_rollouts": 3, "warmup_rollouts": -1}, ValueError),
        ({"config": ProfileConfig(), "num_rollouts": 4}, TypeError),
        ({"config": {"num_rollouts": 4}}, TypeError),
    ],
)
def test_invalid_configuration_raises(kwargs, error):
    with pytest.raises(error):
        ProfilerObserver(**kwargs)


# -- one collector, end to end ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_traces_whole_rollouts_and_writes_after_the_last(collectors, tmp_path):
    collector = collectors(batches=6)
    profiler = ProfilerObserver(
        num_rollouts=4,
        warmup_rollouts=1,
        save_path=tmp_path / "traces" / "rollouts_{worker_idx}.json",
        activities=["cpu"],
        with_stack=True,  # Python stacks: the collector's ``rollout`` frames are in the trace
    )
    collector.add_observer(profiler)
    written_after = None
    for i, _ in enumerate(collector):
        if written_after is None and profiler.trace_path is not None:
            written_after = i
    assert written_after == 3  # the trace is out as soon as rollout num_rollouts - 1 is done
    assert profiler.trace_path == tmp_path / "traces" / "rollouts_0.json"
    assert not profiler.active
    events = trace_events(profiler.trace_path)
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    rollouts = [
        e
        for e in events
        if e.get("cat") == "python_function" and "collectors/_single.py" in e["name"]
        and e["name"].endswith(": rollout")
    ]
    # one whole rollout per recorded step (a step boundary never cuts a rollout)
    by_step = sorted(step_of(e, events) for e in rollouts if step_of(e, events))
    assert sorted(set(by_step)) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    assert all(
        e["dur"] < next(s for s in named(events, step_of(e, events)))["dur"] for e in rollouts
    )


@pytest.mark.timeout(60)
def test_profiling_does_not_change_collected_data(collectors, tmp_path):
    def collect(with_profiler: bool) -> list:
        torch.manual_seed(0)
        collector = collectors(batches=4)
        if with_profiler:
            collector.add_observer(
                ProfilerObserver(num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t.json", **FAST)
            )
        return [batch.clone() for batch in collector]

    plain, profiled = collect(False), collect(True)
    assert (tmp_path / "t.json").exists()
    assert len(plain) == len(profiled) == 4
    for a, b in zip(plain, profiled):
        assert (a == b).all()


@pytest.mark.timeout(60)
def test_stacked_with_observers_and_user_hook(collectors, tmp_path):
    """Profiler + another observer + a user hook + a plain callable: all run, in order, traced."""
    calls: list = []
    collector = collectors(batches=5)
    collector.post_collect_hook = lambda batch: calls.append(("user_hook", batch.numel()))
    before = Marker(calls, label="before")  # registered before the profiler
    profiler = ProfilerObserver(num_rollouts=4, warmup_rollouts=1, save_path=tmp_path / "t.json", **FAST)
    after = Marker(calls)  # registered after it: its work must be in the profiled steps

    def plain(batch):
        with record_function("plain_callable"):
            calls.append(("plain", batch.numel()))

    collector.add_observer(before)
    collector.add_observer(profiler)
    collector.add_observer(after)
    collector.add_observer(plain)
    assert collector.observers == (before, profiler, after, plain)
    for _ in collector:
        pass

    # every batch, registration order (the user's own hook first), profiled or not
    expected = []
    for i in range(5):
        expected += [("before.pre", i), ("marker.pre", i)]
        expected += [("user_hook", 8), ("before.post", i), ("marker.post", i), ("plain", 8)]
    assert calls == expected
    assert before.rollout == 5

    events = trace_events(tmp_path / "t.json")
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    for rollout in (1, 2, 3):  # each recorded rollout: its observers' work is in its own step
        for name in (f"{label}/{event}#{rollout}" for label in ("before", "marker") for event in ("pre", "post")):
            (event,) = named(events, name)
            assert step_of(event, events) == f"ProfilerStep#{rollout}", name
    # including the later observers' work on the last recorded rollout
    assert len(named(events, "plain_callable")) == 3
    for rollout in (0, 4):  # not recorded: warm-up, and after the window
        assert not named(events, f"marker/post#{rollout}")


@pytest.mark.timeout(60)
def test_record_observers_times_each_other_observer(collectors, tmp_path):
    collector = collectors(batches=5)
    profiler = ProfilerObserver(
        num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t.json", record_observers=True, **FAST
    )
    seen = []

    def count_frames(batch):
        seen.append(batch.numel())

    collector.add_observer(profiler)
    collector.add_observer(Marker())
    collector.add_observer(count_frames)
    for _ in collector:
        pass
    events = trace_events(tmp_path / "t.json")
    for name in (
        "rl_observers/Marker.on_pre_collect",
        "rl_observers/Marker.on_post_collect",
        "rl_observers/count_frames.on_post_collect",
    ):
        ranges = named(events, name)
        assert [step_of(e, events) for e in ranges] == ["ProfilerStep#1", "ProfilerStep#2"], name
    # the observer's own range is inside the one recorded for it
    (post,) = named(events, "marker/post#2")
    outer = [e for e in named(events, "rl_observers/Marker.on_post_collect") if e["ts"] <= post["ts"]][-1]
    assert post["ts"] + post["dur"] <= outer["ts"] + outer["dur"]
    assert not named(events, "rl_observers/ProfilerObserver")
    assert seen == [8] * 5
    # once the profiler is done, observers are called directly again: no wrapper left
    observers = observers_of(collector)
    assert observers.call_transform is None


@pytest.mark.timeout(60)
def test_shutdown_stops_early_and_writes_what_was_recorded(collectors, tmp_path):
    collector = collectors(batches=10)
    profiler = ProfilerObserver(num_rollouts=8, warmup_rollouts=1, save_path=tmp_path / "t.json", **FAST)
    collector.add_observer(profiler)
    for i, _ in enumerate(collector):
        if i == 2:
            break
    assert profiler.active and profiler.trace_path is None
    collector.shutdown()
    assert not profiler.active
    # rollouts 1 and 2, and step 3 that had begun: the consumer's work on batch 2
    events = trace_events(tmp_path / "t.json")
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


@pytest.mark.timeout(60)
def test_removing_the_observer_stops_it(collectors, tmp_path):
    collector = collectors(batches=6)
    profiler = ProfilerObserver(num_rollouts=5, warmup_rollouts=0, save_path=tmp_path / "t.json", **FAST)
    with collector.add_observer(profiler):
        for i, _ in enumerate(collector):
            if i == 1:
                break
    assert not profiler.active
    assert steps(trace_events(tmp_path / "t.json")) == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    for _ in collector:  # goes on without the profiler
        pass
    assert collector.observers == ()
    assert type(collector) is Collector


@pytest.mark.timeout(60)
def test_profiles_only_selected_workers(collectors, tmp_path):
    """A worker's collector (``worker_idx`` set) profiles only if selected; paths use its index."""
    path = tmp_path / "t_{worker_idx}.json"
    skipped = ProfilerObserver(workers=[0], num_rollouts=2, warmup_rollouts=1, save_path=path, **FAST)
    chosen = ProfilerObserver(workers=[0, 1], num_rollouts=2, warmup_rollouts=1, save_path=path, **FAST)
    worker = collectors(batches=3, worker_idx=1)
    worker.add_observer(skipped)
    for _ in worker:
        pass
    assert skipped.trace_path is None and not (tmp_path / "t_1.json").exists()
    worker = collectors(batches=3, worker_idx=1)
    worker.add_observer(chosen)
    for _ in worker:
        pass
    assert chosen.trace_path == tmp_path / "t_1.json"
    # a collector that is nobody's worker is worker 0, profiled whatever ``workers`` says (torchrl)
    single = collectors(batches=3)
    alone = ProfilerObserver(workers=[1], num_rollouts=2, warmup_rollouts=1, save_path=path, **FAST)
    single.add_observer(alone)
    for _ in single:
        pass
    assert alone.trace_path == tmp_path / "t_0.json"


@pytest.mark.timeout(60)
def test_custom_on_trace_ready(collectors, tmp_path):
    ready = []
    collector = collectors(batches=3)
    collector.add_observer(
        ProfilerObserver(num_rollouts=2, warmup_rollouts=1, on_trace_ready=ready.append, **FAST)
    )
    for _ in collector:
        pass
    assert len(ready) == 1 and isinstance(ready[0], torch.profiler.profile)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_available_activity_profiles_nothing(collectors, tmp_path):
    collector = collectors(batches=3)
    sizes = []
    collector.add_observer(
        ProfilerObserver(num_rollouts=2, warmup_rollouts=0, activities=["cuda"], save_path=tmp_path / "c.json")
    )
    collector.add_observer(lambda batch: sizes.append(batch.numel()))
    for _ in collector:
        pass
    assert sizes == [8] * 3
    assert not (tmp_path / "c.json").exists()


@pytest.mark.timeout(60)
def test_one_profile_per_process(collectors, tmp_path):
    """Two profilers at once would crash torch's Kineto: the second one stands down."""
    first, second = collectors(batches=4), collectors(batches=4)
    one = ProfilerObserver(num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "one.json", **FAST)
    two = ProfilerObserver(num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "two.json", **FAST)
    first.add_observer(one)
    second.add_observer(two)
    sizes = []
    second.add_observer(lambda batch: sizes.append(batch.numel()))
    for _ in zip(first, second):
        pass
    assert one.trace_path == tmp_path / "one.json"
    assert two.trace_path is None and not two.active and sizes == [8] * 4
    # once the first is done, the process is free again
    third = ProfilerObserver(num_rollouts=2, warmup_rollouts=0, save_path=tmp_path / "three.json", **FAST)
    collector = collectors(batches=2)
    collector.add_observer(third)
    for _ in collector:
        pass
    assert third.trace_path == tmp_path / "three.json"


@pytest.mark.timeout(60)
def test_stands_down_inside_a_user_profiler(collectors, tmp_path):
    collector = collectors(batches=3)
    observer = ProfilerObserver(num_rollouts=2, warmup_rollouts=0, save_path=tmp_path / "t.json", **FAST)
    collector.add_observer(observer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as user_profiler:
        for _ in collector:
            pass
    assert observer.trace_path is None and not observer.active
    assert any(e.key.startswith("aten::") for e in user_profiler.key_averages())  # the user's still works


@pytest.mark.timeout(60)
def test_pickled_copy_starts_from_scratch(collectors, tmp_path):
    profiler = ProfilerObserver(num_rollouts=2, warmup_rollouts=1, save_path=tmp_path / "t_{worker_idx}.json", **FAST)
    collector = collectors(batches=3)
    collector.add_observer(profiler)
    for _ in collector:
        pass
    assert profiler.trace_path is not None
    copy = pickle.loads(pickle.dumps(profiler))
    assert copy.config == profiler.config and copy.trace_path is None and not copy.active
    (tmp_path / "t_0.json").unlink()
    other = collectors(batches=3)
    other.add_observer(copy)
    for _ in other:
        pass
    assert copy.trace_path == tmp_path / "t_0.json"


def test_observer_list_call_transform_seam(collectors):
    """The seam record_observers uses: applied at every registration, free once removed."""
    collector = collectors(batches=2)
    calls: list = []
    first = Marker(calls, label="first")
    collector.add_observer(first)
    observers = observers_of(collector)

    def reverse(event, event_calls):
        return reversed(event_calls)

    assert observers.set_call_transform(reverse) is None and observers.call_transform is reverse
    second = Marker(calls, label="second")
    collector.add_observer(second)  # registered after the transform: transformed too
    next(iter(collector))
    assert calls == [("second.pre", 0), ("first.pre", 0), ("second.post", 0), ("first.post", 0)]
    assert observers.set_call_transform(None) is reverse
    # without a transform the call tuple holds the observers' own bound methods, in order
    assert [fn for fn, _ in observers._calls["post_collect"]] == [first.on_post_collect, second.on_post_collect]


# -- enable_profile / disable_profile -------------------------------------------------------------


@pytest.mark.real_collector
def test_install_profiling_is_idempotent():
    install_profiling()
    install_profiling()
    from rl_observers import profiler

    for cls in (BaseCollector, Collector, MultiSyncCollector):
        assert getattr(cls.enable_profile, "__wrapped__", cls.enable_profile) is profiler.enable_profile
        assert getattr(cls.disable_profile, "__wrapped__", cls.disable_profile) is profiler.disable_profile


def _enable(collector, tmp_path, **kwargs):
    collector.enable_profile(
        num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t_{worker_idx}.json", **FAST, **kwargs
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["hook_then_profile", "profile_then_hook"])
def test_enable_profile_keeps_the_user_hook(collectors, tmp_path, order):
    collector = collectors(batches=5)
    sizes = []

    def hook(batch):
        sizes.append(batch.numel())

    if order == "hook_then_profile":
        collector.post_collect_hook = hook
        _enable(collector, tmp_path)
    else:
        _enable(collector, tmp_path)
        collector.post_collect_hook = hook  # torchrl: this silently removed the profiler
    assert collector.profile_config is not None and collector.profile_config.num_rollouts == 3
    (profiler,) = collector.observers
    assert isinstance(profiler, ProfilerObserver) and profiler.config is collector.profile_config
    for _ in collector:
        pass
    assert sizes == [8] * 5  # torchrl: 0 runs while profiling
    assert steps(trace_events(tmp_path / "t_0.json")) == ["ProfilerStep#1", "ProfilerStep#2"]
    collector.disable_profile()
    assert collector.profile_config is None and collector.observers == ()
    assert collector.post_collect_hook is hook  # torchrl: dropped by disable_profile
    assert type(collector) is Collector


@pytest.mark.timeout(60)
def test_disable_then_hook_and_observers_survive(collectors, tmp_path):
    collector = collectors(batches=4)
    sizes = []
    collector.post_collect_hook = sizes.append
    other = Marker()
    collector.add_observer(other)
    _enable(collector, tmp_path)
    collector.disable_profile()
    assert collector.observers == (other,)
    assert collector.post_collect_hook is not None
    for _ in collector:
        pass
    assert len(sizes) == 4 and other.rollout == 4
    assert not (tmp_path / "t_0.json").exists()
    collector.disable_profile()  # a no-op the second time, and without profiling
    collectors(batches=1).disable_profile()


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disable_profile_refused_while_iterating_keeps_the_profiler_to_remove_later(tmp_path):
    # An iterated MultiAsyncCollector refuses observer changes: the profiler stays, and is
    # removed by a later disable_profile() once the loop is over.
    collector = MultiAsyncCollector(
        [CountingEnv] * 2, RandomPolicy(CountingEnv().action_spec), frames_per_batch=8, total_frames=48
    )
    try:
        _enable(collector, tmp_path)
        for index, _ in enumerate(collector):
            if index == 1:
                with pytest.raises(RuntimeError, match="being iterated"):
                    collector.disable_profile()
                assert collector.profile_config is not None
                assert [type(o) for o in collector.observers] == [ProfilerObserver]
        collector.disable_profile()
        assert collector.profile_config is None and collector.observers == ()
    finally:
        collector.shutdown()


@pytest.mark.timeout(60)
def test_enable_profile_again_replaces_the_profiler(collectors, tmp_path):
    collector = collectors(batches=4)
    _enable(collector, tmp_path / "first")
    _enable(collector, tmp_path / "second")
    assert len(collector.observers) == 1
    for _ in collector:
        pass
    assert not (tmp_path / "first").exists()
    assert (tmp_path / "second" / "t_0.json").exists()


def test_enable_profile_keeps_torchrl_errors(collectors, tmp_path):
    collector = collectors(batches=3)
    with pytest.raises(ValueError, match="must be greater than"):
        collector.enable_profile(num_rollouts=1, warmup_rollouts=1)
    assert collector.observers == () and collector.profile_config is None
    next(iter(collector))
    with pytest.raises(RuntimeError, match="after iteration has started"):
        _enable(collector, tmp_path)
    assert collector.observers == ()


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_enable_profile_on_a_closed_multi_collector_raises():
    env_maker = CountingEnv
    collector = MultiSyncCollector(
        [env_maker], RandomPolicy(CountingEnv().action_spec), frames_per_batch=8, total_frames=8
    )
    collector.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        collector.enable_profile()


# -- multi-process collectors ------------------------------------------------------------------------

def _multi_sync(batches: int = 5) -> MultiSyncCollector:
    return MultiSyncCollector(
        [CountingEnv, CountingEnv],
        RandomPolicy(CountingEnv().action_spec),
        frames_per_batch=16,
        total_frames=16 * batches,
    )


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_multi_sync_profiles_in_the_selected_workers(tmp_path):
    """``enable_profile`` and a ProfilerObserver, each in its own worker, with a hook and an observer."""
    collector = _multi_sync(batches=5)  # 2 workers, 8 frames each per batch
    hook_log = tmp_path / "hook.log"
    try:
        # the hook runs in the workers: it leaves its mark in a file
        collector.post_collect_hook = lambda batch: hook_log.open("a").write(f"{batch.numel()}\n")
        _enable(collector, tmp_path, workers=[1])
        profiler = ProfilerObserver(
            workers=[0],
            num_rollouts=3,
            warmup_rollouts=1,
            save_path=tmp_path / "w_{worker_idx}.json",
            record_observers=True,
            **FAST,
        )
        marker = Marker()
        collector.add_observer(profiler)
        collector.add_observer(marker)
        for _ in collector:
            pass
        collector.disable_profile()
        assert collector.observers == (profiler, marker)
    finally:
        collector.shutdown()
    assert hook_log.read_text().split() == ["8"] * 10  # profiled or not, every batch of both workers
    # enable_profile(workers=[1]): a trace from worker 1 only
    assert not (tmp_path / "t_0.json").exists()
    assert steps(trace_events(tmp_path / "t_1.json")) == ["ProfilerStep#1", "ProfilerStep#2"]
    # the observer (workers=[0]): a trace from worker 0 only, timing the other observer there
    assert not (tmp_path / "w_1.json").exists()
    events = trace_events(tmp_path / "w_0.json")
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2"]
    ranges = named(events, "rl_observers/Marker.on_post_collect")
    assert [step_of(e, events) for e in ranges] == ["ProfilerStep#1", "ProfilerStep#2"]
    assert [step_of(e, events) for e in named(events, "marker/post#")] == ["ProfilerStep#1", "ProfilerStep#2"]


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ray_collector_enable_profile_traces_the_selected_remote_collector(ray_cluster, tmp_path):
    from torchrl.collectors.distributed import RayCollector

    with warnings.catch_warnings():  # a non-module policy has no weights to synchronise
        warnings.simplefilter("ignore", UserWarning)
        collector = RayCollector(
            [CountingEnv, CountingEnv],
            RandomPolicy(CountingEnv().action_spec),
            frames_per_batch=16,
            total_frames=16 * 4,
            sync=True,
            remote_configs={"num_cpus": 1},
        )
    try:
        _enable(collector, tmp_path, workers=[1])
        assert [type(o) for o in collector.observers] == [ProfilerObserver]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            frames = sum(batch.numel() for batch in collector)
        collector.disable_profile()
        assert collector.observers == () and collector.profile_config is None
    finally:
        collector.shutdown()
    assert frames == 64
    assert not (tmp_path / "t_0.json").exists()
    assert steps(trace_events(tmp_path / "t_1.json")) == ["ProfilerStep#1", "ProfilerStep#2"]


# -- the example ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_example_profile_and_log(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_and_log", REPO / "examples" / "profile_and_log.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(tmp_path, frames_per_batch=50, total_frames=300, log_every=100, num_rollouts=3)
    assert result["hook_frames"] == result["logged_frames"] == 300
    events = trace_events(result["trace"])
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2"]
    ranges = named(events, "rl_observers/LoggerObserver.on_post_collect")
    assert [step_of(e, events) for e in ranges] == ["ProfilerStep#1", "ProfilerStep#2"]
    assert list(result["log_dir"].rglob("*.csv"))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_example_with_torchrl_ranges_has_one_rollout_range_per_step(tmp_path):
    """With ``TORCHRL_PROFILING=1`` every recorded step holds one whole ``Collector.rollout``."""
    env = {**os.environ, "TORCHRL_PROFILING": "1"}
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "profile_and_log.py"), str(tmp_path)],
        env=env,
        check=True,
        capture_output=True,
        timeout=80,
    )
    events = trace_events(tmp_path / "profile" / "trace_0.json")
    rollouts = named(events, "Collector.rollout")
    assert [step_of(e, events) for e in rollouts] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def test_package_exports_profiler_observer():
    assert "ProfilerObserver" in rl_observers.__all__
    assert rl_observers.ProfilerObserver is ProfilerObserver


def test_one_config_table_matches_both_signatures_and_torchrl():
    import inspect

    from rl_observers import profiler

    ours = inspect.signature(profiler.enable_profile).parameters
    theirs = inspect.signature(profiler._ORIGINALS["enable_profile"]).parameters
    observer = inspect.signature(ProfilerObserver).parameters
    keys = profiler.CONFIG_KEYS
    # (Ray adds a private ``_ray_trace_ctx`` to methods of classes it made actors of)
    assert [k for k in ours if k != "self" and not k.startswith("_")] == list(keys)
    assert [k for k in theirs if k != "self" and not k.startswith("_")] == list(keys)
    extra = ("config", "record_observers", "start_after_frames", "start_after_batches", "start_when")
    assert [k for k in observer if k not in extra] == list(keys)
    assert {k: ours[k].default for k in keys} == profiler.CONFIG_DEFAULTS
    assert {k: theirs[k].default for k in keys} == profiler.CONFIG_DEFAULTS


# -- starting later: profile training, not the warm-up --------------------------------------------


def marked(events: list[dict]) -> dict[str, str | None]:
    """The Marker ranges in a trace, each with the profiler step that holds it."""
    return {e["name"]: step_of(e, events) for e in named(events, "marker/")}


RECORDED_3_4 = {
    "marker/pre#3": "ProfilerStep#1",
    "marker/post#3": "ProfilerStep#1",
    "marker/pre#4": "ProfilerStep#2",
    "marker/post#4": "ProfilerStep#2",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "start", [{"start_after_frames": 16}, {"start_after_frames": 9}, {"start_after_batches": 2}], ids=str
)
def test_start_after_skips_the_first_rollouts(collectors, tmp_path, start):
    collector = collectors(batches=8)  # 8 frames per batch
    profiler = ProfilerObserver(num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t.json", **start, **FAST)
    collector.add_observer(profiler)
    collector.add_observer(Marker())
    for _ in collector:
        pass
    # rollouts 0 and 1 reach the threshold, 2 warms up, 3 and 4 are recorded: nothing before
    assert marked(trace_events(tmp_path / "t.json")) == RECORDED_3_4
    assert "start_after" in repr(profiler)


class _AfterFile:
    """A picklable ``start_when``: true once a file exists."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls = 0

    def __call__(self, source) -> bool:
        self.calls += 1
        return self.path.exists()


@pytest.mark.timeout(60)
def test_start_when_and_start_trigger(collectors, tmp_path):
    flag = tmp_path / "go"
    collector = collectors(batches=8)
    when = _AfterFile(flag)
    profiler = ProfilerObserver(
        num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t.json", start_after_batches=1, start_when=when, **FAST
    )
    collector.add_observer(profiler)
    collector.add_observer(Marker())
    for i, _ in enumerate(collector):
        if i == 1:
            flag.touch()  # seen before rollout 2
    assert when.calls > 0
    # start_when holds at rollout 2's pre_collect: rollout 2 is step 0 (warm-up), 3 and 4 recorded
    assert marked(trace_events(tmp_path / "t.json")) == RECORDED_3_4

    # start(): the user's trigger in process, whatever the thresholds say
    collector = collectors(batches=8)
    profiler = ProfilerObserver(
        num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "u.json", start_after_frames=10**9, **FAST
    )
    collector.add_observer(profiler)
    collector.add_observer(Marker())
    for i, _ in enumerate(collector):
        if i == 1:
            profiler.start()  # before rollout 2
    assert marked(trace_events(tmp_path / "u.json")) == RECORDED_3_4


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"start_after_frames": -1}, ValueError),
        ({"start_after_batches": 1.5}, ValueError),
        ({"start_after_frames": True}, ValueError),
        ({"start_when": 3}, TypeError),
    ],
)
def test_invalid_start_options_raise(kwargs, error):
    with pytest.raises(error, match="start_"):
        ProfilerObserver(**kwargs)


def test_pickled_copy_keeps_the_start_options(tmp_path):
    import cloudpickle

    profiler = ProfilerObserver(start_after_frames=5, start_after_batches=2, start_when=_AfterFile(tmp_path / "x"))
    profiler._frames_seen = 100
    copy = cloudpickle.loads(cloudpickle.dumps(profiler))
    assert (copy.start_after_frames, copy.start_after_batches) == (5, 2)
    assert isinstance(copy.start_when, _AfterFile) and copy._frames_seen == 0


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_start_after_counts_each_workers_frames(tmp_path):
    collector = _multi_sync(batches=8)  # 2 workers, 8 frames each per batch
    try:
        profiler = ProfilerObserver(
            workers=[0, 1], num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "w_{worker_idx}.json",
            start_after_frames=16, **FAST,
        )
        collector.add_observer(profiler)
        collector.add_observer(Marker())
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    for worker in (0, 1):  # 16 frames of that worker, not of both
        assert marked(trace_events(tmp_path / f"w_{worker}.json")) == RECORDED_3_4


# -- Ray: traces come back to the driver ------------------------------------------------------------


def test_files_sent_back_are_written_on_the_driver(tmp_path):
    from rl_observers.remote.ray import observed as ray_source

    assert ray_source.send_file_to_driver(tmp_path / "nothing.json") is False  # not in a Ray actor
    here = tmp_path / "same.json"
    here.write_bytes(b"same")
    mtime = here.stat().st_mtime_ns
    far = tmp_path / "far" / "away" / "t_0.json"
    ray_source._write_files([(str(here), b"same"), (str(far), b"{}")])
    assert here.stat().st_mtime_ns == mtime  # already there: left alone
    assert far.read_bytes() == b"{}" and [p.name for p in far.parent.iterdir()] == ["t_0.json"]


def one_actor_ray_collector(remote_configs: dict) -> Any:
    """A synchronous one-actor ``RayCollector``: 8 batches of 8 frames, actor placed by ``remote_configs``."""
    from torchrl.collectors.distributed import RayCollector

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return RayCollector(
            [CountingEnv],
            RandomPolicy(CountingEnv().action_spec),
            frames_per_batch=8,
            total_frames=8 * 8,
            sync=True,
            remote_configs=remote_configs,
        )


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("until", ["shutdown", "remove"])
def test_ray_collector_traces_come_back_to_the_driver(ray_cluster, tmp_path, until):
    collector = one_actor_ray_collector({"num_cpus": 1})
    trace = tmp_path / "ray_{worker_idx}.json"
    profiler = ProfilerObserver(
        num_rollouts=3, warmup_rollouts=1, save_path=trace, start_after_frames=16, **FAST
    )
    written = tmp_path / "ray_0.json"
    try:
        collector.add_observer(profiler)
        collector.add_observer(Marker())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for i, _ in enumerate(collector):
                if i == 5:
                    # written by the actor after rollout 4; on this node the driver sees it already:
                    # remove it, as if the actor had run on a node that shares no files with us
                    assert written.exists()
                    written.unlink()
                    if until == "remove":
                        collector.remove_observer(profiler)
                        assert written.exists()
    finally:
        collector.shutdown()
    assert marked(trace_events(written)) == RECORDED_3_4


# -- predictable defaults: which workers, where their traces went, a trace a browser opens -------


def test_default_options_make_a_trace_without_python_stacks(collectors, tmp_path):
    """The default drops Python stacks (torchrl's ``enable_profile`` keeps them): ~8x smaller traces."""
    observer = ProfilerObserver()
    assert observer.config.with_stack is False and observer.config.record_shapes is True
    assert observer.config.workers == [0]
    assert ProfilerObserver(with_stack=True).config.with_stack is True
    source = collectors(frames_per_batch=50, batches=3)
    profiler = ProfilerObserver(num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t_{worker_idx}.json", activities=["cpu"])
    source.add_observer(profiler)
    for _ in source:
        pass
    events = trace_events(profiler.trace_path)  # a well-formed Chrome trace
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert not [e for e in events if e.get("cat") == "python_function"]  # no stacks recorded
    assert profiler.trace_paths == {0: profiler.trace_path}


@pytest.mark.real_collector
@pytest.mark.timeout(120)
def test_trace_paths_lists_each_workers_trace_on_the_driver(tmp_path):
    """A 2-worker MultiSyncCollector profiled in both workers: the driver says where each trace went."""
    stale = tmp_path / "t_1.json"
    stale.write_text("{}")  # an older trace at a worker's path is not listed as written...
    os.utime(stale, (0, 0))
    env = CountingEnv(max_steps=5)
    collector = MultiSyncCollector(
        [CountingEnv, CountingEnv], RandomPolicy(env.action_spec), frames_per_batch=16, total_frames=64
    )
    profiler = ProfilerObserver(
        workers=[0, 1], num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "t_{worker_idx}.json", **FAST
    )
    try:
        collector.add_observer(profiler)
        assert profiler.trace_paths == {}  # nothing written yet
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert profiler.trace_path is None  # the driver profiled nothing itself
    assert profiler.trace_paths == {0: tmp_path / "t_0.json", 1: tmp_path / "t_1.json"}  # ...until rewritten
    for path in profiler.trace_paths.values():
        assert steps(trace_events(path)) == ["ProfilerStep#1", "ProfilerStep#2"]
