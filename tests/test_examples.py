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
def test_demo(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the demo imports its agent, dqn_cartpole
    summary = load("demo").main(str(tmp_path), total_frames=2_560)
    # 20 batches of 128 frames, the collector logging every 10 and the buffer every 80 samples
    # (8 updates per batch from the 8th batch on, when the buffer holds 1,024 frames).
    assert summary["collector/frames"] == (2, 2_560.0)
    assert summary["collector/episodes_total"][1] > 0
    assert summary["replay_buffer/sample_calls"][1] == 13 * 8
    for name in ("collector/episode_return", "collector/episode_length", "replay_buffer/sample_age"):
        low, median, high = (summary[f"{name}_p{p}"][1] for p in (5, 50, 95))  # the plot's bands
        assert low <= median <= high
    csv_files = list((tmp_path / "csv").rglob("episode_return_mean.csv"))
    assert len(csv_files) == 1 and csv_files[0].read_text().count("\n") == 2
    png = tmp_path / "dqn_cartpole.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "collector/episode_return_mean" in out and str(png) in out


def test_the_demo_plot_leaves_out_the_last_partial_window_of_a_count(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    demo = load("demo")
    # as make demo logs them: a window every 1,280 frames, the last one 128 frames long
    episodes = [(1_280.0 * i, 5.0) for i in range(1, 40)] + [(50_048.0, 0.0)]
    returns = [(step, 200.0) for step, _ in episodes]
    scalars = {"collector/episodes": episodes, **{f"collector/episode_return_p{p}": returns for p in (5, 50, 95)}}
    fig = demo.plot(scalars, tmp_path / "plot.png")
    panel = next(ax for ax in fig.axes if ax.get_title() == "collector/episodes")
    x, y = panel.lines[0].get_data()
    assert list(x) == [1_280.0 * i for i in range(1, 40)] and set(y) == {5.0}  # no false collapse to 0
    assert "left out" in panel.get_xlabel()
    ret = next(ax for ax in fig.axes if ax.get_title().startswith("collector/episode_return"))
    assert list(ret.lines[0].get_data()[0]) == [step for step, _ in returns]  # a median is not a count


@pytest.mark.timeout(120)
def test_dqn_cartpole_trains(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    module = importlib.import_module("dqn_cartpole")
    curve = module.main(frames=5_120)
    assert [frames for frames, _ in curve] == [5_120]
    dqn = module.make_dqn()
    module.train(dqn, 10)
    assert (dqn.frames, dqn.updates) == (1_280, 3 * dqn.config.updates_per_batch)
    module.close(dqn)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_collection(tmp_path):
    summary = load("ray_collection").main(str(tmp_path), total_frames=2_000, frames_per_batch=200)
    assert summary["collector/frames"] == (2_000, 2_000.0)
    assert summary["collector/workers"][1] == 2
    assert summary["collector/worker_0/frames"][1] + summary["collector/worker_1/frames"][1] == 2_000
    assert summary["buffer/items_written"][1] == 2_000
    assert summary["buffer/sample_calls"][1] == 40


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_multinode_runs_locally(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    summary = load("ray_multinode").main(str(tmp_path), workers=2, batches=10, size=16)
    assert summary["buffers/items_written"][1] == 2 * 10 * 16
    assert summary["buffers/workers"][1] == 2
    assert summary["buffers/worker_0/items_written"][1] == 10 * 16


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


@pytest.mark.timeout(120)
def test_training_metrics(tmp_path):
    rows = load("training_metrics").main(str(tmp_path), total_frames=2_000)
    assert [step for step, _ in rows["train/loss"]] == [1_000, 2_000]
    assert [step for step, _ in rows["collector/episode_return_mean"]] == [1_000, 2_000]
    assert [value for _, value in rows["train/lr"]] == [1e-2, 1e-2 * 0.5]  # at the 5th and 10th step
    for name in ("grad_norm", "td_error_mean", "td_error_std", "td_error_min", "td_error_max"):
        assert len(rows[f"train/{name}"]) == 2, name


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = load("histograms").main(str(tmp_path), total_frames=2_400)
    accumulator = EventAccumulator(log_dir, size_guidance={"histograms": 0})
    accumulator.Reload()
    angles = accumulator.Histograms("collector/pole_angle")
    returns = accumulator.Histograms("collector/episode_return")
    assert [e.step for e in angles] and [e.step for e in returns]
    counts = {e.step: e.value for e in accumulator.Scalars("collector/pole_angle_count")}
    assert {e.step: sum(e.histogram_value.bucket) for e in angles} == counts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_live_console(tmp_path):
    import io
    import re

    out = io.StringIO()
    console = load("live_console").main(str(tmp_path), total_frames=4_000, file=out)
    assert console.mode == "plain"  # not a terminal
    text = out.getvalue()
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text)
    last = text.splitlines()[-1]
    assert last.startswith("frames 4,000 | ") and "return " in last and "workers 2/2" in last
    assert "samples/s" in last


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_worker_health(tmp_path):
    rows = load("worker_health").main(str(tmp_path), total_frames=4_000)
    for name in ("frames_per_second", "batches_per_second", "resident_memory_mb"):
        for prefix in ("collector", "collector/worker_0", "collector/worker_1"):
            assert rows[f"{prefix}/{name}"], (prefix, name)
    assert all(v >= 0 for _, v in rows["collector/seconds_since_last_heard"])
    # per-worker rows are on each worker's own frames (docs/health.rst): 2,000 frames each
    assert [step for step, _ in rows["collector/frames_per_second"]] == [2000, 4000]
    for worker in (0, 1):
        assert [step for step, _ in rows[f"collector/worker_{worker}/frames_per_second"]] == [2000]
