"""``make gpu-check`` (scripts/gpu_check.py): the CUDA claims in one run, and a clean no-op without a GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def test_without_a_gpu_it_says_so_in_one_line_and_exits_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, whatever this machine has
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "gpu-check: no CUDA device here; nothing to check\n"), done.stderr


@pytest.mark.timeout(180)
def test_the_cuda_marker_selects_exactly_the_tests_the_claims_name():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_check import CLAIMS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:randomly"]
    done = subprocess.run([*command, "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=170)
    selected = {line for line in done.stdout.splitlines() if "::" in line}
    assert selected == set(CLAIMS.values()), done.stdout[-2000:]
