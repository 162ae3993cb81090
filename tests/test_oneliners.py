"""Metric one-liners, source counters, stats providers and policy lag, on real collectors and buffers."""

from __future__ import annotations

import math
import random
import sys
from functools import partial

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.envs import StepCounter, TransformedEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers
from rl_observers import (
    CollectorBatchMetrics,
    CountTrue,
    Every,
    Gauge,
    Histogram,
    LoggerObserver,
    Max,
    Mean,
    MetricsChannel,
    Min,
    PolicyLag,
    Rate,
    Ratio,
    StatsProvider,
    Sum,
    Summary,
)
from rl_observers.metrics.keys import MissingKeyError
from rl_observers.stats import BinCounts, Moments

from .helpers import RecordingLogger, local_ray, start_method


def _env(max_steps=4):
    return TransformedEnv(CountingEnv(max_steps=50), StepCounter(max_steps=max_steps))


def _last(logger, name):
    rows = [(step, m[name]) for m, step in logger.calls if name in m]
    return rows[-1] if rows else None


def _obs(batch):
    return batch["observation"].float()


def _done(batch):
    return batch["next", "done"]


ONE_LINERS = lambda: [  # noqa: E731
    Mean("obs", _obs),
    Sum("obs_sum", _obs),
    Min("obs_min", _obs),
    Max("obs_max", _obs),
    Summary("obs_dist", _obs),
    CountTrue("dones", _done),
    Ratio("done_fraction", _done),
    Histogram("obs_hist", _obs, edges=range(0, 60), quantiles=(0.5,)),
    Gauge("frames_seen", lambda b: b.numel(), merge="sum"),
    Gauge("batch_obs_max", lambda b: b["observation"].max(), merge="max"),
    Gauge("constant", lambda b: 7.0, merge="latest"),
    Rate("fps", lambda b: b.numel()),
]


def _truth(batches):
    obs = torch.cat([b["observation"].float().reshape(-1) for b in batches])
    dones = torch.cat([b["next", "done"].reshape(-1) for b in batches])
    return obs, dones


def _check_against(logger, ns, batches):
    obs, dones = _truth(batches)
    frames = sum(b.numel() for b in batches)
    assert _last(logger, f"{ns}/obs") == (frames, pytest.approx(obs.mean().item()))
    assert _last(logger, f"{ns}/obs_sum")[1] == pytest.approx(obs.sum().item())
    assert _last(logger, f"{ns}/obs_min")[1] == obs.min().item()
    assert _last(logger, f"{ns}/obs_max")[1] == obs.max().item()
    assert _last(logger, f"{ns}/obs_dist_std")[1] == pytest.approx(obs.std(correction=0).item())
    assert _last(logger, f"{ns}/dones")[1] == dones.sum().item()
    assert _last(logger, f"{ns}/done_fraction")[1] == pytest.approx(dones.float().mean().item())
    expected = BinCounts.from_values("h", obs.tolist(), edges=range(0, 60), quantiles=(0.5,))
    assert _last(logger, f"{ns}/obs_hist_p50")[1] == pytest.approx(expected.quantile(0.5))
    assert _last(logger, f"{ns}/frames_seen")[1] == frames
    assert _last(logger, f"{ns}/batch_obs_max")[1] == obs.max().item()
    assert _last(logger, f"{ns}/constant")[1] == 7.0  # latest: not summed over workers
    assert _last(logger, f"{ns}/fps")[1] > 0


def test_one_liners_alone_on_a_local_collector_match_the_data():
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=60)
    logger = RecordingLogger()
    channel = MetricsChannel(logger)
    # no built-in set: the observer counts frames itself for the schedule and the step
    handle = collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 1000), metrics=ONE_LINERS(), name="c")
    )
    batches = [b.clone() for b in collector]
    handle.remove()  # log_on_close: one window over everything
    collector.shutdown()
    assert channel.flush(timeout=10)
    _check_against(logger, "c", batches)
    assert not any("frames" == k.split("/")[-1] for m, _ in logger.calls for k in m)  # counters are not logged
    channel.close()


def test_every_counter_works_with_one_liners_alone():
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=60)
    logger = RecordingLogger()
    collector.attach_logger(logger, schedule=Every.counter("frames", 20), metrics=[Mean("obs", _obs)])
    for _ in collector:
        pass
    collector.shutdown()
    assert MetricsChannel.for_logger(logger).flush(timeout=10)
    assert [s for m, s in logger.calls if "collector/obs" in m] == [20, 40, 60]


@pytest.mark.real_collector
@pytest.mark.timeout(120)
def test_merge_rules_across_two_forked_workers():
    with start_method("fork"):
        collector = MultiSyncCollector(
            [_env] * 2,
            RandomPolicy(_env().action_spec),
            frames_per_batch=40,
            total_frames=400,
            cat_results="stack",
        )
    logger = RecordingLogger()
    channel = MetricsChannel(logger)
    handle = collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 10**9), metrics=ONE_LINERS(), name="m")
    )
    try:
        batches = [b.clone() for b in collector]
    finally:
        collector.shutdown()
        handle.remove()
    assert channel.flush(timeout=20)
    # the aggregate merges all workers' partials: the mean of all frames, not a mean of means
    _check_against(logger, "m", batches)
    channel.close()


def test_name_clashes_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"CollectorBatchMetrics \(#1\) and Mean\('reward'.*\(#2\) both log .*'reward'"):
        LoggerObserver(RecordingLogger(), metrics=[CollectorBatchMetrics(), Mean("reward", _obs)])
    with pytest.raises(ValueError, match=r"Mean\('x'.*\(#1\) and Max\('x'.*\(#2\) both log 'x'"):
        LoggerObserver(RecordingLogger(), metrics=[Mean("x", _obs), Max("x", _obs)])
    with pytest.raises(ValueError, match="episode_return_mean"):
        LoggerObserver(RecordingLogger(), metrics=[CollectorBatchMetrics(), Mean("episode_return_mean", _obs)])


def test_an_event_the_target_does_not_emit_is_refused_at_attach():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(ValueError, match=r"folds 'post_collect', which a ReplayBuffer does not emit.*post_sample"):
        rb.attach_logger(RecordingLogger(), metrics=[Mean("x", lambda b: b)])
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=10)
    with pytest.raises(ValueError, match="does not emit"):
        collector.attach_logger(RecordingLogger(), metrics=[Mean("x", lambda b: b, on="post_sample")])
    collector.shutdown()
    with pytest.raises(TypeError, match="must accept"):
        Mean("x", lambda: 1.0)


def test_plain_callable_on_a_buffer_names_the_one_liner():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(TypeError, match=r"Mean\('name', fn, on='post_sample'\)"):
        rb.add_observer(lambda batch: None)


def test_replay_buffer_one_liners_with_info_and_source_counters():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=8)
    logger = RecordingLogger()
    seen = []
    rb.attach_logger(
        logger,
        name="rb",
        schedule=Every.counter("sample_calls", 5),
        metrics=[
            Mean("sampled", lambda batch, info: (seen.append(batch["x"].clone()), batch["x"])[1], on="post_sample"),
            Sum("written", lambda data: data["x"], on="post_extend"),
        ],
    )
    rb.extend(TensorDict({"x": torch.arange(50.0)}, [50]))
    for _ in range(10):
        rb.sample()
    assert MetricsChannel.for_logger(logger).flush(timeout=10)
    steps = [s for m, s in logger.calls if "rb/sampled" in m]
    assert steps == [5, 10]  # sample_calls counted without SampleMetrics
    assert _last(logger, "rb/sampled")[1] == pytest.approx(torch.cat(seen[5:]).mean().item())
    assert [m["rb/written"] for m, _ in logger.calls] == [sum(range(50)), 0.0]


def test_a_raising_one_liner_obeys_on_error(caplog):
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=30)

    def broken(batch):
        raise RuntimeError("broken metric")

    logger = RecordingLogger()
    collector.attach_logger(logger, metrics=[Mean("bad", broken)], on_error="warn")
    assert len(list(collector)) == 3  # collection goes on
    collector.shutdown()
    assert "broken metric" in caplog.text
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=30)
    collector.attach_logger(RecordingLogger(), metrics=[Mean("bad", broken)], on_error="raise")
    with pytest.raises(RuntimeError, match="broken metric"):
        next(iter(collector))
    collector.shutdown()


def test_stats_provider_reaches_stats_and_a_gauge_logs_the_same_number():
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    rb.add_observer(StatsProvider(fill=lambda rb: len(rb) / 100, constant=lambda: 3))
    rb.extend(torch.arange(40))
    stats = rb.stats()
    assert stats["fill"] == 0.4 and stats["constant"] == 3
    rb2 = ReplayBuffer(storage=LazyTensorStorage(10))
    rb2.add_observer(StatsProvider(lambda: {"a": 1, "b": 2}))
    assert {"a": 1, "b": 2}.items() <= rb2.stats().items()


def _versioned_collector(total_frames=200):
    env = CountingEnv(max_steps=5)
    policy = TensorDictModule(
        lambda obs: torch.ones(*obs.shape[:-1], 1, dtype=torch.int32), in_keys=["observation"], out_keys=["action"]
    )
    return Collector(
        env, policy, frames_per_batch=10, total_frames=total_frames, track_policy_version=True
    )


def test_policy_lag_on_a_buffer_and_a_collector_against_the_stamps():
    collector = _versioned_collector()
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=16)
    learner = {"version": 0}
    sample_lag = PolicyLag(current_version=lambda: learner["version"], on="post_sample")
    newest_lag = PolicyLag(on="post_sample", name="lag_to_newest")
    never = {"log_on_close": False}  # the test reads the windows itself
    rb.attach_logger(
        RecordingLogger(), metrics=[sample_lag, newest_lag], name="rb",
        schedule=Every.counter("sample_calls", 10**9), **never,
    )
    collect_lag = PolicyLag(current_version=collector, stats=("mean", "max"))
    collector.attach_logger(
        RecordingLogger(), metrics=[collect_lag], name="col", schedule=Every.counter("frames", 10**9), **never
    )
    expected, expected_newest, expected_collect = [], [], []
    for batch in collector:
        expected_collect.append(collector.policy_version - batch["policy_version"])
        rb.extend(batch)
        sample = rb.sample()
        expected.append(learner["version"] - sample["policy_version"])
        expected_newest.append(int(rb[:]["policy_version"].max()) - sample["policy_version"])
        collector.increment_version()  # what update_policy_weights_ does
        learner["version"] += 1
    collector.shutdown()
    got = sample_lag.pull()["policy_lag"].finalize()
    truth = torch.cat([e.reshape(-1) for e in expected]).double()
    assert got["policy_lag_mean"] == pytest.approx(truth.mean().item())
    assert got["policy_lag_max"] == truth.max().item() > 0
    newest = newest_lag.pull()["lag_to_newest"].finalize()
    truth = torch.cat([e.reshape(-1) for e in expected_newest]).double()
    assert newest["lag_to_newest_mean"] == pytest.approx(truth.mean().item())
    truth = torch.cat([e.reshape(-1) for e in expected_collect]).double()
    assert collect_lag.pull()["policy_lag"].finalize()["policy_lag_mean"] == pytest.approx(truth.mean().item())


def test_policy_lag_without_the_stamp_raises_the_missing_key_error_on_every_path():
    # Without track_policy_version, batches carry no "policy_version": each path names the fix.
    env = CountingEnv(max_steps=5)
    for lag in (PolicyLag(), PolicyLag(current_version=lambda: 3)):
        collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=10)
        collector.attach_logger(RecordingLogger(), metrics=[lag], on_error="raise", log_on_close=False)
        with pytest.raises(MissingKeyError, match="track_policy_version=True") as info:
            next(iter(collector))
        collector.shutdown()
        assert "keys present" in str(info.value) and "'observation'" in str(info.value)
    unstamped = TensorDict({"observation": torch.zeros(4, 1)}, [4])
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)
    newest = PolicyLag(on="post_sample")  # reads the newest version from the writes
    rb.attach_logger(RecordingLogger(), metrics=[newest], on_error="raise", log_on_close=False)
    with pytest.raises(MissingKeyError, match="track_policy_version=True"):
        rb.extend(unstamped)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)
    current = PolicyLag(current_version=lambda: 3, on="post_sample")
    rb.attach_logger(RecordingLogger(), metrics=[current], on_error="raise", log_on_close=False)
    rb.extend(unstamped)
    with pytest.raises(MissingKeyError, match="track_policy_version=True"):
        rb.sample()
    # A collector writing into a replay buffer stamps ("next", "policy_version"): the error says so.
    stamped_next = TensorDict({("next", "policy_version"): torch.tensor([2, 3])}, [2])
    lag = PolicyLag(on="post_sample")
    with pytest.raises(MissingKeyError, match=r"PolicyLag\(key=\('next', 'policy_version'\)\)"):
        lag.on_post_extend(None, stamped_next, None)
    lag = PolicyLag(on="post_sample", key=("next", "policy_version"))
    lag.on_post_extend(None, stamped_next, None)
    lag.on_post_sample(None, stamped_next[:1], {})
    assert lag.pull()["policy_lag"].finalize() == {"policy_lag_mean": 1.0, "policy_lag_max": 1.0}
    with pytest.raises(TypeError, match="needs TensorDict data"):
        PolicyLag(current_version=lambda: 3).on_post_collect(None, torch.zeros(3))


def test_host_numbers_and_tensors_merge_in_one_window():
    metric = Mean("m", lambda b: b)
    metric.on_post_collect(None, torch.tensor([1.0, 2.0, 3.0]))
    metric.on_post_collect(None, 10.0)
    assert metric.pull()["m"].finalize() == {"m": 4.0}
    assert metric.pull()["m"].finalize() == {}  # the window was reset
    summary = Summary("s", lambda b: b)
    summary.on_post_collect(None, torch.tensor([1.0, 3.0]))
    summary.on_post_collect(None, 5.0)
    assert summary.pull()["s"] .finalize() == Moments.from_values("s", [1.0, 3.0, 5.0]).finalize()
    ratio = Ratio("r", lambda b: b)
    ratio.on_post_collect(None, (torch.tensor(1), 4))
    ratio.on_post_collect(None, (0, 1))
    assert ratio.pull()["r"].finalize() == {"r": 0.2}
    gauge = Gauge("g", lambda b: b, merge="latest")
    gauge.on_post_collect(None, torch.tensor([2.0]))
    gauge.on_post_collect(None, torch.tensor(5.0))
    assert gauge.pull()["g"].finalize() == {"g": 5.0}
    with pytest.raises(ValueError, match="merge must be"):
        Gauge("g", lambda b: b, merge="median")


def test_sums_and_means_of_integers_are_exact():
    # One integer per batch (a count of dones): a sum derived from the mean was off by
    # rounding (27.000000000000004); the folded sum itself is exact.
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.randint(0, 7) for _ in range(rng.randint(1, 60))]
        metrics = [Sum("s", _identity), Mean("m", _identity), Gauge("g", _identity, merge="sum")]
        for metric in metrics:
            for v in values:
                metric.on_post_collect(None, torch.tensor(v))
        assert metrics[0].pull()["s"].finalize() == {"s": sum(values)}
        assert metrics[1].pull()["m"].finalize() == {"m": sum(values) / len(values)}
        assert metrics[2].pull()["g"].finalize() == {"g": sum(values)}
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=7, total_frames=700)
    total = Sum("obs_total", lambda b: b["observation"].sum())
    collector.attach_logger(RecordingLogger(), metrics=[total], log_on_close=False)
    truth = sum(int(batch["observation"].sum()) for batch in collector)
    collector.shutdown()
    assert total.pull()["obs_total"].finalize() == {"obs_total": truth}


def _identity(batch):
    return batch


def test_nan_makes_min_and_max_nan_in_any_order():
    nan = float("nan")
    for cls in (Min, Max):
        for first, second in ((5.0, nan), (nan, 5.0), (torch.tensor([5.0]), torch.tensor([nan]))):
            metric = cls("v", _identity)
            metric.on_post_collect(None, first)
            metric.on_post_collect(None, second)
            assert math.isnan(metric.pull()["v"].finalize()["v"]), (cls, first, second)
    summary = Summary("s", _identity, stats=("min", "max"))
    for _ in range(20):  # past a stage of folds: the NaN lands in another row than the numbers
        summary.on_post_collect(None, torch.tensor([1.0, 2.0]))
    summary.on_post_collect(None, torch.tensor([nan, nan]))
    out = summary.pull()["s"].finalize()
    assert math.isnan(out["s_min"]) and math.isnan(out["s_max"])


def test_histogram_counts_nan_apart_from_tensors_and_numbers():
    metric = Histogram("h", _identity, edges=[0, 1, 2], quantiles=(0.5,))
    metric.on_post_collect(None, torch.tensor([float("nan"), 0.5, float("inf"), -float("inf")]))
    metric.on_post_collect(None, float("nan"))
    metric.on_post_collect(None, 1.5)
    pulled = metric.pull()["h"]
    assert pulled.counts == (1.0, 1.0, 1.0, 1.0) and pulled.nan == 2.0  # +-inf: the outer bins
    assert pulled.finalize() == {"h_count": 4.0, "h_p50": 1.0, "h_nan_count": 2.0}
    assert "h_nan_count" in metric.metric_names()
    metric.on_post_collect(None, 0.5)
    assert metric.pull()["h"].finalize() == {"h_count": 1.0, "h_p50": 0.5}


def test_numpy_scalars_fold_like_python_numbers():
    np = pytest.importorskip("numpy")
    for value in (np.float32(2.5), np.float64(2.5), np.int64(3), np.bool_(True)):
        want = float(value)
        for metric in (Mean("m", _identity), Sum("m", _identity), Max("m", _identity),
                       Gauge("m", _identity, merge="latest")):
            metric.on_post_collect(None, value)
            assert metric.pull()["m"].finalize() == {"m": want}, (metric, value)
        summary = Summary("m", _identity, stats=("mean",))
        summary.on_post_collect(None, value)
        assert summary.pull()["m"].finalize() == {"m_mean": want}
        histogram = Histogram("m", _identity, edges=[0, 5], quantiles=(0.5,))
        histogram.on_post_collect(None, value)
        assert histogram.pull()["m"].counts == (0.0, 1.0, 0.0)
        rate = Rate("m", _identity)
        rate.on_post_collect(None, value)
        assert rate.pull()["m"].amount == want
    ratio = Ratio("r", _identity)
    ratio.on_post_collect(None, (np.int64(1), np.float32(4.0)))
    assert ratio.pull()["r"].finalize() == {"r": 0.25}


def test_count_true_counts_numbers_and_refuses_other_values():
    np = pytest.importorskip("numpy")
    metric = CountTrue("c", _identity)
    for value in (True, False, 1, 0, 2.5, np.bool_(True), np.int64(0), None):
        metric.on_post_collect(None, value)
    assert metric.pull()["c"].finalize() == {"c": 4.0}
    for value in ("False", [False], 1 + 2j):
        with pytest.raises(TypeError, match=r"CountTrue\('c'"):
            metric.on_post_collect(None, value)
    assert metric.pull()["c"].finalize() == {"c": 0.0}


def test_complex_values_are_refused_naming_the_metric():
    np = pytest.importorskip("numpy")
    z = torch.tensor([1 + 2j, 3 - 1j])
    for metric in (Summary("s", _identity), Mean("s", _identity), Sum("s", _identity),
                   Gauge("s", _identity, merge="latest"), Histogram("s", _identity, edges=[0, 1]),
                   Rate("s", _identity)):
        for value in (z, z[:1].reshape(()), 1 + 2j, np.complex64(1 + 2j)):
            with pytest.raises(TypeError, match=r"\('s', .*complex") as info:
                metric.on_post_collect(None, value)
            assert "real" in str(info.value)
    with pytest.raises(TypeError, match="complex tensor"):
        Ratio("r", _identity).on_post_collect(None, (z, 2))
    env = _env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=10)
    summary = Summary("obs", lambda b: b["observation"].to(torch.complex64))
    collector.attach_logger(RecordingLogger(), metrics=[summary], on_error="raise", log_on_close=False)
    with pytest.raises(TypeError, match=r"Summary\('obs', on='post_collect'\): the function returned a complex tensor"):
        next(iter(collector))
    collector.shutdown()


def test_one_liners_pickle_with_their_window():
    import pickle

    for metric in ONE_LINERS():
        clone = pickle.loads(pickle.dumps(metric)) if "<lambda>" not in repr(metric.fn) else None
        if clone is not None:
            clone.on_post_collect(None, TensorDict({"observation": torch.ones(3, 1), ("next", "done"): torch.ones(3, 1, dtype=torch.bool)}, [3]))
            assert clone.pull()
    lag = pickle.loads(pickle.dumps(PolicyLag(on="post_sample")))
    lag.on_post_extend(None, TensorDict({"policy_version": torch.tensor([3, 4])}, [2]), None)
    lag.on_post_sample(None, TensorDict({"policy_version": torch.tensor([2])}, [1]), {})
    assert lag.pull()["policy_lag"].finalize() == {"policy_lag_mean": 2.0, "policy_lag_max": 2.0}


def _sampled_x(batch):
    return batch["x"]


def _fill(rb):
    return len(rb) / 1000


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_replay_buffer_runs_one_liners_and_providers_in_its_actor():
    from torchrl.data import RayReplayBuffer

    with local_ray(sys.modules[__name__]):
        rb = RayReplayBuffer(
            storage=partial(LazyTensorStorage, 1000),
            batch_size=8,
            replay_buffer_cls=TensorDictReplayBuffer,
            remote_config={"num_cpus": 0},
        )
        logger = RecordingLogger()
        channel = MetricsChannel(logger)
        try:
            rb.add_observer(StatsProvider(fill=_fill))
            handle = rb.add_observer(
                LoggerObserver(
                    channel,
                    name="rrb",
                    schedule=Every.counter("sample_calls", 10**9),
                    metrics=[Max("x_max", _sampled_x, on="post_sample"), Sum("x_written", _sampled_x, on="post_extend")],
                )
            )
            rb.extend(TensorDict({"x": torch.arange(100.0)}, [100]))
            sampled = [rb.sample()["x"] for _ in range(5)]
            assert rb.stats()["fill"] == 0.1
            handle.remove()
            assert channel.flush(timeout=30)
            assert _last(logger, "rrb/x_max")[1] == torch.cat(sampled).max().item()
            assert _last(logger, "rrb/x_written")[1] == sum(range(100))
        finally:
            channel.close()
            rb.close() if hasattr(rb, "close") else None


def test_a_syncing_function_is_documented_not_refused():
    # .item() syncs the device at every event (documented); the one-liner still folds the number
    metric = Mean("m", lambda b: b.sum().item())
    metric.on_post_collect(None, torch.tensor([1.0, 2.0]))
    assert metric.pull()["m"].finalize() == {"m": 3.0}
    assert "synchronises the device" in rl_observers.metrics.oneliners.__doc__
    assert math.isfinite(3.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_values_fold_without_sync():
    values = [torch.rand(64, device="cuda") * 2 for _ in range(8)]
    metrics = [
        Mean("m", _identity), Sum("s", _identity), Max("x", _identity), Summary("y", _identity),
        CountTrue("c", lambda v: v > 1), Ratio("r", lambda v: v > 1),
        Histogram("h", _identity, edges=[0.0, 0.5, 1.0, 2.0]),  # its edges reach the device too
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for metric in metrics:
            for value in values:
                metric.on_post_collect(None, value)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    data = torch.cat(values).double().cpu()
    assert metrics[0].pull()["m"].finalize()["m"] == pytest.approx(data.mean().item())
    assert metrics[2].pull()["x"].finalize()["x"] == pytest.approx(data.max().item())
    assert metrics[4].pull()["c"].finalize()["c"] == (data > 1).sum().item()
    histogram = metrics[6].pull()["h"]
    assert sum(histogram.counts) == data.numel()
    assert (histogram.min, histogram.max) == (data.min().item(), data.max().item())
    assert histogram.sum == pytest.approx(data.sum().item(), rel=1e-12)
