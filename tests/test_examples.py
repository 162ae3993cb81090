"""Every example runs, on a small budget, and produces what it promises."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_demo(tmp_path, capsys):
    summary = load("demo").main(str(tmp_path), total_frames=4_000, frames_per_batch=500)
    assert summary["collector/frames"] == (2, 4_000.0)
    assert summary["tensordictreplaybuffer/sample_calls"][1] == 32.0
    assert summary["collector/episodes_total"][1] > 0
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert "collector/episode_return_mean" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_collection(tmp_path):
    summary = load("ray_collection").main(str(tmp_path), total_frames=2_000, frames_per_batch=200)
    assert summary["collector/frames"] == (2_000, 2_000.0)
    assert summary["collector/workers"][1] == 2
    assert summary["collector/worker_0/frames"][1] + summary["collector/worker_1/frames"][1] == 2_000
    assert summary["buffer/items_written"][1] == 2_000
    assert summary["buffer/sample_calls"][1] == 40


@pytest.mark.timeout(120)
def test_episode_returns_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = load("episode_returns_tensorboard").main(str(tmp_path), total_frames=4_000)
    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("collector/episode_return_mean")] == [2_000, 4_000]


@pytest.mark.timeout(120)
def test_replay_buffer_health(tmp_path):
    scalars = load("replay_buffer_health").main(str(tmp_path), total_frames=2_000)
    assert [step for step, _ in scalars["buffer/sample_calls"]] == [20, 40]
    assert all(0 <= v for _, v in scalars["buffer/sample_age_min"])
    assert all(v > 0 for _, v in scalars["buffer/priority_weight_mean"])


@pytest.mark.timeout(180)
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = load("wandb_offline").main(str(tmp_path), total_frames=2_000)
    assert list(pathlib.Path(run_dir).parent.glob("run-*.wandb"))
