"""Shared fixtures: small real torchrl objects."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import warnings

import pytest
import torch
from torchrl._utils import logger as torchrl_logger

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RL_WARNINGS", "0")

import rl_observers  # noqa: E402,F401  (installs add_observer on torchrl's classes)
from tests import helpers  # noqa: E402

# torchrl starts its workers with the global start method (spawn when unset). A
# forkserver has spawn's semantics (a fresh process, arguments pickled) but forks
# each worker from a server that imported torch and torchrl once, instead of
# importing them again per worker (~6 s of CPU each). Tests about a start method
# set it themselves (tests.helpers.start_method).
multiprocessing.set_start_method("forkserver", force=True)
multiprocessing.set_forkserver_preload(["torch", "torchrl.collectors", "torchrl.envs", "rl_observers"])


@pytest.fixture
def counting_env():
    from torchrl.testing.mocking_classes import CountingEnv

    return CountingEnv(max_steps=7)


@pytest.fixture
def make_collector():
    """Builds real ``Collector`` objects (:func:`tests.helpers.make_collector`) and shuts them down after the test."""
    made = []

    def make(env, frames_per_batch=16, total_frames=64, **kwargs):
        collector = helpers.make_collector(env, frames_per_batch, total_frames, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.shutdown(raise_on_error=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gate():
    """An Event a hung logger waits on; released at teardown so its thread ends."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def warnings_seen():
    """Messages of the warnings sent through torchrl's logger (it does not propagate)."""
    messages: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = _Handler(level=logging.WARNING)
    torchrl_logger.addHandler(handler)
    yield messages
    torchrl_logger.removeHandler(handler)


@pytest.fixture
def told(warnings_seen):
    """What the user is told: torchrl logger warnings and ``warnings`` messages, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield warnings_seen
    warnings_seen.extend(str(w.message) for w in caught)
