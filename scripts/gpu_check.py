"""The claims that need a CUDA device, checked in one run: ``make gpu-check``.

Runs every test marked ``cuda`` (``pytest -m cuda tests benchmarks``, the
benchmarks enabled so that the DQN step is held to its budget, not to the
``make test`` floor) and prints each claim next to the test that checks it.
Without a CUDA device it says so in one line and exits 0; ``make test`` skips
the same tests there. On a GPU it takes about a minute or two (the DQN
yardstick dominates).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: claim -> the test that checks it (every test marked ``cuda``; tests/test_gpu_check.py keeps
#: the two in step).
CLAIMS = {
    "no host-device sync per batch: collector metrics":
        "tests/test_collector_metrics.py::test_cuda_batches_fold_without_sync",
    "no host-device sync per batch: episode quantiles":
        "tests/test_quantiles.py::test_cuda_episode_quantiles_fold_without_sync",
    "no host-device sync per fold: Quantiles one-liner and QuantileReducer":
        "tests/test_quantiles.py::test_cuda_folds_do_not_sync",
    "no host-device sync per fold: one-liners, Histogram (counts and exact fields)":
        "tests/test_oneliners.py::test_cuda_values_fold_without_sync",
    "no host-device sync per step: training metrics":
        "tests/test_training_metrics.py::test_no_host_device_sync_per_step_on_cuda",
    "no sync added to writes and samples: sample ages (SampleMetrics), WriteMetrics":
        "tests/test_replay_buffer_metrics.py::test_cuda_buffer_metrics_add_no_sync_to_writes_and_samples",
    "the DQN training step, fully observed, >= 0.99 of bare on a GPU":
        "benchmarks/test_bench_training.py::test_dqn_training_ratio_on_cuda",
}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to check")
        return 0
    print(f"gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    for claim, test in CLAIMS.items():
        print(f"  {claim}\n    -> {test}")
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:randomly", "-q", "-rsP"]
    return subprocess.call([*command, "tests", "benchmarks"], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
