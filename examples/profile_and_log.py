"""Profile a few rollouts while logging metrics and keeping your own hook.

With plain torchrl, ``collector.enable_profile()`` takes the collector's single
``post_collect_hook`` slot: your hook stops running while the profiler is on,
and setting a hook later silently removes the profiler. With ``rl_observers``
the profiler is an observer like any other, so here three things run on every
batch of one CartPole collector, in this order:

1. your own ``post_collect_hook`` (counts frames),
2. a :class:`~rl_observers.ProfilerObserver` that records rollouts 1 to 3
   (rollout 0 warms up) into a Chrome trace, timing each other observer,
3. a ``LoggerObserver`` that folds reward and episode metrics at the source
   and logs them to a CSV logger every 400 frames, through a channel that
   never blocks collection.

The logging observer's work on each profiled rollout is inside the trace, as
``rl_observers/LoggerObserver.on_post_collect``. Open the trace in
https://ui.perfetto.dev or chrome://tracing; set ``TORCHRL_PROFILING=1`` to also
see torchrl's own ranges (``Collector.rollout``, ``EnvBase.step``, ...).

Run::

    python examples/profile_and_log.py [OUT_DIR]   # OUT_DIR defaults to runs/
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torchrl.collectors import Collector
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers import CSVLogger

from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    ProfilerObserver,
)


def main(
    out_dir: str | Path = "runs",
    *,
    frames_per_batch: int = 200,
    total_frames: int = 1_600,
    log_every: int = 400,
    num_rollouts: int = 4,
    warmup_rollouts: int = 1,
) -> dict[str, Any]:
    """Collects ``total_frames`` CartPole frames with a profiler, a logger and a user hook.

    Args:
        out_dir: where the trace (``profile/trace_0.json``) and the CSV log
            (``logs/profile_and_log/``) go. Defaults to ``"runs"``.

    Keyword Args:
        frames_per_batch (int, optional): frames per batch. Defaults to ``200``.
        total_frames (int, optional): frames to collect. Defaults to ``1_600``.
        log_every (int, optional): frames between two logged windows. Defaults to ``400``.
        num_rollouts (int, optional): rollouts the profiler runs for, warm-up
            included. Defaults to ``4``.
        warmup_rollouts (int, optional): rollouts before recording. Defaults to ``1``.

    Returns:
        A dict with the ``trace`` path, the ``log_dir``, the frames the
        user hook counted (``hook_frames``) and the last ``collector/frames``
        value the logger received (``logged_frames``).
    """
    out_dir = Path(out_dir)
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    collector = Collector(
        env,
        RandomPolicy(env.action_spec),
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
    )
    hook_frames = 0

    def count_frames(batch: Any) -> None:
        nonlocal hook_frames
        hook_frames += batch.numel()

    collector.post_collect_hook = count_frames  # your own hook keeps running
    profiler = ProfilerObserver(
        num_rollouts=num_rollouts,
        warmup_rollouts=warmup_rollouts,
        save_path=out_dir / "profile" / "trace_{worker_idx}.json",
        activities=["cpu", "cuda"],  # CUDA where available
        with_stack=False,  # smaller traces; True adds Python stacks
        record_observers=True,  # one range per observer call: who costs what
    )
    logger = CSVLogger("profile_and_log", log_dir=str(out_dir / "logs"))
    channel = MetricsChannel(logger)  # logs from its own thread
    collector.add_observer(profiler)
    collector.add_observer(
        LoggerObserver(
            channel,
            schedule=Every.counter("frames", log_every),
            metrics=CollectorBatchMetrics(episode_return=True),
        )
    )
    try:
        for _ in collector:
            pass  # train here: the time spent here is part of the next profiled step
    finally:
        collector.shutdown()
        channel.close()  # flushes what is pending; the logger stays ours
    frames = logger.experiment.scalars.get("collector/frames", [])
    return {
        "trace": profiler.trace_path,
        "log_dir": out_dir / "logs" / "profile_and_log",
        "hook_frames": hook_frames,
        "logged_frames": int(frames[-1][1]) if frames else 0,
    }


if __name__ == "__main__":
    result = main(sys.argv[1] if len(sys.argv) > 1 else "runs")
    print(f"trace: {result['trace']}")
    print(f"logs: {result['log_dir']}")
    print(f"frames seen by the hook / logged: {result['hook_frames']} / {result['logged_frames']}")
