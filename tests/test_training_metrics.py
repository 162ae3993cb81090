"""TrainingMetrics: training-loop values logged per window, exact, without a host-device sync."""

from __future__ import annotations

import math
import os
import socket
import statistics

import pytest
import torch
import torch.multiprocessing as mp
from torchrl.collectors import Collector
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    TrainingMetrics,
)
from tests.helpers import read_csv, scalars


def same_rows(actual, truth, rel=1e-9):
    """Steps equal, values equal up to float rounding."""
    assert [s for s, _ in actual] == [s for s, _ in truth]
    assert [v for _, v in actual] == pytest.approx([v for _, v in truth], rel=rel)
    return True


def _windows(records, every):
    """The rows a window of ``every`` steps gives: step of the closing record -> records."""
    rows, current, due = [], [], every
    for step, values in records:
        current.append(values)
        if step >= due:
            rows.append((step, current))
            current, due = [], (step // every + 1) * every
    if current:
        rows.append((records[-1][0], current))
    return rows


def test_training_loop_next_to_a_collector_logs_every_window_exactly(tmp_path):
    """A loss (tensor), a TD-error vector (summary), a gradient norm (max) and a host learning
    rate (latest) on the collector's frames axis, through the collector's own channel."""
    env = CountingEnv(max_steps=9)
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=1_000)
    logger = CSVLogger(exp_name="train", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector.add_observer(
        LoggerObserver(channel, schedule=Every.counter("frames", 200), metrics=CollectorBatchMetrics())
    )
    weight = torch.nn.Parameter(torch.ones(1))
    train = TrainingMetrics(channel, every=200, reduce={"td_error": "summary", "grad_norm": "max", "lr": "latest"})
    records, frames = [], 0
    try:
        for i, batch in enumerate(collector):
            frames += batch.numel()
            obs = batch["observation"].float()
            loss = (weight * obs).pow(2).mean()
            loss.backward()
            td = (obs.reshape(-1) - i).detach()
            lr = 0.1 / (i + 1)
            train.record(frames, loss=loss, td_error=td, grad_norm=weight.grad.norm(), lr=lr)
            records.append((frames, {"loss": loss.item(), "td": td.tolist(), "grad": weight.grad.norm().item(), "lr": lr}))
            weight.grad = None
    finally:
        collector.shutdown()
    train.close()
    assert channel.flush(timeout=30)
    channel.close()
    rows = _windows(records, 200)
    assert [s for s, _ in rows] == [200, 400, 600, 800, 1000]
    assert same_rows(scalars(logger, "train/loss"), [(s, statistics.fmean(r["loss"] for r in rs)) for s, rs in rows])
    assert same_rows(scalars(logger, "train/grad_norm"), [(s, max(r["grad"] for r in rs)) for s, rs in rows])
    assert scalars(logger, "train/lr") == [(s, rs[-1]["lr"]) for s, rs in rows]
    for name, stat in (("mean", statistics.fmean), ("std", statistics.pstdev), ("min", min), ("max", max)):
        truth = [(s, stat([v for r in rs for v in r["td"]])) for s, rs in rows]
        assert same_rows(scalars(logger, f"train/td_error_{name}"), truth), name
    # the collector's rows, on the same axis, in the same logger
    assert [s for s, _ in scalars(logger, "collector/reward_mean")] == [200, 400, 600, 800, 1000]
    # the CSV files hold the same rows
    assert same_rows(read_csv(next(tmp_path.rglob("loss.csv"))), scalars(logger, "train/loss"))


def test_a_partial_window_is_logged_at_close_and_empty_windows_are_not(tmp_path):
    logger = CSVLogger(exp_name="partial", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, background=False)
    train = TrainingMetrics(channel, every=10)
    for step in range(1, 15):
        train.record(step, loss=torch.tensor(float(step)))
    train.flush()
    train.flush()  # nothing new: no row
    train.record(15, loss=2.5)  # a host number merges with tensors of the same name
    train.record(16, loss=torch.tensor([3.5, 4.5]))
    channel.close()  # closes the recorder first (its last window)
    assert scalars(logger, "train/loss") == [(10, 5.5), (14, 12.5), (16, 3.5)]
    with pytest.raises(RuntimeError, match="closed"):
        train.record(17, loss=1.0)


def test_latest_logs_the_window_s_last_host_number_nan_included(tmp_path):
    logger = CSVLogger(exp_name="latest", log_dir=str(tmp_path))
    channel = MetricsChannel(logger, background=False)
    train = TrainingMetrics(channel, every=2, reduce={"lr": "latest"})
    records = [(1, 0.5), (2, math.nan), (3, math.nan), (4, 0.25), (5, 0.125)]
    for step, lr in records:
        train.record(step, lr=lr)
    channel.close()
    truth = [(step, window[-1]["lr"]) for step, window in _windows([(s, {"lr": v}) for s, v in records], 2)]
    rows = scalars(logger, "train/lr")
    assert [s for s, _ in rows] == [s for s, _ in truth] == [2, 4, 5]
    assert [str(v) for _, v in rows] == [str(v) for _, v in truth] == ["nan", "0.25", "0.125"]


def test_misuse_is_refused_with_what_to_do(tmp_path):
    channel = MetricsChannel(CSVLogger(exp_name="bad", log_dir=str(tmp_path)), background=False)
    with pytest.raises(ValueError, match="must be one of"):
        TrainingMetrics(channel, reduce={"loss": "median"})
    with pytest.raises(ValueError, match="every must be a positive int"):
        TrainingMetrics(channel, every=0)
    with pytest.raises(ValueError, match="only on ranks other than 0"):
        TrainingMetrics(None)
    train = TrainingMetrics(channel, reduce={"lr": "latest"})
    with pytest.raises(TypeError, match="pass a float"):
        train.record(1, lr=torch.tensor(0.1))
    with pytest.raises(TypeError, match="complex"):
        train.record(1, loss=torch.tensor([1j]))
    channel.close()


def test_a_logger_is_wrapped_in_its_shared_channel(tmp_path):
    logger = CSVLogger(exp_name="shared", log_dir=str(tmp_path))
    with TrainingMetrics(logger, every=2) as train:
        train.record(1, loss=torch.tensor(1.0))
        train.record(2, loss=torch.tensor(3.0))
    assert MetricsChannel.for_logger(logger).flush(timeout=10)
    assert scalars(logger, "train/loss") == [(2, 2.0)]


def _train_in_child(handle) -> None:
    with TrainingMetrics(handle, every=2) as train:
        for step in range(1, 5):
            train.record(step, loss=torch.tensor(float(step)))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_handle_records_from_another_process(tmp_path):
    logger = CSVLogger(exp_name="child", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    child = mp.get_context("forkserver").Process(target=_train_in_child, args=(channel.handle(),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert channel.flush(timeout=30)
    channel.close()
    assert scalars(logger, "train/loss") == [(2, 1.5), (4, 3.5)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_device_sync_per_step_on_cuda(tmp_path):
    logger = CSVLogger(exp_name="cuda", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    train = TrainingMetrics(channel, every=50, reduce={"td_error": "summary", "grad_norm": "max", "lr": "latest"})
    model = torch.nn.Linear(8, 1, device="cuda")
    data = torch.randn(200, 64, 8, device="cuda")
    losses = torch.empty(200, device="cuda")
    train.record(0, loss=torch.zeros((), device="cuda"), td_error=torch.zeros(64, device="cuda"), grad_norm=torch.zeros((), device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 201):
            out = model(data[step - 1]).squeeze(-1)
            loss = out.pow(2).mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            losses[step - 1] = loss.detach()
            train.record(step, loss=loss, td_error=out.detach(), grad_norm=norm, lr=1e-3)
            model.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    train.close()
    assert channel.flush(timeout=30)
    channel.close()
    host = losses.cpu()
    truth = [(50, (0.0 + host[:50].sum().item()) / 51)] + [
        (s, host[s - 50 : s].mean().item()) for s in (100, 150, 200)
    ]
    assert same_rows(scalars(logger, "train/loss"), truth, rel=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, log_dir: str, merge: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logger = CSVLogger(exp_name=f"rank_{rank}", log_dir=log_dir) if (rank == 0 or not merge) else None
        channel = MetricsChannel(logger) if logger is not None else None
        train = TrainingMetrics(channel, every=4, merge_ranks=merge, reduce={"grad_norm": "max"})
        for step in range(1, 11):
            # Rank r's loss at step s: a batch of (r + 1) values (uneven, so a mean of means would differ).
            values = torch.arange(rank + 1, dtype=torch.float32) + 10 * step + rank
            train.record(step, loss=values, grad_norm=torch.tensor(float(step * (rank + 1))))
        train.close()
        if channel is not None:
            assert channel.flush(timeout=30)
            channel.close()
    finally:
        torch.distributed.destroy_process_group()


def _truth(ranks, steps):
    values = [10 * s + r + k for r in ranks for s in steps for k in range(r + 1)]
    return statistics.fmean(values)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torch_distributed_ranks_merge_exactly_at_rank_0(tmp_path):
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path), True), nprocs=2, join=True)
    loss = read_csv(next(tmp_path.rglob("loss.csv")))
    windows = [(4, range(1, 5)), (8, range(5, 9)), (10, range(9, 11))]
    assert same_rows(loss, [(s, _truth([0, 1], steps)) for s, steps in windows])
    norm = read_csv(next(tmp_path.rglob("grad_norm.csv")))
    assert norm == [(4, 8.0), (8, 16.0), (10, 20.0)]
    assert not list(tmp_path.rglob("rank_1/**/*.csv"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torch_distributed_ranks_unmerged_log_apart(tmp_path):
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path), False), nprocs=2, join=True)
    for rank in (0, 1):
        (path,) = [p for p in tmp_path.rglob("loss.csv") if f"rank_{rank}" in str(p.parent)]
        windows = [(4, range(1, 5)), (8, range(5, 9)), (10, range(9, 11))]
        assert same_rows(read_csv(path), [(s, _truth([rank], steps)) for s, steps in windows])
        assert math.isfinite(read_csv(path)[0][1])
