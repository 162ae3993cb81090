"""SampleMetrics' stored priorities, on every prioritized sampler torchrl ships, against the data.

Each buffer gets priorities set by the test; the truth of every logged row is
computed here from them, as torchrl's sampler stores them:
``torch.pow(p + eps, alpha)`` in the tree's dtype, read at the sampled index.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    PrioritizedSliceSampler,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import Every, LoggerObserver, Mean, MetricsChannel, SampleMetrics
from rl_observers.metrics import stored_priorities
from tests.helpers import scalars

ALPHA, BETA, EPS = 0.6, 0.4, 1e-8
N, SAMPLES, EVERY = 64, 12, 4


def priorities() -> torch.Tensor:
    return torch.linspace(0.1, 5.0, N)


def prioritized() -> tuple[object, callable]:
    rb = PrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, eps=EPS, storage=LazyTensorStorage(N))
    rb.extend(torch.arange(N))
    rb.update_priority(torch.arange(N), priorities())
    return rb, lambda: rb.sample(8, return_info=True)[1]["index"]


def tensordict_prioritized() -> tuple[object, callable]:
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=ALPHA, beta=BETA, eps=EPS, priority_key="td_error", storage=LazyTensorStorage(N), batch_size=8
    )
    rb.extend(TensorDict(obs=torch.arange(N), td_error=priorities(), batch_size=[N]))  # set at extend
    return rb, lambda: rb.sample()["index"]


def prioritized_slices() -> tuple[object, callable]:
    sampler = PrioritizedSliceSampler(max_capacity=N, alpha=ALPHA, beta=BETA, eps=EPS, num_slices=2, traj_key="episode")
    rb = TensorDictReplayBuffer(sampler=sampler, storage=LazyTensorStorage(N), batch_size=8)
    rb.extend(TensorDict(obs=torch.arange(N), episode=torch.arange(N) // 8, batch_size=[N]))
    rb.update_priority(torch.arange(N), priorities())
    return rb, lambda: rb.sample(return_info=True)[1]["index"][0]  # a tuple: one tensor per dim


@pytest.mark.parametrize("make", [prioritized, tensordict_prioritized, prioritized_slices])
def test_stored_priorities_of_each_window_are_exact(tmp_path, make):
    rb, sample = make()
    logger = CSVLogger(exp_name="priorities", log_dir=str(tmp_path))
    rb.add_observer(
        LoggerObserver(
            logger,
            schedule=Every.counter("sample_calls", EVERY),
            metrics=[
                SampleMetrics(quantiles=(0.5,)),
                # a one-liner reads the sampler through the buffer it is given, last
                Mean("priority_oneliner", lambda batch, info, buffer: stored_priorities(buffer, info), on="post_sample"),
            ],
        )
    )
    stored = torch.pow(priorities() + EPS, ALPHA)  # what the tree holds (float32, as torchrl computes it)
    windows = []
    for i in range(SAMPLES):
        if i % EVERY == 0:
            windows.append([])
        windows[-1].extend(stored[sample()].tolist())
    assert MetricsChannel.for_logger(logger).close(timeout=30)
    steps = [EVERY * (i + 1) for i in range(len(windows))]
    means = scalars(logger, "replay_buffer/stored_priority_mean")
    assert [s for s, _ in means] == steps
    for (_, mean), (_, low), (_, high), (_, median), (_, oneliner), values in zip(
        means,
        scalars(logger, "replay_buffer/stored_priority_min"),
        scalars(logger, "replay_buffer/stored_priority_max"),
        scalars(logger, "replay_buffer/stored_priority_p50"),
        scalars(logger, "replay_buffer/priority_oneliner"),
        windows,
    ):
        assert math.isclose(mean, math.fsum(values) / len(values), rel_tol=1e-9)
        assert math.isclose(oneliner, mean, rel_tol=1e-9)
        assert (low, high) == (min(values), max(values))  # exact: the tree's values
        lower_median = sorted(values)[math.ceil(0.5 * len(values)) - 1]
        assert math.isclose(median, lower_median, rel_tol=0.011)
    # the priority as set is recovered from the stored value
    recovered = stored.double().pow(1 / ALPHA) - EPS
    assert torch.allclose(recovered, priorities().double(), rtol=1e-5)


def test_no_stored_priorities_without_a_prioritized_sampler(tmp_path):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(N), batch_size=8)
    logger = CSVLogger(exp_name="plain", log_dir=str(tmp_path))
    rb.add_observer(LoggerObserver(logger, schedule=Every.counter("sample_calls", 2), metrics=[SampleMetrics()]))
    rb.extend(TensorDict(obs=torch.arange(N), batch_size=[N]))
    for _ in range(4):
        rb.sample()
    assert MetricsChannel.for_logger(logger).close(timeout=30)
    assert scalars(logger, "replay_buffer/sample_calls") == [(2, 2.0), (4, 4.0)]
    assert not [name for name in logger.experiment.scalars if "priority" in name]
    assert stored_priorities(rb, {"index": torch.arange(3)}) is None
