"""Shared pieces of the fault-tolerance tests.

One seeded collection loop (a real ``Collector`` writing into a real replay
buffer and sampling from it) whose data is compared with and without faulty
observers or sinks. The waits, the balance identity and the collectors are in
``tests/helpers.py``; the ``told`` fixture is in ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from tests.helpers import RecordingLogger, make_collector


def window_total(logger: RecordingLogger, name: str) -> float:
    """Sum of a window metric over every logged window: the total when nothing was lost."""
    return sum(value for _, value in logger.series(name))


# -- one seeded collection loop: collect, write, sample --------------------------------------------

FRAMES_PER_BATCH = 16
TOTAL_FRAMES = 96
BATCHES = TOTAL_FRAMES // FRAMES_PER_BATCH


def make_buffer() -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=8)
    rb.set_rng(torch.Generator().manual_seed(1))
    return rb


def run_loop(attach: Callable[[Collector, TensorDictReplayBuffer], Any] | None = None):
    """Collects, writes every batch and samples after each write; returns the data seen.

    ``attach(collector, rb)`` attaches observers before the loop. Returns the
    batches, the samples, the storage contents and the global RNG state.
    """
    torch.manual_seed(0)
    collector = make_collector(frames_per_batch=FRAMES_PER_BATCH, total_frames=TOTAL_FRAMES)
    rb = make_buffer()
    if attach is not None:
        attach(collector, rb)
    batches, samples = [], []
    try:
        for batch in collector:
            batches.append(batch.clone())
            rb.extend(batch)
            samples.append(rb.sample().clone())
    finally:
        collector.shutdown()
    return batches, samples, rb[:].clone(), torch.random.get_rng_state()


def assert_same_data(reference, observed) -> None:
    """The collected batches, samples, storage and RNG are identical."""
    assert len(reference[0]) == len(observed[0]) == BATCHES
    for a, b in zip(reference[0] + reference[1], observed[0] + observed[1]):
        assert (a == b).all()
    assert (reference[2] == observed[2]).all()
    assert torch.equal(reference[3], observed[3])


@pytest.fixture(scope="module")
def reference():
    """The loop's data without any observer."""
    return run_loop()
