"""The rows one observer on the driver would log, computed from the batches the driver received.

Helpers of the tests of aggregate rows: what ``CollectorBatchMetrics`` with
``Every.counter("frames", interval)`` logs, step by step, over a sequence of
yielded batches, computed here from the data itself (rewards, dones) with a
running return and length per environment that carry across batches.
"""

from __future__ import annotations

from typing import Any

import torch

#: The series compared with the truth (``batches`` differs on purpose: an aggregate counts every
#: worker's rollouts, the driver its joined batches; ``workers*`` exist only in aggregates).
COMPARED = (
    "frames",
    "episodes",
    "episodes_total",
    "dones",
    "episode_return_mean",
    "episode_return_min",
    "episode_return_max",
    "episode_length_mean",
    "reward_mean",
)


def driver_rows(batches: list[Any], interval: int, log_on_close: bool = True) -> dict[str, list[tuple[int, float]]]:
    """``{series: [(step, value), ...]}`` of a driver-side observer over ``batches`` (``[envs, time]``)."""
    rows: dict[str, list[tuple[int, float]]] = {name: [] for name in COMPARED}
    running_return: torch.Tensor | None = None
    running_length: torch.Tensor | None = None
    frames = episodes_total = 0
    threshold = interval
    window: dict[str, Any] = {"returns": [], "lengths": [], "rewards": [], "dones": 0}

    def emit(step: int) -> None:
        returns, lengths = window["returns"], window["lengths"]
        values = {
            "frames": float(frames),
            "episodes": float(len(returns)),
            "episodes_total": float(episodes_total),
            "dones": float(window["dones"]),
            "reward_mean": torch.cat(window["rewards"]).double().mean().item(),
        }
        if returns:
            values["episode_return_mean"] = sum(returns) / len(returns)
            values["episode_return_min"] = min(returns)
            values["episode_return_max"] = max(returns)
            values["episode_length_mean"] = sum(lengths) / len(lengths)
        for name, value in values.items():
            rows[name].append((step, value))
        window.update(returns=[], lengths=[], rewards=[], dones=0)

    for batch in batches:
        reward = batch["next", "reward"].reshape(*batch.shape[:2], -1)[..., 0].double()
        done = batch["next", "done"].reshape(*batch.shape[:2], -1)[..., 0]
        if running_return is None:
            running_return = torch.zeros(batch.shape[0], dtype=torch.float64)
            running_length = torch.zeros(batch.shape[0], dtype=torch.int64)
        for t in range(batch.shape[1]):
            running_return += reward[:, t]
            running_length += 1
            for env in torch.nonzero(done[:, t]).flatten().tolist():
                window["returns"].append(running_return[env].item())
                window["lengths"].append(float(running_length[env].item()))
                running_return[env] = 0.0
                running_length[env] = 0
                episodes_total += 1
        window["dones"] += int(done.sum())
        window["rewards"].append(reward.flatten())
        frames += batch.numel()
        if frames >= threshold:
            emit(frames)
            threshold = (frames // interval + 1) * interval
    if log_on_close and window["rewards"]:
        emit(frames)
    return rows


def logged_rows(logger: Any, name: str) -> dict[str, list[tuple[int, float]]]:
    """``{series: [(step, value), ...]}`` that a ``CSVLogger`` logged under ``<name>/<series>``."""
    scalars = logger.experiment.scalars
    return {series: [(int(s), float(v)) for s, v in scalars.get(f"{name}/{series}", [])] for series in COMPARED}


def assert_rows_equal(logged: dict[str, list[tuple[int, float]]], truth: dict[str, list[tuple[int, float]]]) -> None:
    """Every row of every series equal: the same steps, the same values (to float precision)."""
    for series in COMPARED:
        got, want = logged[series], truth[series]
        assert [s for s, _ in got] == [s for s, _ in want], (series, got, want)
        for (step, value), (_, expected) in zip(got, want):
            assert abs(value - expected) <= 1e-6 * max(1.0, abs(expected)), (series, step, value, expected)
