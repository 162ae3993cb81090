"""The DQN training-step yardstick: one agent, bare and observed blocks, paired ratios.

Shared by ``test_bench_training.py`` (the budget) and ``plot_throughput.py``
(the plot); the method is described in ``test_bench_training.py``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import pathlib
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

ITERATIONS_PER_BLOCK = 10  # = the observers' schedule: one emission per observed block
ROUNDS = 8

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load_dqn_module():
    if "dqn_cartpole" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dqn_cartpole", EXAMPLES / "dqn_cartpole.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["dqn_cartpole"] = module
        spec.loader.exec_module(module)
    return sys.modules["dqn_cartpole"]


dqn_cartpole = _load_dqn_module()


def _block(dqn) -> list[tuple[float, float]]:
    """CPU and wall seconds of each training iteration of one block."""
    times = []
    for _ in range(ITERATIONS_PER_BLOCK):
        cpu, wall = time.process_time(), time.perf_counter()
        dqn_cartpole.train(dqn, 1)
        times.append((time.process_time() - cpu, time.perf_counter() - wall))
    return times


def _paired_ratio(bare: list[list[float]], observed: list[list[float]]) -> float:
    """Mean over positions in the block of the median over rounds of bare / observed."""
    positions = range(len(bare[0]))
    return statistics.fmean(
        statistics.median(b[p] / o[p] for b, o in zip(bare, observed)) for p in positions
    )


def measure(dqn, observed, rounds: int = ROUNDS) -> dict[str, float]:
    """Paired ABBA blocks, bare and observed; ratios bare time / observed time."""
    blocks: dict[str, list[list[tuple[float, float]]]] = {"bare": [], "observed": []}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for round_ in range(rounds):
            order = ("bare", "observed") if round_ % 2 == 0 else ("observed", "bare")
            for kind in order:
                if kind == "observed":
                    observed.attach()
                    blocks[kind].append(_block(dqn))
                    observed.detach()
                    observed.channel.flush(timeout=30)
                else:
                    blocks[kind].append(_block(dqn))
    finally:
        if gc_was_enabled:
            gc.enable()
    cpu = {kind: [[t[0] for t in block] for block in b] for kind, b in blocks.items()}
    wall = {kind: [[t[1] for t in block] for block in b] for kind, b in blocks.items()}
    return {
        "ratio_cpu": _paired_ratio(cpu["bare"], cpu["observed"]),
        "ratio_wall": _paired_ratio(wall["bare"], wall["observed"]),
        **{
            f"{kind}_ms_per_iteration": statistics.median(sum(b) for b in wall[kind])
            / ITERATIONS_PER_BLOCK
            * 1e3
            for kind in wall
        },
        **{
            f"{kind}_cpu_ms_per_iteration": statistics.median(sum(b) for b in cpu[kind])
            / ITERATIONS_PER_BLOCK
            * 1e3
            for kind in cpu
        },
    }


@contextlib.contextmanager
def observed_dqn(out_dir: str | pathlib.Path, device: str = "cpu") -> Iterator[tuple[Any, Any]]:
    """The demo's agent with its observers built and detached, warmed up; closed afterwards.

    Warm-up: the random frames before updates start, then half a block
    observed, so that every later observed block has its emissions in its
    middle (schedules fire on multiples of their interval, counted while
    attached). Torch runs on one thread meanwhile, as in the demo. ``device``:
    where the agent's networks, loss and replay buffer live.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dqn = dqn_cartpole.make_dqn(dqn_cartpole.DQNConfig(device=device))
    observed = dqn_cartpole.observe(
        dqn, out_dir, every_batches=ITERATIONS_PER_BLOCK, log_on_close=False
    ).detach()
    try:
        dqn_cartpole.train(dqn, dqn.config.init_random_frames // dqn.config.frames_per_batch + 2)
        observed.attach()
        dqn_cartpole.train(dqn, ITERATIONS_PER_BLOCK // 2)
        observed.detach()
        observed.channel.flush(timeout=30)
        yield dqn, observed
    finally:
        dqn_cartpole.close(dqn)
        observed.close(timeout=30)
        torch.set_num_threads(threads)
