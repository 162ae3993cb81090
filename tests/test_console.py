"""LiveConsole: one line from the channel's thread, a tqdm bar in a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import logging
import pathlib
import re
import threading
import time

import pytest
import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger

import rl_observers  # noqa: F401
from rl_observers import CollectorBatchMetrics, Every, LiveConsole, LoggerObserver, MetricsChannel
from tests.helpers import scalars, small_env

CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # anything but "\n"
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "console.rst"


class ThreadRecordingConsole(LiveConsole):
    def __init__(self, *args, **kwargs):
        self.threads = set()
        super().__init__(*args, **kwargs)

    def _read(self, *args):
        self.threads.add(threading.current_thread().name)
        super()._read(*args)


def test_plain_lines_carry_the_logged_numbers_without_control_characters(tmp_path):
    env = small_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=600)
    logger = CSVLogger(exp_name="console", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 200), metrics=CollectorBatchMetrics()))
    out = io.StringIO()  # not a terminal: "auto" gives plain lines
    console = ThreadRecordingConsole(channel, plain_interval=0.0, file=out)
    assert console.mode == "plain"
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert channel.close(timeout=30)
    text = out.getvalue()
    assert not CONTROL.search(text)
    lines = text.splitlines()
    assert len(lines) == 3  # one per row (plain_interval=0), each different
    frames = [int(re.search(r"frames ([\d,]+)", line).group(1).replace(",", "")) for line in lines]
    assert frames == [s for s, _ in scalars(logger, "collector/frames")] == [200, 400, 600]
    returns = [float(re.search(r"return ([-\d.]+)", line).group(1)) for line in lines]
    assert returns == [round(v, 2) for _, v in scalars(logger, "collector/episode_return_mean")]
    assert all(" fps" in line for line in lines[1:])
    assert "lost" not in text
    assert console.threads == {"MetricsChannel[channel]"}  # never the collecting thread


def test_the_bar_is_throttled_and_ends_on_the_last_numbers(tmp_path):
    env = small_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=1_000)
    logger = CSVLogger(exp_name="bar", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 100), metrics=CollectorBatchMetrics()))
    out = io.StringIO()
    console = LiveConsole(channel, mode="bar", interval=3_600.0, total_frames=1_000, file=out)
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    assert channel.close(timeout=30)
    text = out.getvalue()
    assert "\r" in text  # tqdm rewrites its line
    # 10 rows, an hour between redraws: the bar's start, the first row and the close
    assert text.count("frames/s") + text.count("frames [") <= 4
    assert "1.00k/1.00k" in text.split("\r")[-1]
    assert re.search(r"1\.00k/1\.00k \[\d\d:\d\d, [\d,]+ fps \| return [-\d.]+\]", text.split("\r")[-1])
    assert console.line().startswith("frames 1,000")


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_and_samples_per_second_from_a_multi_worker_run(tmp_path):
    logger = CSVLogger(exp_name="workers", log_dir=str(tmp_path))
    channel = MetricsChannel(logger)
    collector = MultiSyncCollector([small_env, small_env], RandomPolicy(small_env().action_spec), frames_per_batch=100, total_frames=1_000)
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 200), metrics=CollectorBatchMetrics()))
    buffer = ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=16)
    buffer.attach_logger(channel, schedule=Every.counter("sample_calls", 20))
    out = io.StringIO()
    LiveConsole(channel, mode="plain", plain_interval=0.0, file=out)
    try:
        for batch in collector:
            buffer.extend(batch.reshape(-1))
            for _ in range(10):
                buffer.sample()
    finally:
        collector.shutdown()
    assert channel.close(timeout=60)
    lines = out.getvalue().splitlines()
    assert not CONTROL.search(out.getvalue())
    assert lines[-1].startswith("frames 1,000")
    assert "workers 2/2" in lines[-1]
    assert any("samples/s" in line for line in lines)


def test_losses_show_up(tmp_path):
    channel = MetricsChannel(CSVLogger(exp_name="lost", log_dir=str(tmp_path)), capacity=1, background=False)
    out = io.StringIO()
    console = LiveConsole(channel, mode="plain", plain_interval=0.0, file=out)
    channel.submit_metrics({"frames": 10}, step=10, namespace="a")
    channel.submit_metrics({"frames": 20}, step=20, namespace="b")  # the first entry is dropped
    channel.step()
    assert console.line() == "frames 20 | lost 1"
    assert out.getvalue().splitlines()[-1] == "frames 20 | lost 1"
    channel.close()


def test_a_wrong_mode_is_refused(tmp_path):
    channel = MetricsChannel(CSVLogger(exp_name="bad", log_dir=str(tmp_path)), background=False)
    with pytest.raises(ValueError, match="mode must be one of"):
        LiveConsole(channel, mode="fancy")
    channel.close()


def _screen(text):
    """The lines a terminal shows after ``text``: each ``\\r`` writes over its line from the start."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return [line for line in lines if line]


def _collect_and_sample(tmp_path, *, total_frames, after_loop=0.0):
    """Collects into a replay buffer and samples from it; ``after_loop`` seconds of other work
    come between the last batch and the shutdown.

    Returns the console's plain lines and the truths: frames per second over the collection
    (the test's own clock, loop start to the last batch) and samples per second (first to
    last sample).
    """
    env = small_env()
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=50, total_frames=total_frames)
    channel = MetricsChannel(CSVLogger(exp_name="rates", log_dir=str(tmp_path)))
    collector.add_observer(LoggerObserver(channel, schedule=Every.counter("frames", 1_000), metrics=CollectorBatchMetrics()))
    buffer = ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=32)
    buffer.attach_logger(channel, schedule=Every.counter("sample_calls", 100))
    out = io.StringIO()
    LiveConsole(channel, mode="plain", plain_interval=0.0, file=out)
    frames = samples = 0
    try:
        start = time.monotonic()
        for batch in collector:
            frames += batch.numel()
            last_batch = time.monotonic()
            buffer.extend(batch)
            for _ in range(3):
                buffer.sample()
                samples += 32
                if samples == 32:
                    first_sample = time.monotonic()
            last_sample = time.monotonic()
        time.sleep(after_loop)  # what a training script does before it shuts the collector down
    finally:
        collector.shutdown()
    assert channel.close(timeout=60)
    fps = frames / (last_batch - start)
    samples_per_second = (samples - 32) / (last_sample - first_sample)
    return out.getvalue().splitlines(), fps, samples_per_second


@pytest.mark.timeout(120)
def test_the_last_lines_rates_are_over_the_time_the_data_was_made(tmp_path):
    # 5,050 frames and 303 sample calls: the last window of each end (50 frames, 3 calls) is
    # logged at shutdown, two seconds after its data was made.
    lines, fps, samples_per_second = _collect_and_sample(tmp_path, total_frames=5_050, after_loop=2.0)
    last = lines[-1]
    assert last.startswith("frames 5,050 | ")
    shown_fps = float(re.search(r"([\d,]+) fps", last).group(1).replace(",", ""))
    shown_samples = float(re.search(r"([\d,]+) samples/s", last).group(1).replace(",", ""))
    assert shown_fps == pytest.approx(fps, rel=0.2), last
    assert shown_samples == pytest.approx(samples_per_second, rel=0.2), last


def _documented_plain_line():
    """The plain line's format as docs/console.rst gives it: ``frames <frames> | <fps> fps | ...``."""
    template = next(line.strip() for line in DOCS.read_text().splitlines() if line.strip().startswith("frames <"))
    number = r"-?[\d,]+(?:\.\d+)?"
    return [re.compile(re.sub(r"<[^>]+>", lambda _: number, re.escape(part))) for part in template.split(" | ")]


@pytest.mark.timeout(120)
def test_plain_lines_follow_the_documented_format(tmp_path):
    fields = _documented_plain_line()
    assert len(fields) == 6  # frames, fps, return, samples/s, workers, lost
    lines, _, _ = _collect_and_sample(tmp_path, total_frames=2_000)
    assert lines
    for line in lines:
        remaining = iter(fields)  # the line's fields are the documented ones, in their order
        assert all(any(field.fullmatch(part) for field in remaining) for part in line.split(" | ")), line
    assert " fps | return " in lines[-1] and " samples/s" in lines[-1]


def test_a_torchrl_log_line_while_the_bar_is_live_leaves_no_extra_line(tmp_path, monkeypatch):
    from torchrl._utils import logger as torchrl_logger

    terminal = io.StringIO()  # the bar and torchrl's console handler share the terminal
    monkeypatch.setattr("sys.stdout", terminal)
    handler = next(h for h in torchrl_logger.handlers if isinstance(h, logging.StreamHandler))
    monkeypatch.setattr(handler, "stream", terminal)
    channel = MetricsChannel(CSVLogger(exp_name="log", log_dir=str(tmp_path)), background=False)
    LiveConsole(channel, mode="bar", total_frames=1_000)
    buffer = ReplayBuffer(storage=LazyTensorStorage(100))
    buffer.extend(torch.zeros(10, 2))  # torchrl logs "Initialized LazyTensorStorage ..." at INFO
    channel.submit_metrics({"frames": 1_000}, step=1_000, namespace="collector")
    channel.step()
    assert channel.close()
    screen = _screen(terminal.getvalue())
    assert len(screen) == 2, screen  # the log line, then the bar: no bar left behind above it
    assert "Initialized LazyTensorStorage" in screen[0] and "%|" not in screen[0]
    assert "1.00k/1.00k" in screen[1]
