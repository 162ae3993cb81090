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
