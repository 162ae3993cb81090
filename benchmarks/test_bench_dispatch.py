"""Budget: event dispatch costs <= 1 us per event with one no-op observer; nothing with none.

Each test measures the observed and the unobserved operation in the same run,
in alternating blocks, in CPU time (``time.process_time``, which other
processes' load moves least), and asserts on the ratio; a ratio missed once is
measured once more. The absolute bound (1 us per event) is asserted by
``make bench`` only; ``make test`` (``--benchmark-disable``) asserts it
relative to a reference measured in the same run: dispatching to one observer
costs no more than blinker's ``Signal.send`` to one receiver (1.5 us on these
machines, 0.2 us for the dispatch).
"""

from __future__ import annotations

import time

import pytest
import torch
from blinker import Signal
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from benchmarks._timing import compare, paired_slowdowns

OBSERVER_COUNTS = (0, 1, 4)
# The slowdown ceilings make test asserts (one core may be busy): under that load the
# replay-buffer ratios with no-op observers measured up to 1.09 on correct code.
TEST_CEILINGS = {"1_observers": 1.25, "4_observers": 1.30}


def _limits(benchmark, budgets: dict[str, float]) -> dict[str, float]:
    """``budgets`` in make bench; make test's looser ceilings (``--benchmark-disable``)."""
    return {k: TEST_CEILINGS[k] if benchmark.disabled else v for k, v in budgets.items()}


class NoOp:
    """An observer of every event that does nothing."""

    def on_pre_collect(self, source):
        pass

    def on_post_collect(self, source, batch):
        pass

    def on_post_extend(self, source, data, index):
        pass

    def on_post_sample(self, source, batch, info):
        pass


def _buffers():
    buffers = {}
    for count in OBSERVER_COUNTS:
        rb = ReplayBuffer(storage=LazyTensorStorage(1_000_000))
        rb.extend(torch.arange(10_000))
        for _ in range(count):
            rb.add_observer(NoOp())
        buffers[count] = rb
    return buffers


def _report(benchmark, name, timings, bare):
    ratios = {f"{name}_ratio_{k}": timings[k] / timings[bare] for k in timings}
    benchmark.extra_info.update({f"{name}_us_{k}": v * 1e6 for k, v in timings.items()})
    benchmark.extra_info.update(ratios)
    print(f"\n{name}: " + ", ".join(f"{k}: {v * 1e6:.2f} us" for k, v in timings.items()))
    return ratios


def _slowdowns(benchmark, name, candidates, budgets, **timing):
    """Paired slowdowns vs ``0_observers``; a budget missed once is measured once more.

    Load from other processes fails one measurement; a regression fails both.
    """
    timing.setdefault("clock", time.process_time)
    slowdowns = paired_slowdowns(candidates, "0_observers", **timing)
    if any(slowdowns[k] > limit for k, limit in budgets.items()):
        again = paired_slowdowns(candidates, "0_observers", **timing)
        slowdowns = {k: min(v, again[k]) for k, v in slowdowns.items()}
    benchmark.extra_info.update({f"{name}_ratio_{k}": v for k, v in slowdowns.items()})
    print(f"\n{name}: " + ", ".join(f"{k}: {v:.3f}x" for k, v in slowdowns.items()))
    return slowdowns


def test_unobserved_source_is_torchrl_code():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    handle = rb.add_observer(NoOp())
    handle.remove()
    assert type(rb) is ReplayBuffer
    for name in ("extend", "add", "sample", "_sample", "empty"):
        assert getattr(rb, name).__func__ is getattr(ReplayBuffer, name)


def test_dispatch_cost_per_event(benchmark, request):
    """The emit path alone: <= 1 us per event with one no-op observer."""
    buffers = _buffers()
    data, index = torch.arange(256), torch.arange(256)
    emitters = {
        f"{count}_observers": (lambda lst=buffers[count]._rl_observers: lst.emit("post_extend", data, index))
        for count in OBSERVER_COUNTS
        if count
    }
    signal = Signal()
    signal.connect(NoOp().on_post_extend, weak=False)
    emitters["blinker_send_1"] = lambda: signal.send(None, data=data, index=index)

    def measure():
        return compare(emitters, calls=20_000, clock=time.process_time)

    timings = measure()
    if timings["1_observers"] > min(1e-6, timings["blinker_send_1"]):
        again = measure()
        timings = {k: min(v, again[k]) for k, v in timings.items()}
    _report(benchmark, "emit", timings, "1_observers")
    assert timings["1_observers"] <= timings["blinker_send_1"], timings
    if not request.config.getoption("benchmark_disable"):  # absolute times: make bench only
        assert timings["1_observers"] <= 1e-6, f"dispatch to one observer costs {timings['1_observers'] * 1e6:.2f} us"
    benchmark(emitters["1_observers"])


@pytest.mark.parametrize("operation", ["extend_256", "sample_256"])
def test_replay_buffer_operation_ratio(benchmark, operation):
    buffers = _buffers()
    data = torch.arange(256)
    if operation == "extend_256":
        ops = {count: (lambda rb=rb: rb.extend(data)) for count, rb in buffers.items()}
    else:
        ops = {count: (lambda rb=rb: rb.sample(256)) for count, rb in buffers.items()}
    budgets = _limits(benchmark, {"1_observers": 1.10, "4_observers": 1.15})
    slowdowns = _slowdowns(
        benchmark, operation, {f"{c}_observers": fn for c, fn in ops.items()}, budgets, calls=200
    )
    # ~0.2 us of dispatch on a ~20-50 us operation: any difference is noise.
    for key, limit in budgets.items():
        assert slowdowns[key] <= limit, (key, slowdowns[key])
    benchmark(ops[1])


def test_collector_batch_ratio(benchmark):
    """A 1000-frame collector batch (CountingEnv, batch_size=[100])."""
    collectors, iterators = {}, {}
    for count in OBSERVER_COUNTS:
        env = CountingEnv(batch_size=[100], max_steps=10**9)
        collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=1000, total_frames=-1)
        for _ in range(count):
            collector.add_observer(NoOp())
        collectors[count] = collector
        iterators[count] = iter(collector)
    try:
        budgets = _limits(benchmark, {"1_observers": 1.05, "4_observers": 1.05})
        slowdowns = _slowdowns(
            benchmark,
            "collector_1000",
            {f"{c}_observers": (lambda it=it: next(it)) for c, it in iterators.items()},
            budgets,
            calls=10,
            blocks=21,
        )
        for key, limit in budgets.items():
            assert slowdowns[key] <= limit, (key, slowdowns[key])
        benchmark(lambda: next(iterators[1]))
    finally:
        for collector in collectors.values():
            collector.shutdown()
