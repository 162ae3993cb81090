"""torch.distributed / RPC collectors: rows that equal the driver's batches, or a refusal.

``DistributedCollector(sync=True)`` and ``DistributedSyncCollector`` stack the
workers' batches by rank: one ``LoggerObserver`` on the driver logs, row by
row, what a reference fold over the yielded batches (one running episode per
worker, rows at the driver's cumulative frames) computes in this test. Where
a batch does not say which worker's steps are which (``split_trajs=True`` here;
``RPCCollector`` and the async modes in ``test_torch_distributed.py``), episode
statistics are refused at ``add_observer``, and what stays allowed is exact.

The scenarios of a route run one after the other in a fresh interpreter (torch.distributed
keeps process-wide state; a collector's shutdown destroys its process group), the routes
side by side, with real torchrl workers (``launcher="mp"``, gloo over loopback, a free TCP
port) and a real ``CSVLogger``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torchrl.collectors.distributed import (
    DistributedCollector,
    DistributedSyncCollector,
)
from torchrl.envs import RewardScaling, TransformedEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv, CountingEnvCountPolicy

from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from rl_observers.remote.distributed import DistributedCollectorObservers, own_trajectory_ids
from rl_observers.signals import COLLECTOR_EVENTS
from tests.helpers import free_port, read_csv

FRAMES_PER_BATCH = 100  # 50 steps per worker: 8-step episodes span batches
TOTAL_FRAMES = 800
EVERY = 200
NAME = "collector"
EPISODE_METRICS = (
    "episode_return_mean", "episode_return_min", "episode_return_max",
    "episode_length_mean", "episode_length_min", "episode_length_max",
)


def make_env():
    # CountingEnv(max_steps=7) is done once count > 7; a reward of 1 per step.
    return TransformedEnv(CountingEnv(max_steps=7), RewardScaling(loc=1.0, scale=1.0))


def _policy(name: str):
    spec = make_env().action_spec
    # count policy: every episode exactly 8 steps; random: 0/1 increments, lengths vary
    return CountingEnvCountPolicy(spec) if name == "count" else RandomPolicy(spec)


def _build(route: str, policy: str, **extra):
    kwargs = dict(frames_per_batch=FRAMES_PER_BATCH, total_frames=TOTAL_FRAMES, launcher="mp", tcp_port=free_port())
    kwargs.update(extra)
    envs = [make_env] * 2
    if route == "DistributedCollector(sync=True)":
        return DistributedCollector(envs, _policy(policy), sync=True, **kwargs)
    if route == "DistributedSyncCollector":
        return DistributedSyncCollector(envs, _policy(policy), **kwargs)
    raise AssertionError(route)


def reference_rows(batches, every, rows_of):
    """The rows one observer on the driver logs over ``batches``: the truth, from the data.

    ``rows_of(batch)`` yields, per worker (and env), its ``(rewards, dones, traj_ids)``
    in time order; each keeps its own running episode across batches unless its
    trajectory id changes at the boundary (the batches do not join up: the episode in
    flight is dropped), and its steps are the frames counted. A row is due at the first batch whose cumulative frames reach the
    next multiple of ``every``; the last partial window is logged at close.
    """
    running: dict[int, list[float]] = {}
    last_ids: dict[int, int] = {}
    rows, rewards, episodes = [], [], []
    frames, threshold = 0, every

    def row():
        out = {"frames": float(frames), "reward_mean": sum(rewards) / len(rewards), "episodes": float(len(episodes))}
        if episodes:
            returns, lengths = [r for r, _ in episodes], [n for _, n in episodes]
            out.update(
                episode_return_mean=sum(returns) / len(returns), episode_return_min=min(returns),
                episode_return_max=max(returns), episode_length_mean=sum(lengths) / len(lengths),
                episode_length_min=float(min(lengths)), episode_length_max=float(max(lengths)),
            )
        return frames, out

    for batch in batches:
        for key, (step_rewards, dones, ids) in enumerate(rows_of(batch)):
            episode = running.setdefault(key, [0.0, 0])
            if last_ids.get(key, ids[0]) != ids[0]:
                episode[:] = [0.0, 0]
            last_ids[key] = ids[-1]
            for reward, done in zip(step_rewards, dones):
                episode[0] += reward
                episode[1] += 1
                rewards.append(reward)
                frames += 1
                if done:
                    episodes.append(tuple(episode))
                    episode[:] = [0.0, 0]
        if frames >= threshold:
            rows.append(row())
            rewards, episodes = [], []
            threshold = (frames // every + 1) * every
    if rewards:
        rows.append(row())
    return rows


def by_rank(batch):
    """A batch stacked by rank: row ``w`` is worker ``w``'s rollout, with its own trajectory ids.

    torchrl shifted worker ``w``'s ids by the largest (shifted) id of worker ``w - 1``.
    """
    shifted = batch["collector", "traj_ids"]
    for worker in range(batch.shape[0]):
        own = shifted[worker] - (shifted[worker - 1].max() if worker else 0)
        yield (
            batch["next", "reward"][worker].reshape(-1).tolist(),
            batch["next", "done"][worker].reshape(-1).tolist(),
            own.reshape(-1).tolist(),
        )


def breaks(batches) -> int:
    """Batch boundaries where a worker's env state does not carry on (torchrl tore a batch)."""
    count = 0
    for previous, batch in zip(batches, batches[1:]):
        for worker in range(batch.shape[0]):
            ended = previous["next", "done"][worker].reshape(-1)[-1]
            carried = previous["next", "observation"][worker][-1].equal(batch["observation"][worker][0])
            count += not (ended or carried)
    return count


def logged_rows(out: Path, names, namespace: str = NAME, exp: str = "dist") -> list[tuple[int, dict[str, float]]]:
    """``(step, {metric: value})`` per logged row, from the CSV files of ``namespace`` in experiment ``exp``."""
    directory = out / exp / "scalars" / namespace
    rows: dict[int, dict[str, float]] = {}
    for name in names:
        path = directory / f"{name}.csv"
        for step, value in read_csv(path) if path.exists() else []:
            rows.setdefault(step, {})[name] = value
    return sorted(rows.items())


THIS = "tests.remote.test_distributed_exact"


def fresh_run_of(item):
    """The interpreter a selected test reads (``tests/conftest.py``'s ``fresh_runs``): one per route, side by side."""
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    if item.originalname in (
        "test_stacked_by_rank_rows_equal_the_driver_s_batches",
        "test_episode_statistics_are_refused_where_a_batch_does_not_name_its_workers",
    ):
        return (f"{THIS}:scenarios", params["route"])
    if item.originalname == "test_per_worker_scope_logs_only_each_worker_s_rows":
        return (f"{THIS}:scenarios", PER_WORKER_RUN[0])
    return None


def _directory(*scenario: str) -> str:
    return re.sub(r"[^\w-]", "_", "-".join(scenario))


def scenarios(route: str, out: str) -> None:
    """The route's scenarios (:data:`SCENARIOS`), one after the other, each into its own directory.

    One interpreter serves them all: a collector's ``shutdown`` destroys its process group.
    """
    for name, *args in SCENARIOS[route]:
        where = Path(out, _directory(name, *args))
        where.mkdir()
        globals()[name](*args, str(where))


def _run(fresh_runs, scenario: str, route: str, *args: str) -> tuple[Path, dict]:
    """The scenario's output directory, once its route's interpreter ended well, and what it saw."""
    out = fresh_runs(f"{THIS}:scenarios", route) / _directory(scenario, route, *args)
    return out, json.loads((out / "seen.json").read_text())


def stacked_scenario(route: str, policy: str, scope: str, out: str) -> None:
    """One observer on the driver of a stacked-by-rank collector; the truth from its batches.

    With ``scope="both"``, a second observer, ``scope="per_worker"``, logs into its own
    logger (experiment ``per_worker``): one run of the collector serves both.
    """
    collector = _build(route, policy)
    channels = []
    try:
        for exp, its_scope in [("dist", scope)] + ([("per_worker", "per_worker")] if scope == "both" else []):
            channels.append(MetricsChannel(CSVLogger(exp_name=exp, log_dir=out), health_interval=None))
            collector.add_observer(
                LoggerObserver(
                    channels[-1], schedule=Every.counter("frames", EVERY), metrics=CollectorBatchMetrics(), scope=its_scope
                )
            )
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    flushed = all([channel.close(timeout=30) for channel in channels])
    seen = {
        "flushed": flushed,
        "shapes": [list(batch.shape) for batch in batches],
        "truth": reference_rows(batches, EVERY, by_rank),
        # each worker alone: its rows of the stacked batches, its own frames
        "worker_truth": [
            reference_rows(batches, EVERY, lambda batch, w=w: list(by_rank(batch))[w : w + 1]) for w in range(2)
        ],
        "yielded_traj_ids": [batch["collector", "traj_ids"].tolist() for batch in batches],
        "breaks": breaks(batches),
    }
    Path(out, "seen.json").write_text(json.dumps(seen))


STACKED = ["DistributedCollector(sync=True)", "DistributedSyncCollector"]
#: The stacked run whose second observer has ``scope="per_worker"``.
PER_WORKER_RUN = ("DistributedCollector(sync=True)", "random", "both")
#: Per route, the scenarios its interpreter runs: ``(function, *args)``.
SCENARIOS = {
    route: [("stacked_scenario", route, "count", "aggregate"), ("stacked_scenario", route, "random", "both")]
    for route in STACKED
}
SCENARIOS["DistributedSyncCollector"].append(("refused_scenario", "DistributedSyncCollector", "split"))


def assert_rows_equal(logged, truth):
    """Every logged row has the truth's step, metrics and values."""
    assert [step for step, _ in logged] == [step for step, _ in truth]
    for (step, row), (_, expected) in zip(logged, truth):
        assert set(row) == set(expected), step
        for name, value in expected.items():
            assert row[name] == pytest.approx(value, rel=1e-9), (step, name)


ROW_METRICS = ("frames", "reward_mean", "episodes", *EPISODE_METRICS)


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("route", STACKED)
@pytest.mark.parametrize(("policy", "scope"), [("count", "aggregate"), ("random", "both")])
def test_stacked_by_rank_rows_equal_the_driver_s_batches(route, policy, scope, fresh_runs):
    tmp_path, seen = _run(fresh_runs, "stacked_scenario", route, policy, scope)
    assert seen["flushed"]
    assert all(shape == [2, FRAMES_PER_BATCH // 2] for shape in seen["shapes"])
    truth = seen["truth"]
    logged = logged_rows(tmp_path, ROW_METRICS)
    # every row: the same step and the same numbers as the reference fold of the batches
    assert [step for step, _ in truth] == [200, 400, 600, 800]
    assert_rows_equal(logged, truth)
    if policy == "count" and not seen["breaks"]:
        # the set-up: every episode is 8 steps, in every row. (DistributedSyncCollector's
        # workers send a batch and collect the next one at once: torchrl sometimes yields a
        # batch torn from two, whose episode in flight does not continue, and then a
        # shorter one, counted from where it was seen; the rows still equal the truth.)
        assert [row["episode_length_mean"] for _, row in logged] == [8.0] * 4
        assert [row["episode_return_mean"] for _, row in logged] == [8.0] * 4
    workers = [logged_rows(tmp_path, ROW_METRICS, f"{NAME}/worker_{w}") for w in (0, 1)]
    if scope == "aggregate":
        assert workers == [[], []]
    else:  # each worker's rows: its batch[w], on its own frames
        for logged_worker, worker_truth in zip(workers, seen["worker_truth"]):
            assert [step for step, _ in worker_truth] == [200, 400]
            assert_rows_equal(logged_worker, worker_truth)
    # the caller's batches are torchrl's: its renumbered ids, untouched by the observers
    first = seen["yielded_traj_ids"][0]
    assert first[1][0] == max(first[0]) != 0  # worker 1 shifted by worker 0's largest id


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_worker_scope_logs_only_each_worker_s_rows(fresh_runs):
    tmp_path, seen = _run(fresh_runs, "stacked_scenario", *PER_WORKER_RUN)
    assert seen["flushed"]
    assert logged_rows(tmp_path, ROW_METRICS, exp="per_worker") == []
    for w, worker_truth in enumerate(seen["worker_truth"]):
        assert [step for step, _ in worker_truth] == [200, 400]
        assert_rows_equal(logged_rows(tmp_path, ROW_METRICS, f"{NAME}/worker_{w}", exp="per_worker"), worker_truth)


def test_the_observer_list_of_a_distributed_collector_is_made_from_the_collector_alone():
    # ``observe`` makes a source's observer list from the source alone
    observers = DistributedCollectorObservers(None)
    assert observers.emits == COLLECTOR_EVENTS and observers.target_name == "collector"


def test_own_trajectory_ids_undo_torchrl_s_renumbering():
    # three workers of two envs each, as torchrl renumbers them: worker i shifted by the
    # largest (already shifted) id of worker i - 1
    own = torch.tensor([[[0, 0, 1], [2, 3, 3]], [[0, 1, 1], [2, 2, 3]], [[4, 4, 4], [5, 6, 6]]])
    shifted = own.clone()
    for i in range(1, 3):
        shifted[i] += shifted[i - 1].max()
    ids = own_trajectory_ids(shifted, 3)
    assert torch.equal(ids, own * 3 + torch.arange(3).view(3, 1, 1))
    # unique across workers, and the same id for a trajectory in every batch it spans
    assert len(set(ids[0].flatten().tolist()) & set(ids[1].flatten().tolist())) == 0


def refused_scenario(route: str, split_trajs: str, out: str) -> None:
    """Episode statistics refused at add_observer; what stays allowed, against its truth."""
    collector = _build(route, "random", split_trajs=split_trajs == "split")
    logger = CSVLogger(exp_name="dist", log_dir=out)
    channel = MetricsChannel(logger, health_interval=None)
    refusals = []
    try:
        for metrics in (CollectorBatchMetrics(), CollectorBatchMetrics(episode_return=False)):
            try:
                collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", EVERY), metrics=metrics))
            except ValueError as error:
                refusals.append(str(error))
        attached = len(collector.observers)
        collector.add_observer(
            LoggerObserver(
                channel,
                schedule=Every.counter("frames", 10**9),
                metrics=CollectorBatchMetrics(episode_return=False, episode_length=False),
            )
        )
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    flushed = channel.close(timeout=30)
    mask = [b.get(("collector", "mask"), torch.ones(b.shape, dtype=torch.bool)) for b in batches]
    rewards = torch.cat([b["next", "reward"].squeeze(-1)[m] for b, m in zip(batches, mask)])
    seen = {
        "refusals": refusals,
        "attached": attached,
        "flushed": flushed,
        "frames": int(sum(int(m.sum()) for m in mask)),
        "reward_mean": rewards.double().mean().item(),
        "dones": sum(int((b["next", "done"].squeeze(-1) & m).sum()) for b, m in zip(batches, mask)),
    }
    Path(out, "seen.json").write_text(json.dumps(seen))


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("route", "split_trajs", "why"),
    # RPCCollector and DistributedCollector(sync=False) are refused, and what stays allowed
    # is exact, in the run tests/remote/test_torch_distributed.py makes of each
    [("DistributedSyncCollector", "split", "split_trajs=True")],
)
def test_episode_statistics_are_refused_where_a_batch_does_not_name_its_workers(route, split_trajs, why, fresh_runs):
    tmp_path, seen = _run(fresh_runs, "refused_scenario", route, split_trajs)
    assert seen["attached"] == 0  # nothing left attached by a refusal
    assert len(seen["refusals"]) == 2
    for message in seen["refusals"]:
        assert "cannot be exact on" in message and route.split("(")[0] in message
        assert why in message
        assert "CollectorBatchMetrics(episode_return=False, episode_length=False)" in message
        assert "DistributedSyncCollector or DistributedCollector(sync=True)" in message
    # what stays allowed is exact: one window over every frame the driver received
    assert seen["flushed"]
    rows = dict(logged_rows(tmp_path, ("frames", "reward_mean", "dones", "episodes", "episode_length_mean")))
    assert list(rows) == [seen["frames"]]
    (row,) = rows.values()
    assert row["frames"] == seen["frames"]
    assert row["reward_mean"] == pytest.approx(seen["reward_mean"], rel=1e-9)
    assert row["dones"] == row["episodes"]
    assert "episode_length_mean" not in row
    assert math.isfinite(row["reward_mean"])
    if route == "DistributedSyncCollector" and row["dones"] != seen["dones"]:
        # 1 run in ~4 here: the same frames and rewards, other done flags in the batches the test
        # cloned after the yield (torchrl's torn batches, docs/distributed.rst); seen, not hidden
        pytest.xfail(f"dones {row['dones']} logged, {seen['dones']} in the cloned batches")
    assert row["dones"] == seen["dones"]
