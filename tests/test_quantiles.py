"""Quantile sketches: accuracy against ground truth, exact merges, bounded memory, real collectors."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import StepCounter, TransformedEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv

from rl_observers import Every, LoggerObserver, MetricsChannel, Quantiles
from rl_observers.stats import QuantileReducer, QuantileSketch
from rl_observers.stats.partials import sketch_resolution

from .helpers import RecordingLogger, start_method

QS = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def _within(sketch, values, accuracy, quantiles=QS):
    """Every quantile of ``sketch`` within ``accuracy`` of numpy's lower quantile of ``values``."""
    finite = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    for q in quantiles:
        truth = float(np.quantile(finite, q, method="lower"))
        reported = sketch.quantile(q)
        assert abs(reported - truth) <= accuracy * abs(truth), (q, truth, reported)


magnitudes = st.floats(min_value=1e-12, max_value=1e12, allow_nan=False)
values_strategy = st.lists(
    st.one_of(
        magnitudes,
        magnitudes.map(lambda v: -v),
        st.just(0.0),
        st.sampled_from([math.nan, math.inf, -math.inf]),
    ),
    min_size=1,
    max_size=300,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=values_strategy,
    accuracy=st.sampled_from([0.005, 0.01, 0.02, 0.05, 0.2]),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_any_split_and_merge_order_is_the_sketch_of_all_and_within_accuracy(values, accuracy, cuts, seed):
    whole = QuantileSketch.from_values("x", values, quantiles=QS, accuracy=accuracy)
    bounds = sorted({min(c, len(values)) for c in cuts} | {0, len(values)})
    parts = [
        QuantileSketch.from_values("x", values[a:b], quantiles=QS, accuracy=accuracy)
        for a, b in zip(bounds, bounds[1:])
    ]
    rng = random.Random(seed)
    while len(parts) > 1:  # merge random pairs, in random order: any tree of merges
        i, j = rng.sample(range(len(parts)), 2)
        merged = parts[i].merge(parts[j])
        parts = [p for k, p in enumerate(parts) if k not in (i, j)] + [merged]
    merged = parts[0]
    assert (merged.positive, merged.negative, merged.zero, merged.nonfinite) == (
        whole.positive,
        whole.negative,
        whole.zero,
        whole.nonfinite,
    )
    assert merged.finalize() == whole.finalize()
    assert merged.nonfinite == sum(1 for v in values if not math.isfinite(v))
    if any(math.isfinite(v) for v in values):
        _within(merged, values, accuracy)
    else:
        assert not any(k.endswith(("_p1", "_p50")) for k in merged.finalize())


@settings(max_examples=40, deadline=None)
@given(values=values_strategy, split=st.integers(0, 300))
def test_the_device_fold_gives_the_host_sketch(values, split):
    reducer = QuantileReducer("x", quantiles=QS)
    tensor = torch.tensor(values, dtype=torch.float64)
    reducer.fold(tensor[:split])
    reducer.fold(tensor[split:].float())
    folded = reducer.pull()
    host = QuantileSketch.from_values("x", values, quantiles=QS)
    assert (folded.positive, folded.negative, folded.zero, folded.nonfinite) == (
        host.positive,
        host.negative,
        host.zero,
        host.nonfinite,
    )
    assert reducer.pull().count == 0  # the window was reset


def test_masks_and_finer_resolutions_fold_on_the_computed_path():
    values = torch.randn(5000, dtype=torch.float64) * 1e3
    mask = torch.rand(5000) < 0.3
    for accuracy in (0.01, 0.0002):  # a lookup table, then the computed mapping
        reducer = QuantileReducer("x", quantiles=QS, accuracy=accuracy)
        reducer.fold(values, mask=mask)
        sketch = reducer.pull()
        assert sketch.count == mask.sum().item()
        _within(sketch, values[mask].tolist(), accuracy)


def test_invalid_quantiles_and_accuracies_are_refused_with_the_valid_range():
    for q in (0.0, 1.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"each quantile must be a number in \(0, 1\), got"):
            Quantiles("a", lambda b: b, q=(0.5, q))
    for accuracy in (0.0, 0.5, -0.01, 1.0):
        with pytest.raises(ValueError, match=r"accuracy must be a number in \(0, 0.5\), got"):
            Quantiles("a", lambda b: b, accuracy=accuracy)
    with pytest.raises(ValueError, match="cannot merge"):
        QuantileSketch("a", accuracy=0.01).merge(QuantileSketch("a", accuracy=0.02))
    assert sketch_resolution(0.01) == 6  # 64 buckets per power of two
    assert QuantileSketch("a", quantiles=(q for q in (0.5, 0.9))).quantiles == (0.5, 0.9)


def test_collapsing_keeps_the_highest_buckets_and_stays_exact_to_merge():
    values = np.geomspace(1e-10, 1e10, 20_000)
    small = QuantileSketch.from_values("x", values, quantiles=(0.01, 0.5, 0.99), max_buckets=256)
    assert len(small.positive) == 256
    assert small.count == len(values)
    # the high quantiles keep their accuracy; the collapsed low ones read as the lowest bucket kept
    assert abs(small.quantile(0.99) - np.quantile(values, 0.99, method="lower")) <= 0.01 * small.quantile(0.99)
    assert small.quantile(0.01) == small.quantile(0.5 - 0.3)  # both among the collapsed
    halves = [
        QuantileSketch.from_values("x", part, quantiles=(0.01, 0.5, 0.99), max_buckets=256)
        for part in (values[1::2], values[::2])
    ]
    assert halves[0].merge(halves[1]).positive == small.positive


def test_memory_is_flat_over_a_million_values():
    reducer = QuantileReducer("x")
    sketch = reducer.empty()
    sizes = []
    generator = torch.Generator().manual_seed(0)
    for window in range(100):
        for _ in range(10):  # 10 folds of 1,000 values a window: 10**6 values in all
            reducer.fold(torch.randn(1000, generator=generator).mul_(10.0**(window % 12)).exp_())
        sketch = sketch.merge(reducer.pull())
        sizes.append(len(pickle.dumps(sketch)))
    assert sketch.count + sketch.nonfinite == 10**6
    assert len(sketch.positive) <= 2048 and len(sketch.negative) == 0
    assert max(sizes) < 2048 * 40  # bounded whatever the spread of the values
    assert sizes[-1] <= 1.05 * sizes[len(sizes) // 2]  # flat: no growth once the range is seen


def test_one_liner_numbers_and_tensors_and_nonfinite_counts():
    metric = Quantiles("v", lambda b: b, q=(0.5,))
    metric.on_post_collect(None, torch.tensor([1.0, 2.0, math.nan, math.inf]))
    metric.on_post_collect(None, 3.0)
    metric.on_post_collect(None, np.float32(-math.inf))
    out = metric.pull()["v"].finalize()
    assert out["v_nonfinite"] == 3.0
    assert abs(out["v_p50"] - 2.0) <= 0.02
    assert metric.pull()["v"].finalize() == {}
    assert set(metric.metric_names()) == {"v", "v_p50", "v_nonfinite"}
    with pytest.raises(TypeError, match="complex"):
        metric.on_post_collect(None, torch.tensor([1j]))


def _make_env(max_steps):
    return TransformedEnv(CountingEnv(max_steps=100), StepCounter(max_steps=max_steps))


def _values(batch):
    # spread over magnitudes and signs, a function of the batch the driver receives
    obs = batch["observation"].double()
    return torch.exp(obs * 0.4) - 3.0


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_four_workers_aggregate_and_per_worker_quantiles_are_within_accuracy():
    factories = [lambda s=s: _make_env(s) for s in (3, 5, 8, 13)]
    with start_method("fork"):
        collector = MultiSyncCollector(
            factories,
            RandomPolicy(_make_env(3).action_spec),
            frames_per_batch=80,
            total_frames=1600,
            cat_results="stack",
        )
    logger = RecordingLogger()
    channel = MetricsChannel(logger)
    handle = collector.add_observer(
        LoggerObserver(
            channel,
            name="m",
            scope="both",
            schedule=Every.counter("frames", 10**9),
            metrics=[Quantiles("v", _values, q=QS)],
        )
    )
    try:
        batches = [b.clone() for b in collector]
    finally:
        collector.shutdown()
        handle.remove()
    assert channel.flush(timeout=30)
    channel.close()
    last = {}
    for metrics, _ in logger.calls:
        last.update(metrics)
    union = torch.cat([_values(b).reshape(-1) for b in batches]).tolist()
    per_worker = [torch.cat([_values(b[i]).reshape(-1) for b in batches]).tolist() for i in range(4)]
    assert len({tuple(v) for v in per_worker}) == 4  # the workers' data differ
    for ns, data in [("m", union)] + [(f"m/worker_{i}", per_worker[i]) for i in range(4)]:
        finite = np.asarray(data)
        for q in QS:
            truth = float(np.quantile(finite, q, method="lower"))
            logged = last[f"{ns}/v_p{q * 100:g}"]
            assert abs(logged - truth) <= 0.01 * abs(truth), (ns, q, truth, logged)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_folds_do_not_sync():
    values = [torch.randn(1000, device="cuda") * 10 for _ in range(8)]
    fine = QuantileReducer("fine", quantiles=QS, accuracy=0.0002)  # the computed mapping
    metric = Quantiles("v", lambda v: v, q=QS)
    masked = QuantileReducer("masked", quantiles=QS)
    for v in values[:1]:  # the first fold allocates the buffers and tables
        metric.on_post_collect(None, v)
        fine.fold(v)
        masked.fold(v, mask=v > 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for v in values[1:]:
            metric.on_post_collect(None, v)
            fine.fold(v)
            masked.fold(v, mask=v > 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    data = torch.cat(values).double().cpu()
    _within(metric.pull()["v"], data.tolist(), 0.01)
    _within(fine.pull(), data.tolist(), 0.0002)
    _within(masked.pull(), data[data > 0].tolist(), 0.01)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_episode_quantiles_fold_without_sync():
    from rl_observers import CollectorBatchMetrics

    from .test_collector_metrics import Truth, collect, make_env

    batches = collect(make_env(batch_size=(3,)), 15, 900)
    metrics = CollectorBatchMetrics(quantiles=QS)
    cuda_batches = [b.to("cuda") for b in batches]
    metrics.on_post_collect(None, cuda_batches[0])  # the first fold allocates the buffers and tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in cuda_batches[1:]:
            metrics.on_post_collect(None, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _check_episode_quantiles(metrics.pull(), [e for b in Truth(batches).episodes for e in b], QS)


def test_staged_folds_survive_pickling_and_size_changes():
    reducer = QuantileReducer("x", quantiles=QS)
    chunks = [torch.randn(n) * 50 for n in (10, 10, 10, 7, 3000, 7)]
    for chunk in chunks[:3]:
        reducer.fold(chunk)  # staged, not counted yet
    reducer = pickle.loads(pickle.dumps(reducer))
    for chunk in chunks[3:]:
        reducer.fold(chunk)
    data = torch.cat(chunks).tolist()
    folded = reducer.pull()
    assert folded.positive == QuantileSketch.from_values("x", data, quantiles=QS).positive
    _within(folded, data, 0.01)


def _check_episode_quantiles(payload, episodes, quantiles, accuracy=0.01):
    returns = [r for r, _ in episodes]
    lengths = [float(n) for _, n in episodes]
    assert payload["episode_return_quantiles"].count == len(episodes)
    for name, values in (("episode_return", returns), ("episode_length", lengths)):
        sketch = payload[f"{name}_quantiles"]
        finalized = sketch.finalize()
        for q in quantiles:
            truth = float(np.quantile(np.asarray(values), q, method="lower"))
            got = finalized[f"{name}_p{q * 100:g}"]
            # float32 rewards summed in float64 vs python floats: a hair more than the accuracy
            assert abs(got - truth) <= accuracy * abs(truth) + 1e-5, (name, q, truth, got)


@pytest.mark.parametrize(
    "reward_sum, kwargs",
    [(False, {}), (True, {}), (True, {"episode_reward_key": None, "step_count_key": None})],
    ids=["running_sums", "rewardsum_keys", "ring_with_keys_ignored"],
)
def test_collector_batch_metrics_episode_quantiles_match_the_episodes(reward_sum, kwargs):
    from rl_observers import CollectorBatchMetrics

    from .test_collector_metrics import Truth, collect, make_env

    batches = collect(make_env(batch_size=(3,), reward_sum=reward_sum), 15, 1500)
    truth = Truth(batches)
    metrics = CollectorBatchMetrics(quantiles=QS, episode_window=25, **kwargs)
    plain = CollectorBatchMetrics(**kwargs)
    for batch in batches[:40]:
        metrics.on_post_collect(None, batch)
        plain.on_post_collect(None, batch)
    first = metrics.pull()
    _check_episode_quantiles(first, [e for b in truth.episodes[:40] for e in b], QS)
    for batch in batches[40:]:
        metrics.on_post_collect(None, batch)
    second = metrics.pull()
    episodes = [e for b in truth.episodes[40:] for e in b]
    _check_episode_quantiles(second, episodes, QS)
    # merged windows are the sketch of all the episodes
    _check_episode_quantiles(
        {k: first[k].merge(second[k]) for k in ("episode_return_quantiles", "episode_length_quantiles")},
        [e for b in truth.episodes for e in b],
        QS,
    )
    # the rolling window reports the same quantiles of its last 25 episodes, exactly
    last = [r for b in truth.episodes for r, _ in b][-25:]
    rolling = second["episode_window"].finalize()
    assert rolling["episode_return_p50_last_25"] == pytest.approx(float(np.quantile(last, 0.5)), rel=1e-5)
    assert "episode_length_p95_last_25" in rolling
    # the other metrics are those of the set without quantiles
    plain_payload = plain.pull()
    assert first["episode_return"].finalize() == plain_payload["episode_return"].finalize()
    names = metrics.metric_names()
    assert "episode_return_p5" in names and "episode_length_p95" in names
    with pytest.raises(ValueError, match=r"quantile must be a number in \(0, 1\)"):
        CollectorBatchMetrics(quantiles=(0.5, 1.0))


def test_interleaved_batches_episode_quantiles():
    import functools

    from rl_observers import CollectorBatchMetrics

    from .test_collector_metrics import Truth, _async_batched, _interleaving_env

    makers = [functools.partial(_interleaving_env, s, False) for s in (1, 2, 3)]
    collector = _async_batched(makers, 30, 900)
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    truth = Truth(batches, by_env=True)
    metrics = CollectorBatchMetrics(quantiles=QS)
    for batch in batches:
        metrics.on_post_collect(None, batch)
    _check_episode_quantiles(metrics.pull(), [e for b in truth.episodes for e in b], QS)


def test_sample_metrics_age_and_weight_quantiles_match_every_sample():
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

    from rl_observers import SampleMetrics

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(500), batch_size=64)
    logger = RecordingLogger()
    channel = MetricsChannel(logger)
    rb.add_observer(
        LoggerObserver(
            channel,
            name="rb",
            schedule=Every.counter("sample_calls", 40),
            metrics=[SampleMetrics(quantiles=QS)],
        )
    )
    written = 0
    ages, weights = [], []
    generator = torch.Generator().manual_seed(0)
    for step in range(80):
        n = 37
        index = rb.extend(TensorDict({"x": torch.arange(written, written + n)}, [n]))
        rb.update_priority(index, torch.rand(n, generator=generator) + 0.01)
        written += n
        for _ in range(1 if step < 40 else 0):
            batch = rb.sample()
            ages.extend((written - 1 - batch["x"]).tolist())
            weights.extend(batch["priority_weight"].tolist())
    for _ in range(40):  # no writes in between: one cursor for the whole second window
        batch = rb.sample()
        ages.extend((written - 1 - batch["x"]).tolist())
        weights.extend(batch["priority_weight"].tolist())
    assert channel.flush(timeout=20)
    channel.close()
    rows = [m for m, _ in logger.calls if "rb/sample_age_p50" in m]
    assert len(rows) == 2
    half = len(ages) // 2
    for row, window in zip(rows, (slice(0, half), slice(half, None))):
        for name, values in (("sample_age", ages[window]), ("priority_weight", weights[window])):
            for q in QS:
                truth = float(np.quantile(np.asarray(values), q, method="lower"))
                got = row[f"rb/{name}_p{q * 100:g}"]
                assert abs(got - truth) <= 0.01 * abs(truth) + 1e-7, (name, q, truth, got)


def _sampled_x(batch):
    return batch["x"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_replay_buffer_actor_quantiles_of_ages_and_sampled_values():
    import sys
    from functools import partial

    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, RayReplayBuffer, TensorDictReplayBuffer

    from rl_observers import SampleMetrics

    from .helpers import local_ray

    with local_ray(sys.modules[__name__]):
        rb = RayReplayBuffer(
            storage=partial(LazyTensorStorage, 300),
            batch_size=50,
            replay_buffer_cls=TensorDictReplayBuffer,
            remote_config={"num_cpus": 0},
        )
        logger = RecordingLogger()
        channel = MetricsChannel(logger)
        try:
            handle = rb.add_observer(
                LoggerObserver(
                    channel,
                    name="rrb",
                    schedule=Every.counter("sample_calls", 10**9),
                    metrics=[
                        SampleMetrics(quantiles=QS),
                        Quantiles("x", _sampled_x, q=QS, on="post_sample"),
                    ],
                )
            )
            written, ages, xs = 0, [], []
            for _ in range(8):  # the storage wraps around: ages and values part ways
                rb.extend(TensorDict({"x": torch.arange(written, written + 100.0)}, [100]))
                written += 100
                for _ in range(3):
                    x = rb.sample()["x"]
                    xs.extend(x.tolist())
                    ages.extend((written - 1 - x).tolist())
            handle.remove()
            assert channel.flush(timeout=30)
        finally:
            channel.close()
            rb.close() if hasattr(rb, "close") else None
    last = {}
    for metrics, _ in logger.calls:
        last.update(metrics)
    for name, values in (("sample_age", ages), ("x", xs)):
        for q in QS:
            truth = float(np.quantile(np.asarray(values), q, method="lower"))
            got = last[f"rrb/{name}_p{q * 100:g}"]
            assert abs(got - truth) <= 0.01 * abs(truth), (name, q, truth, got)
