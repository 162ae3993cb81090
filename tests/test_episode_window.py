"""CollectorBatchMetrics(episode_window=N): the last N episodes, across windows and workers.

Ground truth walks the batches the driver received, one step at a time, and
stamps every episode with where it ended: the step on its worker's own clock
(steps collected by that worker up to and including the last one of the
episode), the worker, and the env row.
"""

from __future__ import annotations

import math
import pickle
import statistics
from functools import partial

import pytest
import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from rl_observers.remote.aggregate import Aggregate
from rl_observers.stats import LatestWindow
from tests.helpers import scalars, start_method
from tests.test_collector_metrics import collect, make_env

RETURN_STATS = ("mean", "std", "min", "max", "p10", "median", "p90")


def ended_episodes(batches, *, rows_are_workers=False):
    """``[(stamp, worker, row, return, length)]`` of every episode that ends in ``batches``.

    A batch is ``[rows, T]`` (or ``[T]``). Rows are env rows of one worker, or
    (``rows_are_workers``, a ``MultiSyncCollector``'s batches) one worker each.
    An episode counts every step of its row since the previous end, whatever
    the batch; it ends where done, terminated or truncated is set.
    """
    out = []
    running: dict[int, tuple[float, int]] = {}
    clock = 0
    spans = 0  # episodes that ended in a later batch than they started in
    for b_index, batch in enumerate(batches):
        batch = batch.reshape(-1, batch.shape[-1])
        rows, steps = batch.shape
        reward = batch["next", "reward"].reshape(rows, steps).tolist()
        ends = (
            (batch["next", "done"] | batch["next", "terminated"] | batch["next", "truncated"])
            .reshape(rows, steps)
            .tolist()
        )
        for e in range(rows):
            for t in range(steps):
                ret, length, start = running.get(e, (0.0, 0, b_index))
                ret, length = ret + reward[e][t], length + 1
                if ends[e][t]:
                    worker, row = (e, 0) if rows_are_workers else (0, e)
                    out.append((clock + t + 1, worker, row, ret, length))
                    spans += start != b_index
                    running.pop(e, None)
                else:
                    running[e] = (ret, length, start)
        clock += steps
    return out, spans


def last(episodes, n):
    return sorted(episodes)[-n:]


def expected(episodes, n):
    """What the window of the last ``n`` of ``episodes`` finalizes to."""
    kept = last(episodes, n)
    returns = torch.tensor([e[3] for e in kept], dtype=torch.float64)
    lengths = [e[4] for e in kept]
    suffix = f"_last_{n}"
    q = torch.quantile(returns, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {
        "episode_return_mean" + suffix: statistics.fmean(returns.tolist()),
        "episode_return_std" + suffix: statistics.pstdev(returns.tolist()),
        "episode_return_min" + suffix: min(returns.tolist()),
        "episode_return_max" + suffix: max(returns.tolist()),
        "episode_return_p10" + suffix: q[0],
        "episode_return_median" + suffix: q[1],
        "episode_return_p90" + suffix: q[2],
        "episode_length_mean" + suffix: statistics.fmean(lengths),
    }


def assert_matches(window: LatestWindow, episodes, n):
    kept = last(episodes, n)
    assert [key for key, _ in window.entries] == [e[:3] for e in kept]
    got = [x for _, values in window.entries for x in values]
    assert got == pytest.approx([x for e in kept for x in e[3:]], abs=1e-5)
    got = window.finalize()
    want = expected(episodes, n)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-5), key


# -- the partial -----------------------------------------------------------------------


def _window(entries, size=4):
    return LatestWindow(size, ("r",), stats=[("count", "mean", "median")], entries=entries)


def test_merge_keeps_the_latest_entries_whatever_the_grouping_and_repetition():
    gen = torch.Generator().manual_seed(0)
    entries = [
        ((int(s), w, 0), (float(v),))
        for w in range(3)
        for s, v in zip(torch.randperm(50, generator=gen)[:9], torch.randn(9, generator=gen))
    ]
    parts = [_window(entries[i::3]) for i in range(3)]
    a, b, c = parts
    union = _window(entries)
    for merged in (a.merge(b).merge(c), c.merge(a.merge(b)), b.merge(c).merge(a).merge(b).merge(a)):
        assert merged.entries == union.entries
    assert union.entries == tuple(sorted(entries)[-4:])
    assert a.merge(_window([])).entries == a.entries  # the empty window is the identity
    assert _window([]).finalize() == {"r_count_last_4": 0.0}


def test_quantiles_are_exact_over_the_window():
    values = [3.0, -1.0, 7.5, 2.0, 0.25, 9.0, 4.0]
    window = LatestWindow(
        7,
        ("x",),
        stats=[("p10", "p25", "median", "p75", "p90")],
        entries=[((i, 0, 0), (v,)) for i, v in enumerate(values)],
    )
    qs = torch.quantile(
        torch.tensor(values, dtype=torch.float64),
        torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64),
    )
    assert list(window.finalize().values()) == pytest.approx(qs.tolist())


def test_partial_validates_and_pickles():
    with pytest.raises(ValueError, match="size must be a positive int"):
        LatestWindow(0, ("x",))
    for stat in ("p100", "p0", "q5", "p05"):
        with pytest.raises(ValueError, match="stats must be"):
            LatestWindow(3, ("x",), stats=[(stat,)])
    assert LatestWindow(3, ("x",), stats=[("p42", "p5")], entries=[((0, 0, 0), (1.0,))]).finalize() == {
        "x_p42_last_3": 1.0,
        "x_p5_last_3": 1.0,
    }
    with pytest.raises(ValueError, match="must agree"):
        LatestWindow(3, ("x",)).merge(LatestWindow(4, ("x",)))
    window = _window([((1, 0, 0), (2.0,))])
    assert pickle.loads(pickle.dumps(window)).entries == window.entries
    with pytest.raises(ValueError, match="episode_window must be a positive int"):
        CollectorBatchMetrics(episode_window=0)
    with pytest.raises(ValueError, match="episode_window needs"):
        CollectorBatchMetrics(episode_window=5, episode_return=False, episode_length=False)


# -- one process: windows of batches, both episode paths ---------------------------------


@pytest.mark.real_collector
@pytest.mark.parametrize("batch_size", [(), (3,)])
@pytest.mark.parametrize("running", [True, False], ids=["running_sums", "rewardsum"])
def test_last_episodes_are_exact_across_batches_and_windows(batch_size, running):
    batches = collect(
        make_env(batch_size=batch_size, reward_sum=not running),
        4 * max(1, math.prod(batch_size)),
        480 * max(1, math.prod(batch_size)),
    )
    episodes, spans = ended_episodes(batches)
    assert spans > 10
    n = 9
    kwargs = {"episode_reward_key": None, "step_count_key": None} if running else {}
    metrics = CollectorBatchMetrics(episode_window=n, **kwargs)
    seen = []
    for i, batch in enumerate(batches):
        metrics.on_post_collect(None, batch)
        seen.append(batch)
        if i % 5 == 4 or i == 0:  # windows of 5 batches: fewer than n episodes each, some
            window = metrics.pull()["episode_window"]
            so_far, _ = ended_episodes(seen)
            if so_far:
                assert_matches(window, so_far, n)
    assert len(episodes) > 5 * n


@pytest.mark.real_collector
def test_more_batches_than_a_ring_and_a_window_of_one_episode():
    batches = collect(make_env(batch_size=(2,)), 6, 600)
    episodes, _ = ended_episodes(batches)
    for n in (1, 40):
        metrics = CollectorBatchMetrics(
            episode_window=n, episode_reward_key=None, step_count_key=None
        )
        for batch in batches:
            metrics.on_post_collect(None, batch)
        assert_matches(metrics.pull()["episode_window"], episodes, n)


@pytest.mark.real_collector
def test_state_dict_and_pickling_keep_the_window():
    batches = collect(make_env(batch_size=(2,)), 6, 300)
    episodes, _ = ended_episodes(batches)
    n = 12
    metrics = CollectorBatchMetrics(episode_window=n, episode_reward_key=None, step_count_key=None)
    for batch in batches[:20]:
        metrics.on_post_collect(None, batch)
    metrics.pull()
    for batch in batches[20:27]:  # an open window: its episodes are part of the state too
        metrics.on_post_collect(None, batch)
    state = metrics.state_dict()
    resumed = CollectorBatchMetrics(episode_window=n, episode_reward_key=None, step_count_key=None)
    resumed.load_state_dict(state)
    copied = pickle.loads(pickle.dumps(metrics))
    for batch in batches[27:]:
        resumed.on_post_collect(None, batch)
        copied.on_post_collect(None, batch)
    assert_matches(resumed.pull()["episode_window"], episodes, n)
    assert_matches(copied.pull()["episode_window"], episodes, n)
    with pytest.raises(ValueError, match="episode window holds"):
        CollectorBatchMetrics(episode_window=n + 1).load_state_dict(state)


def test_fold_never_reads_a_value_on_the_host():
    batches = collect(make_env(batch_size=(2,)), 6, 240)
    for kwargs in ({}, {"episode_reward_key": None}):
        metrics = CollectorBatchMetrics(episode_window=5, **kwargs)
        for batch in batches:
            metrics.on_post_collect(None, batch.to("meta"))
        with pytest.raises((NotImplementedError, RuntimeError)):
            metrics.pull()


@pytest.mark.real_collector
def test_local_collector_into_a_csv_logger(tmp_path):
    env = make_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=5, total_frames=400)
    logger = CSVLogger(exp_name="local", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 40),
            name="collector",
            metrics=CollectorBatchMetrics(episode_window=10),
        )
    )
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert channel.close(timeout=30)
    rows = scalars(logger, "collector/episode_return_mean_last_10")
    assert len(rows) == 10
    for step, value in rows:
        so_far, _ = ended_episodes(batches[: step // 5])
        assert value == pytest.approx(expected(so_far, 10)["episode_return_mean_last_10"], abs=1e-5)
    assert scalars(logger, "collector/episode_return_median_last_10")


# -- workers: the owner merges the windows by end order ---------------------------------


def test_owner_carries_the_window_from_row_to_row():
    agg = Aggregate("collector", schedule=Every.counter("frames", 10))
    a = _window([((1, 0, 0), (1.0,)), ((5, 0, 0), (5.0,))])
    b = _window([((3, 1, 0), (3.0,))])
    rows = agg.contribute(0, {"w": a}, {"frames": 10})
    assert [e for e, _ in rows[0][1]["w"].entries] == [(1, 0, 0), (5, 0, 0)]
    rows = agg.contribute(1, {"w": b}, {"frames": 10})  # worker 0 did not contribute this row
    assert [e for e, _ in rows[0][1]["w"].entries] == [(1, 0, 0), (3, 1, 0), (5, 0, 0)]


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_multisync_workers_aggregate_by_episode_end_order(tmp_path):
    n, per_worker = 8, 5
    env = make_env()
    logger = CSVLogger(exp_name="multi", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    with start_method("fork"):
        collector = MultiSyncCollector(
            [partial(make_env, seed=0), partial(make_env, seed=1)],
            RandomPolicy(env.action_spec),
            frames_per_batch=2 * per_worker,
            total_frames=600,
        )
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 50),
            name="collector",
            scope="aggregate",
            metrics=CollectorBatchMetrics(episode_window=n),
        )
    )
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert channel.close(timeout=60)
    assert batches[0].shape == (2, per_worker)
    episodes, spans = ended_episodes(batches, rows_are_workers=True)
    assert spans > 10 and {e[1] for e in last(episodes, n)} == {0, 1}
    name = f"collector/episode_return_mean_last_{n}"
    rows = scalars(logger, name)
    assert len(rows) >= 5
    # Each row holds what each worker had contributed by then: some number of its batches.
    rounds = len(batches)
    for step, value in rows:
        total = step // per_worker
        candidates = []
        for r0 in range(max(0, total - rounds), min(rounds, total) + 1):
            r1 = total - r0
            seen = [e for e in episodes if e[0] <= (r0 if e[1] == 0 else r1) * per_worker]
            if seen:
                candidates.append(expected(seen, n)[f"episode_return_mean_last_{n}"])
        assert any(value == pytest.approx(c, abs=1e-5) for c in candidates), (step, value)
    final = expected(episodes, n)
    assert rows[-1] == (600, pytest.approx(final[f"episode_return_mean_last_{n}"], abs=1e-5))
    for key in (f"episode_return_median_last_{n}", f"episode_length_mean_last_{n}"):
        assert scalars(logger, "collector/" + key)[-1][1] == pytest.approx(final[key], abs=1e-5)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_window_larger_than_64_kib_travels_from_the_workers(tmp_path):
    n = 3000  # each worker's window pickles to ~100 KB once full
    env = make_env(max_steps=1)
    logger = CSVLogger(exp_name="wide", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, health_interval=None)
    with start_method("fork"):
        collector = MultiSyncCollector(
            [partial(make_env, max_steps=1, seed=0), partial(make_env, max_steps=1, seed=1)],
            RandomPolicy(env.action_spec),
            frames_per_batch=400,
            total_frames=8000,
        )
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", 2000),
            name="collector",
            scope="aggregate",
            metrics=CollectorBatchMetrics(episode_window=n),
        )
    )
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert channel.close(timeout=60)  # nothing dropped on the way
    assert channel.health()["dropped"] == 0
    episodes, _ = ended_episodes(batches, rows_are_workers=True)
    name = f"collector/episode_return_mean_last_{n}"
    final = expected(episodes, n)[f"episode_return_mean_last_{n}"]
    assert scalars(logger, name)[-1] == (8000, pytest.approx(final, abs=1e-5))
