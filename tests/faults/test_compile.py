"""Compilation: an observed ``compilable=True`` replay buffer inside a ``torch.compile``d function.

Observers run eagerly, outside the compiled region: the compiled function
gets the graphs and graph breaks it gets without observers, nothing is
recompiled because of them, its outputs do not change, and the observers see
every write and sample. ``fullgraph=True`` is limited by torchrl 0.14.1
itself: ``ReplayBuffer.sample`` takes a lock that dynamo cannot trace, with
or without observers.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torchrl.data import LazyTensorStorage, ReplayBuffer

from rl_observers import LoggerObserver, MetricsChannel, SampleMetrics, WriteMetrics
from tests.helpers import RecordingLogger

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CALLS = 5


@pytest.fixture(scope="module", autouse=True)
def compile_works():
    try:
        torch.compile(lambda x: x + 1)(torch.ones(2))
    except Exception as error:  # pragma: no cover - depends on the machine
        pytest.skip(f"torch.compile is not usable here: {type(error).__name__}: {error}")
    yield
    torch._dynamo.reset()


class WhereItRuns:
    """Records, at each event, whether dynamo was tracing it."""

    def __init__(self) -> None:
        self.tracing: list[bool] = []
        self.sampled: list[float] = []

    def on_post_extend(self, source, data, index):
        self.tracing.append(torch.compiler.is_compiling())

    def on_post_sample(self, source, batch, info):
        self.tracing.append(torch.compiler.is_compiling())
        self.sampled.append(float(batch.sum()))  # a host sync: a graph break if it were traced


def _compilable_filled_buffer() -> ReplayBuffer:
    rb = ReplayBuffer(storage=LazyTensorStorage(100, compilable=True), batch_size=8, compilable=True)
    rb.extend(torch.arange(100.0))
    return rb


def _run(observe: bool):
    """Explains and runs a compiled write-and-sample step; returns what was seen."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    rb = _compilable_filled_buffer()
    logger = RecordingLogger()
    channel = MetricsChannel(logger, background=False, health_interval=None)
    where = WhereItRuns()
    if observe:
        rb.add_observer(where)
        rb.add_observer(LoggerObserver(channel, metrics=[WriteMetrics(), SampleMetrics()], name="rb", schedule=None))

    def step(x):
        rb.extend(x)
        return rb.sample() * 2

    explanation = torch._dynamo.explain(step)(torch.arange(4.0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step)
    outputs = [compiled(torch.arange(4.0) + i) for i in range(CALLS)]
    graphs = (explanation.graph_count, explanation.graph_break_count, counters["stats"]["unique_graphs"])
    channel.step()
    return graphs, outputs, where, logger


def test_observers_add_no_graph_and_run_outside_the_compiled_region():
    bare_graphs, bare_outputs, _, _ = _run(observe=False)
    graphs, outputs, where, logger = _run(observe=True)
    assert graphs == bare_graphs  # same graphs, same breaks, nothing recompiled for observers
    for a, b in zip(bare_outputs, outputs):
        assert torch.equal(a, b)
    events = 2 * (CALLS + 1)  # explain ran the step once more
    assert where.tracing == [False] * events  # never traced, always eager
    assert len(where.sampled) == CALLS + 1
    assert logger.series("rb/sample_calls")[-1][1] == CALLS + 1
    # on the buffer's write_count axis: the 100 items written before attaching count too
    assert logger.series("rb/items_written")[-1][1] == 100 + 4 * (CALLS + 1)


def _fullgraph_error(observe: bool) -> BaseException | None:
    torch._dynamo.reset()
    rb = _compilable_filled_buffer()
    if observe:
        rb.add_observer(WhereItRuns())

    def step():
        return rb.sample() * 2

    try:
        torch.compile(step, fullgraph=True)()
    except Exception as error:
        return error
    return None


def test_fullgraph_is_limited_by_torchrl_not_by_observers():
    bare = _fullgraph_error(observe=False)
    assert bare is not None, "torchrl's sample compiles with fullgraph=True now: check observers"
    observed = _fullgraph_error(observe=True)
    assert type(observed) is type(bare)
    assert str(observed).splitlines()[0] == str(bare).splitlines()[0]
