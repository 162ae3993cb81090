"""``make demo`` and ``make test`` share one environment; ``make test`` keeps a test group on one worker."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_demo_reuses_an_environment_made_by_make_test(tmp_path):
    """A venv with the test extras (marker newer than pyproject.toml) is not installed again for the demo.

    The venv here has no Python at all: any install step would fail, so make succeeding
    (and writing the demo's marker) means it installed nothing.
    """
    venv = tmp_path / "venv"
    venv.mkdir()
    for marker in (".torch", ".test"):
        (venv / marker).touch()
    later = (ROOT / "pyproject.toml").stat().st_mtime + 10
    for marker in (".torch", ".test"):
        os.utime(venv / marker, (later, later))
    done = subprocess.run(
        ["make", "-C", str(ROOT), f"VENV={venv}", f"{venv}/.demo"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (venv / ".demo").is_file()
    assert "pip" not in done.stdout
    # An environment without the test extras still installs the demo's (and fails here, no Python).
    (venv / ".test").unlink()
    (venv / ".demo").unlink()
    done = subprocess.run(
        ["make", "-C", str(ROOT), f"VENV={venv}", f"{venv}/.demo"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert "bin/python" in done.stderr  # the install step ran (and found no Python)
    assert not (venv / ".demo").exists()


@pytest.mark.xdist_group("one_worker")
def test_make_test_keeps_a_group_on_one_worker(request):
    """Under ``--dist loadgroup`` a module's shared set-up runs on one worker, not on each.

    pytest-xdist 3.8 names a test's group in its node id, which pytest 9.2 ignores
    (pytest-dev/pytest-xdist#1386): the test extras pin pytest below 9.2.
    """
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@one_worker"), "pytest-xdist did not group the tests"
