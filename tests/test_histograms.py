"""Distributions drawn in TensorBoard's and W&B's histogram views, from the merged partials."""

from __future__ import annotations

import glob
import json
import math
import pickle

import pytest
import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    Histogram,
    LoggerObserver,
    MetricsChannel,
    Quantiles,
    draw_histograms,
)
from rl_observers.logging.histograms import coarsen, histogram_of
from rl_observers.stats import BinCounts, QuantileSketch
from tests.helpers import scalars, small_env
from tests.test_channel import _wandb_history, wait_for

EDGES = list(range(11))


def _obs(batch):
    return batch["observation"]


def _action(batch):
    return batch["action"].float() * 3.0 - 1.0  # negative, zero and positive values


def _episode_returns(batches):
    """Per batch, the returns of the episodes that ended in it (one env, running sums)."""
    running, out = 0.0, []
    for batch in batches:
        ended = []
        for reward, done in zip(batch["next", "reward"].reshape(-1).tolist(), batch["next", "done"].reshape(-1).tolist()):
            running += reward
            if done:
                ended.append(running)
                running = 0.0
        out.append(ended)
    return out


def _tensorboard_histograms(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    accumulator = EventAccumulator(events, size_guidance={"histograms": 0})
    accumulator.Reload()
    return [
        (event.step, list(event.histogram_value.bucket_limit), list(event.histogram_value.bucket))
        for event in accumulator.Histograms(tag)
    ]


def _tensorboard_fields(log_dir, tag):
    """``(step, (min, max, num, sum, sum_squares))`` of each histogram of ``tag`` in the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    accumulator = EventAccumulator(events, size_guidance={"histograms": 0})
    accumulator.Reload()
    out = []
    for event in accumulator.Histograms(tag):
        h = event.histogram_value
        out.append((event.step, (h.min, h.max, h.num, h.sum, h.sum_squares)))
    return out


def _fields_of(values):
    """What TensorBoard's own ``add_histogram`` computes from the raw values (float64)."""
    x = torch.as_tensor(values, dtype=torch.float64)
    return (x.min().item(), x.max().item(), float(x.numel()), x.sum().item(), (x * x).sum().item())


def _observed_collector(env_maker, logger_or_channel, *, multi=False, frames=600):
    if multi:
        collector = MultiSyncCollector([env_maker, env_maker], RandomPolicy(env_maker().action_spec), frames_per_batch=100, total_frames=frames)
    else:
        env = env_maker()
        collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=frames)
    collector.add_observer(
        LoggerObserver(
            logger_or_channel,
            schedule=Every.counter("frames", 200),
            metrics=[
                CollectorBatchMetrics(quantiles=(0.5,)),
                Histogram("obs", _obs, edges=EDGES),
                Quantiles("action", _action, q=(0.5,)),
            ],
        )
    )
    return collector


def _collect(collector):
    """Every batch the driver receives (cloned), then the collector's shutdown."""
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


@pytest.mark.real_collector
@pytest.mark.timeout(120)
def test_tensorboard_histograms_hold_the_merged_data_counts_row_by_row(tmp_path):
    from torchrl.record.loggers.tensorboard import TensorboardLogger

    logger = TensorboardLogger(exp_name="hist", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    assert draw_histograms(channel).backend == "tensorboard"
    collector = _observed_collector(small_env, channel)
    batches = _collect(collector)
    assert channel.close(timeout=30)
    logger.experiment.flush()
    windows = [batches[i : i + 4] for i in range(0, len(batches), 4)]  # 4 batches of 50 per row
    returns = _episode_returns(batches)
    obs = _tensorboard_histograms(tmp_path, "collector/obs")
    action = _tensorboard_histograms(tmp_path, "collector/action")
    episode = _tensorboard_histograms(tmp_path, "collector/episode_return")
    assert [step for step, _, _ in obs] == [200, 400, 600] == [step for step, _, _ in action]
    for row, window in enumerate(windows):
        values = torch.cat([_obs(b).reshape(-1) for b in window]).tolist()
        edges, counts = histogram_of(BinCounts.from_values("obs", values, edges=EDGES))
        assert obs[row][1:] == (edges[1:], counts)
        assert sum(obs[row][2]) == len(values)
        actions = torch.cat([_action(b).reshape(-1) for b in window]).tolist()
        edges, counts = histogram_of(QuantileSketch.from_values("action", actions, quantiles=(0.5,)))
        assert action[row][1:] == (pytest.approx(edges[1:]), counts)
        ended = [r for batch_returns in returns[4 * row : 4 * row + 4] for r in batch_returns]
        edges, counts = histogram_of(QuantileSketch.from_values("episode_return", ended, quantiles=(0.5,)))
        assert episode[row][1:] == (pytest.approx(edges[1:]), counts)
    # the quantile scalars are still logged (TensorBoard's scalars)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(glob.glob(f"{tmp_path}/**/events.out.tfevents.*", recursive=True)[0])
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("collector/obs_p50")] == [200, 400, 600]


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_are_merged_before_drawing(tmp_path):
    from torchrl.record.loggers.tensorboard import TensorboardLogger

    logger = TensorboardLogger(exp_name="multi", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    draw_histograms(channel, names=["obs"])
    collector = _observed_collector(small_env, channel, multi=True, frames=1_000)
    batches = _collect(collector)
    assert channel.close(timeout=60)
    logger.experiment.flush()
    drawn = _tensorboard_histograms(tmp_path, "collector/obs")
    assert not _tensorboard_histograms_or_none(tmp_path, "collector/action")  # names= filters
    # every row is one merged partial of both workers: its drawn counts are its logged count
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(glob.glob(f"{tmp_path}/**/events.out.tfevents.*", recursive=True)[0])
    accumulator.Reload()
    counts = {e.step: e.value for e in accumulator.Scalars("collector/obs_count")}
    assert [step for step, _, _ in drawn] == sorted(counts)
    for step, _, bucket in drawn:
        assert sum(bucket) == counts[step]
    # the exact fields merge across workers too: over the rows, they are all the data's
    fields = [f for _, f in _tensorboard_fields(tmp_path, "collector/obs")]
    low, high, num, total, squares = _fields_of(torch.cat([_obs(b).reshape(-1) for b in batches]))
    assert min(f[0] for f in fields) == low and max(f[1] for f in fields) == high
    assert [sum(f[i] for f in fields) for i in (2, 3, 4)] == [num, total, squares]
    # over all rows, the drawn counts are the counts of all the data both workers collected
    values = torch.cat([_obs(b).reshape(-1) for b in batches]).tolist()
    _, truth = histogram_of(BinCounts.from_values("obs", values, edges=EDGES))
    assert [sum(column) for column in zip(*(bucket for _, _, bucket in drawn))] == truth


def _tensorboard_histograms_or_none(log_dir, tag):
    try:
        return _tensorboard_histograms(log_dir, tag)
    except KeyError:
        return []


def _wandb_rows(run_file):
    return _wandb_history(run_file)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_wandb_offline_run_holds_the_merged_histograms(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from torchrl.record.loggers.wandb import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(exp_name="hist", offline=True, save_dir=str(tmp_path), project="hist", log_env_packages=False)
    drawer = draw_histograms(logger)  # the logger's shared channel, which its observers use
    assert drawer.backend == "wandb"
    channel = MetricsChannel.for_logger(logger)
    assert drawer.channel is channel
    collector = _observed_collector(small_env, logger)
    batches = _collect(collector)
    assert channel.close(timeout=30)
    logger.experiment.finish()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    # (the history flattens a histogram into <name>/_type, <name>/bins, <name>/values)
    assert wait_for(lambda: sum("collector/obs/bins" in row for row in _wandb_rows(run_file)) == 3)
    rows = [row for row in _wandb_rows(run_file) if "collector/obs/bins" in row]
    scalar_rows = [row for row in _wandb_rows(run_file) if "collector/obs_count" in row]
    for row, scalar_row, start in zip(rows, scalar_rows, range(0, len(batches), 4)):
        values = torch.cat([_obs(b).reshape(-1) for b in batches[start : start + 4]]).tolist()
        edges, counts = histogram_of(BinCounts.from_values("obs", values, edges=EDGES))
        assert row["collector/obs/_type"] == "histogram"
        assert (row["collector/obs/bins"], row["collector/obs/values"]) == (pytest.approx(edges), counts)
        assert scalar_row["collector/obs_count"] == len(values)
        assert scalar_row["collector/step"] == row["collector/step"]
    assert [row["collector/step"] for row in rows] == [200, 400, 600]


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_loggers_without_histograms_get_the_quantile_scalars_and_no_error(tmp_path):
    mlflow_logger = pytest.importorskip("torchrl.record.loggers.mlflow").MLFlowLogger(
        exp_name="hist", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"
    )
    csv_logger = CSVLogger(exp_name="hist", log_dir=str(tmp_path))
    for logger in (csv_logger, mlflow_logger):
        channel = MetricsChannel(logger)
        assert draw_histograms(channel).backend is None
        collector = _observed_collector(small_env, channel, frames=400)
        try:
            for _ in collector:
                pass
        finally:
            collector.shutdown()
        assert channel.close(timeout=30)  # True: no sink error
    assert [s for s, _ in scalars(csv_logger, "collector/obs_p50")] == [200, 400]
    assert [s for s, _ in scalars(csv_logger, "collector/episode_return_p50")] == [200, 400]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    history = client.get_metric_history(mlflow_logger.experiment.info.run_id, "collector/action_p50")
    assert sorted(m.step for m in history) == [200, 400]


def test_histogram_of_sketches_and_coarsening_keep_every_count():
    values = [-3.0, -3.0, 0.0, 0.5, 2.0, 2.01, 1e3]
    edges, counts = histogram_of(QuantileSketch.from_values("x", values))
    assert sum(counts) == len(values) and len(edges) == len(counts) + 1
    assert edges == sorted(edges)
    for value in values:  # each value lies in a bin that counts it
        assert any(lo <= value <= hi and c for lo, hi, c in zip(edges, edges[1:], counts))
    coarse_edges, coarse_counts = coarsen(edges, counts, 3)
    assert len(coarse_counts) <= 3 and sum(coarse_counts) == len(values)
    assert (coarse_edges[0], coarse_edges[-1]) == (edges[0], edges[-1])
    assert histogram_of(BinCounts("x", EDGES)) is None  # nothing to draw
    below_above = histogram_of(BinCounts.from_values("x", [-5.0, 20.0], edges=EDGES))
    assert below_above == ([-1.0, 0.0, *EDGES[1:], 11.0], [1.0] + [0.0] * 10 + [1.0])
    assert json.dumps(below_above)  # plain floats


def _small_angle(batch):
    """Values between the bin edges, both signs (as a pole angle's)."""
    return (batch["observation"].float() * 1.3).sin() * 0.2


@pytest.mark.timeout(120)
def test_tensorboard_histogram_fields_are_the_window_data_not_the_bins(tmp_path):
    from torchrl.record.loggers.tensorboard import TensorboardLogger

    logger = TensorboardLogger(exp_name="fields", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    draw_histograms(channel)
    env = small_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=600)
    edges = [i / 100 for i in range(-21, 22)]
    collector.add_observer(
        LoggerObserver(
            channel, schedule=Every.counter("frames", 200), metrics=[Histogram("angle", _small_angle, edges=edges)]
        )
    )
    batches = _collect(collector)
    assert channel.close(timeout=30)
    logger.experiment.flush()
    rows = _tensorboard_fields(tmp_path, "collector/angle")
    assert [step for step, _ in rows] == [200, 400, 600]
    for (_, fields), start in zip(rows, range(0, len(batches), 4)):
        window = torch.cat([_small_angle(b).reshape(-1) for b in batches[start : start + 4]])
        assert fields == pytest.approx(_fields_of(window), rel=1e-12, abs=1e-15)
        assert -0.21 < fields[0] and fields[1] < 0.21  # inside the outer edges, as the data


def test_histogram_fields_merge_exactly_and_leave_nan_out():
    nan = float("nan")
    metric = Histogram("x", lambda v: v, edges=EDGES)
    for value in (torch.tensor([0.5, nan, -2.0]), torch.tensor([]), 3.25, nan, torch.tensor([12.0, 7.5])):
        metric.on_post_collect(None, value)
    first = metric.pull()["x"]
    metric.on_post_collect(None, torch.tensor([-7.0, 1.0], dtype=torch.float64))
    second = metric.pull()["x"]
    assert metric.pull()["x"].max == -math.inf  # the window after a pull starts empty
    data = [0.5, -2.0, 3.25, 12.0, 7.5, -7.0, 1.0]
    for partial in (first.merge(second), second.merge(first)):
        assert (partial.min, partial.max, partial.sum, partial.sum_squares) == (
            -7.0, 12.0, math.fsum(data), math.fsum(v * v for v in data)
        )
        truth = BinCounts.from_values("x", [*data, nan, nan], edges=EDGES)
        assert (partial.counts, partial.nan) == (truth.counts, 2.0)
        assert (truth.min, truth.max, truth.sum, truth.sum_squares) == (
            partial.min, partial.max, partial.sum, partial.sum_squares
        )
    assert pickle.loads(pickle.dumps(first)).sum == first.sum
