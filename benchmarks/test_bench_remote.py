"""Budget: a Ray replay buffer with an actor-side observer makes zero extra RPCs per write or sample.

The observer runs inside the buffer's actor, so the driver's calls are the
same with and without it: one ``extend`` per write, one ``sample`` per
sample. The test counts the calls the driver makes to the actor handle over
1000 writes (and 100 samples), bare and observed, in the same run.
``make bench`` also reports the seconds per write; ``--benchmark-disable``
runs the same assertions once.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import rl_observers  # noqa: F401
from tests.helpers import counting_rpcs

WRITES = 1000
SAMPLES = 100


class CountWrites:
    """An actor-side observer of writes and samples, contributing to ``stats()``."""

    def __init__(self) -> None:
        self.items = 0
        self.samples = 0

    def on_post_extend(self, source, data, index):
        self.items += len(index)

    def on_post_sample(self, source, batch, info):
        self.samples += 1

    def stats(self) -> dict[str, int]:
        return {"bench/items": self.items, "bench/samples": self.samples}


@pytest.fixture(scope="module")
def ray_buffer() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from torchrl.data import RayReplayBuffer

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rb = RayReplayBuffer(
        storage=partial(LazyTensorStorage, 100_000),
        batch_size=64,
        replay_buffer_cls=TensorDictReplayBuffer,
        remote_config={"num_cpus": 0},
    )
    try:
        yield rb
    finally:
        rb.close()
        if started:
            ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_replay_buffer_rpcs_per_1000_writes(benchmark, ray_buffer):
    rb = ray_buffer
    data = TensorDict({"obs": torch.arange(16)}, [16])

    def workload() -> float:
        start = time.perf_counter()
        for _ in range(WRITES):
            rb.extend(data)
        for _ in range(SAMPLES):
            rb.sample()
        return (time.perf_counter() - start) / (WRITES + SAMPLES)

    rb.extend(data)  # warm up: storage initialisation, first round trips
    rb.sample()
    with counting_rpcs(rb) as bare:
        bare_seconds = workload()
    observer = CountWrites()
    with rb.add_observer(observer):
        with counting_rpcs(rb) as observed:
            observed_seconds = benchmark.pedantic(workload, rounds=1, iterations=1)
            stats = rb.stats()
    extra = sum(observed.values()) - sum(bare.values()) - 1  # the one stats() call
    benchmark.extra_info.update(
        rpcs_per_1000_writes_bare=bare["extend"] * 1000 / WRITES,
        rpcs_per_1000_writes_observed=observed["extend"] * 1000 / WRITES,
        extra_rpcs=extra,
        us_per_call_bare=bare_seconds * 1e6,
        us_per_call_observed=observed_seconds * 1e6,
    )
    print(
        f"\nRay replay buffer, {WRITES} writes + {SAMPLES} samples: calls bare {dict(bare)}, "
        f"observed {dict(observed)}; {bare_seconds * 1e6:.0f} us vs {observed_seconds * 1e6:.0f} us per call"
    )
    assert bare == Counter(extend=WRITES, sample=SAMPLES)
    assert observed == Counter(extend=WRITES, sample=SAMPLES, __ray_call__=1)  # __ray_call__: stats()
    assert extra == 0
    assert stats["bench/items"] == WRITES * 16 and stats["bench/samples"] == SAMPLES
