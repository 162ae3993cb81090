"""Observing changes nothing torchrl does: every scenario runs unobserved, then observed, and must agree.

Each scenario drives real torchrl collectors and replay buffers through their
public API and returns what a user would see (collected and sampled batches,
indices and infos, storage contents, checkpoints, hook calls, the RNG state
afterwards). It runs once with nothing attached and once with a
``LoggerObserver`` (default metric sets, CSV logger under ``tmp_path``) and an
:class:`~rl_observers.testing.EventRecorder` on every collector and buffer it
builds, both with ``on_error="raise"`` where the source allows it, so an
observer that fails fails the test. Same seeds, so the two runs must be
identical. The differences observing makes on purpose (``stats()`` entries)
are checked against ``docs/torchrl_differences.rst``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import (
    LazyTensorStorage,
    ListStorage,
    ReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers.csv import CSVLogger
from torchrl.testing.mocking_classes import (
    ContinuousActionVecMockEnv,
    CountingEnv,
    NestedCountingEnv,
)

from rl_observers import LoggerObserver
from rl_observers.testing import EventRecorder
from tests.helpers import replay_buffer, start_method

pytestmark = pytest.mark.timeout(120)

# What observers add to ``stats()`` on purpose (docs/torchrl_differences.rst).
STATS_ADDED_BY_OBSERVERS = {"writes", "items_written", "seconds_since_last_write", "sample_calls", "samples_returned"}



class Observe:
    """Attaches a LoggerObserver and an EventRecorder to each source it is given, or nothing."""

    def __init__(self, enabled, tmp_path):
        self.enabled = enabled
        self.tmp_path = tmp_path
        self.recorders = []
        self.logger = CSVLogger("parity", log_dir=str(tmp_path / "csv")) if enabled else None

    def __call__(self, source, on_error="raise"):
        if self.enabled:
            recorder = EventRecorder()
            # one namespace per source: a scenario may observe several buffers on one logger
            name = f"source_{len(self.recorders)}"
            source.add_observer(LoggerObserver(self.logger, on_error=on_error, schedule=None, name=name))
            source.add_observer(recorder, on_error=on_error)
            self.recorders.append(recorder)
        return source


def _run_both(scenario, tmp_path, events_here=True):
    """Runs ``scenario(observe, tmp)`` unobserved then observed, from the same seed; returns both results.

    ``events_here``: the recorders attached here see events (not so for worker processes' copies).
    """
    results = []
    for enabled in (False, True):
        tmp = tmp_path / ("observed" if enabled else "bare")
        tmp.mkdir()
        observe = Observe(enabled, tmp)
        torch.manual_seed(0)
        result = scenario(observe, tmp)
        result["rng_after"] = torch.get_rng_state()
        if enabled and events_here:
            assert any(r.events for r in observe.recorders), "the observers saw no event"
        results.append(result)
    return results


def assert_same(bare, observed, path="result"):
    """Recursively equal: tensors and tensordicts exactly, containers element by element."""
    if isinstance(bare, TensorDictBase):
        assert isinstance(observed, TensorDictBase), path
        assert set(bare.keys(True, True)) == set(observed.keys(True, True)), path
        assert bare.batch_size == observed.batch_size, path
        for key in bare.keys(True, True):
            assert_same(bare.get(key), observed.get(key), f"{path}[{key!r}]")
    elif isinstance(bare, torch.Tensor):
        assert isinstance(observed, torch.Tensor), path
        assert bare.dtype == observed.dtype and bare.shape == observed.shape, path
        assert torch.equal(bare, observed), path
    elif isinstance(bare, dict):
        assert set(bare) == set(observed), (path, set(bare) ^ set(observed))
        for key in bare:
            assert_same(bare[key], observed[key], f"{path}[{key!r}]")
    elif isinstance(bare, (list, tuple)):
        assert type(bare) is type(observed) and len(bare) == len(observed), path
        for i, (a, b) in enumerate(zip(bare, observed)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert bare == observed, (path, bare, observed)


def _compare(scenario, tmp_path):
    bare, observed = _run_both(scenario, tmp_path)
    assert_same(bare, observed)


# -- collectors --------------------------------------------------------------------------------------


def _linear_policy():
    env = ContinuousActionVecMockEnv()
    module = nn.Linear(env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1])
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"]), module


@pytest.mark.real_collector
def test_collector_iteration(tmp_path):
    def scenario(observe, tmp):
        env = CountingEnv(max_steps=5)
        collector = observe(Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32))
        collector.set_seed(1)
        batches = [b.clone() for b in collector]
        state = collector.state_dict()
        collector.shutdown()
        return {"batches": batches, "state": state}

    _compare(scenario, tmp_path)


@pytest.mark.real_collector
def test_collector_update_policy_weights(tmp_path):
    def scenario(observe, tmp):
        torch.manual_seed(0)
        policy, module = _linear_policy()
        collector = observe(Collector(ContinuousActionVecMockEnv(), policy, frames_per_batch=8, total_frames=24))
        collector.set_seed(3)
        batches = []
        for i, batch in enumerate(collector):
            batches.append(batch.clone())
            with torch.no_grad():
                module.weight.add_(1.0 + i)
            collector.update_policy_weights_()
        collector.shutdown()
        return {"batches": batches}

    _compare(scenario, tmp_path)


@pytest.mark.real_collector
def test_collector_start_with_replay_buffer(tmp_path):
    """``.start()`` runs the collector in a thread until ``total_frames``; the buffer ends up identical."""

    def scenario(observe, tmp):
        env = CountingEnv(max_steps=5)
        rb = observe(ReplayBuffer(storage=LazyTensorStorage(100)))
        collector = observe(
            Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32, replay_buffer=rb)
        )
        collector.set_seed(1)
        collector.start()
        deadline = time.monotonic() + 60
        while rb.write_count < 32:
            assert time.monotonic() < deadline, f"only {rb.write_count} frames written"
            time.sleep(0.01)
        collector.async_shutdown(timeout=10)
        return {"storage": rb[:], "write_count": rb.write_count}

    _compare(scenario, tmp_path)


def _hook_pattern(collector):
    """Set, replace and clear both hook slots between batches; returns what the hooks saw."""
    calls = []
    seen_slots = []
    it = iter(collector)

    def pre_a():
        calls.append("pre_a")

    def post_a(batch):
        calls.append(("post_a", batch.numel()))

    def post_b(batch):
        calls.append(("post_b", batch.numel()))

    collector.pre_collect_hook = pre_a
    collector.post_collect_hook = post_a
    next(it)
    collector.post_collect_hook = post_b  # replace
    next(it)
    collector.post_collect_hook = None  # clear
    collector.pre_collect_hook = None
    next(it)
    seen_slots.append((collector.pre_collect_hook, collector.post_collect_hook))
    collector.shutdown()
    return calls, seen_slots


@pytest.mark.real_collector
def test_hook_slots_set_replace_clear(tmp_path):
    def scenario(observe, tmp):
        env = CountingEnv(max_steps=5)
        collector = observe(Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32))
        calls, _ = _hook_pattern(collector)
        return {"calls": calls}

    _compare(scenario, tmp_path)


@pytest.mark.real_collector
def test_hook_slots_read_back_what_was_set(tmp_path):
    def scenario(observe, tmp):
        env = CountingEnv(max_steps=5)
        collector = observe(Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32))
        _, seen = _hook_pattern(collector)
        return {"slots": seen}

    _compare(scenario, tmp_path)


@pytest.mark.real_collector
def test_enable_profile_with_user_hook(tmp_path):
    def scenario(observe, tmp):
        env = CountingEnv(max_steps=5)
        collector = observe(Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32))
        seen = []
        collector.post_collect_hook = lambda batch: seen.append(batch.numel())
        collector.enable_profile(num_rollouts=2, warmup_rollouts=1, save_path=str(tmp / "trace_{worker_idx}.json"))
        collector.set_seed(1)
        batches = [b.clone() for b in collector]
        collector.shutdown()
        return {"batches": batches, "hook_calls": seen, "trace_written": (tmp / "trace_0.json").exists()}

    _compare(scenario, tmp_path)


@pytest.mark.real_collector
def test_nested_reward_env(tmp_path):
    def scenario(observe, tmp):
        env = NestedCountingEnv(max_steps=5, nest_obs_action=True, nest_done=True, nest_reward=True)
        collector = observe(Collector(env, RandomPolicy(env.full_action_spec), frames_per_batch=8, total_frames=16))
        batches = [b.clone() for b in collector]
        collector.shutdown()
        return {"batches": batches}

    _compare(scenario, tmp_path)


@pytest.mark.real_collector
def test_multisync_iteration_fork(tmp_path):
    def scenario(observe, tmp):
        with start_method("fork"):
            policy, _ = _linear_policy()
            collector = MultiSyncCollector(
                [ContinuousActionVecMockEnv, ContinuousActionVecMockEnv], policy, frames_per_batch=16, total_frames=48
            )
            observe(collector, on_error="warn")  # multiprocessing collectors refuse "raise"
            collector.set_seed(5)
            # trajectory ids are handed out in the order workers ask for them, which varies run to run
            batches = [b.exclude(("collector", "traj_ids")) for b in collector]
            collector.shutdown()
        return {"batches": batches}

    bare, observed = _run_both(scenario, tmp_path, events_here=False)
    assert_same(bare, observed)


# -- replay buffers ----------------------------------------------------------------------------------


def _data(n=40, start=0):
    steps = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": steps.float().unsqueeze(-1),
            "traj": steps // 8,
            ("next", "reward"): (steps % 3).float().unsqueeze(-1),
            ("next", "done"): (steps % 8 == 7).unsqueeze(-1),
            "rank": (steps * 7 % 11).float(),
        },
        batch_size=[n],
    )


def _parity_buffer(kind):
    if kind == "prioritized_plain":  # a ListStorage of tensors
        return replay_buffer(kind, storage=ListStorage(64), batch_size=8)
    if kind == "prefetch":  # one prefetch thread: two would draw from one generator in either order
        return replay_buffer("tensordict", batch_size=8, prefetch=1)
    return replay_buffer(kind, 16 if kind == "max_value" else 64, batch_size=8)


def _contents(rb):
    return [rb.storage[i] for i in range(len(rb))] if isinstance(rb.storage, ListStorage) else rb[:]


def _sample_all(rb, n=4):
    out = []
    for _ in range(n):
        sample = rb.sample(return_info=True)
        batch, info = sample
        out.append((batch.clone() if isinstance(batch, TensorDictBase) else batch, dict(info)))
    return out


def _buffer_scenario(kind):
    def scenario(observe, tmp):
        rb = observe(_parity_buffer(kind))
        rb.set_rng(torch.Generator().manual_seed(7))
        listed = kind == "prioritized_plain"  # a ListStorage of tensors
        index = rb.extend(list(torch.arange(40).unbind(0)) if listed else _data())
        added = rb.add(torch.tensor(100) if listed else _data(1, start=100)[0])
        out = {"extend_index": index, "add_index": added}
        if kind in ("prioritized", "prioritized_plain"):
            idx = torch.arange(0, 20)
            rb.update_priority(idx, torch.linspace(0.1, 2.0, 20))
        out["samples"] = _sample_all(rb)
        out["len"] = len(rb)
        out["write_count"] = rb.write_count
        out["storage"] = _contents(rb)
        stats = rb.stats()
        # torchrl's own entries are unchanged; observers add the documented ones and nothing else
        out["stats"] = {k: v for k, v in stats.items() if k not in STATS_ADDED_BY_OBSERVERS}
        if observe.enabled:
            assert set(stats) >= STATS_ADDED_BY_OBSERVERS
        # checkpoints (torchrl's TensorDictMaxValueWriter has none): state_dict and dumps/loads round trips
        checkpoints = kind != "max_value"
        if checkpoints:
            fresh = _parity_buffer(kind)
            fresh.load_state_dict(rb.state_dict())
            out["state_len"] = len(fresh)
            out["state_storage"] = _contents(fresh)
        if checkpoints and not listed:
            rb.dumps(tmp / "dump")
            loaded = observe(_parity_buffer(kind))
            loaded.loads(tmp / "dump")
            out["loaded"] = loaded[:]
            out["loaded_write_count"] = loaded.write_count
        rb.empty()
        out["len_after_empty"] = len(rb)
        rb.extend(list(torch.arange(8).unbind(0)) if listed else _data(8, start=200))
        out["after_empty"] = _contents(rb)
        return out

    return scenario


@pytest.mark.real_collector
@pytest.mark.parametrize(
    "kind",
    [
        "plain",
        "without_replacement",
        "prioritized",
        "prioritized_plain",
        "slice",
        "round_robin",
        "max_value",
        "prefetch",
    ],
)
def test_replay_buffer(tmp_path, kind):
    _compare(_buffer_scenario(kind), tmp_path)


def test_replay_buffer_stats_differences_are_the_documented_ones(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(16))
    rb.extend(torch.arange(4))
    rb.sample(2)
    bare = rb.stats()
    Observe(True, tmp_path)(rb)
    rb.extend(torch.arange(4))
    rb.sample(2)
    observed = rb.stats()
    assert set(observed) - set(bare) == STATS_ADDED_BY_OBSERVERS
    assert observed["sample_calls"] == 1 and observed["samples_returned"] == 2  # counted since attached


@pytest.mark.real_collector
def test_threads_sampling_and_writing(tmp_path):
    """Concurrent extend and sample through the public API: same final storage, no error either way."""

    def scenario(observe, tmp):
        rb = observe(TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=4))
        rb.extend(_data(8))
        errors = []

        def writer():
            try:
                for i in range(20):
                    rb.extend(_data(8, start=8 * (i + 1)))
            except Exception as error:  # pragma: no cover - reported below
                errors.append(error)

        thread = threading.Thread(target=writer)
        thread.start()
        for _ in range(20):
            rb.sample()
        thread.join()
        assert not errors
        return {"storage": rb[:], "write_count": rb.write_count}

    bare, observed = _run_both(scenario, tmp_path)
    bare.pop("rng_after"), observed.pop("rng_after")  # sampling interleaves with writes differently
    assert_same(bare, observed)

