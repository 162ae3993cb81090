"""Helpers shared by the test and benchmark suites.

One definition each: the waits (:func:`wait_for`), the balance identity of a
channel's health (:func:`assert_balanced`), real torchrl collectors
(:func:`make_collector`, :func:`make_multi`) and replay buffers
(:func:`replay_buffer`), a synchronous
``MetricsChannel`` (:func:`sync_channel`), a recording sink
(:class:`RecordingLogger`) and a local Ray cluster (:func:`local_ray`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torchrl.collectors import Collector
from torchrl.envs.utils import RandomPolicy
from torchrl.record.loggers.common import Logger
from torchrl.testing.mocking_classes import CountingEnv

if TYPE_CHECKING:
    from torchrl.envs import EnvBase

    from rl_observers.remote import MetricsChannel, MetricsHandle


@contextlib.contextmanager
def start_method(method: str) -> Iterator[None]:
    """torchrl picks the global start method (``spawn`` if unset) when workers start."""
    context = multiprocessing.context._default_context
    previous = context._actual_context
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        context._actual_context = previous


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> bool:
    """Polls ``predicate`` until it holds or ``timeout`` seconds passed; whether it held.

    A liveness wait, not a timing assert: assert its result (``assert wait_for(...)``)
    where the test needs the condition, ignore it where waiting is all it needs.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def assert_balanced(health: dict[str, int]) -> None:
    """Every submission is accounted for exactly once (the channel's balance identity)."""
    assert health["submitted"] == (
        health["logged"]
        + health["pending"]
        + health["coalesced"]
        + health["dropped"]
        + health["sink_errors"]
    ), health


def small_env(max_steps: int = 6) -> CountingEnv:
    """A ``CountingEnv`` whose episodes end every ``max_steps + 1`` steps; picklable by name, for workers."""
    return CountingEnv(max_steps=max_steps)


def replay_buffer(kind: str, capacity: int = 64, **kwargs: Any) -> Any:
    """A real torchrl replay buffer of ``kind`` on a ``LazyTensorStorage(capacity)``; ``kwargs`` go to its constructor.

    ``kind``: ``plain`` (``ReplayBuffer``), ``tensordict`` (``TensorDictReplayBuffer``),
    ``prioritized`` (``TensorDictPrioritizedReplayBuffer``), ``prioritized_plain``
    (``PrioritizedReplayBuffer``), or a ``TensorDictReplayBuffer`` with one more part:
    ``without_replacement``, ``slice`` (trajectories under ``"traj"``), ``round_robin``
    (``TensorDictRoundRobinWriter``), ``max_value`` (ranked by ``"rank"``),
    ``prioritized_max_value``. Priorities: alpha 0.7, beta 0.5.
    """
    from torchrl import data

    priorities = {"alpha": 0.7, "beta": 0.5}
    parts: dict[str, Callable[[], tuple[type, dict[str, Any]]]] = {
        "plain": lambda: (data.ReplayBuffer, {}),
        "tensordict": lambda: (data.TensorDictReplayBuffer, {}),
        "prioritized": lambda: (data.TensorDictPrioritizedReplayBuffer, priorities),
        "prioritized_plain": lambda: (data.PrioritizedReplayBuffer, priorities),
        "without_replacement": lambda: (data.TensorDictReplayBuffer, {"sampler": data.SamplerWithoutReplacement()}),
        "slice": lambda: (
            data.TensorDictReplayBuffer,
            {"sampler": data.SliceSampler(slice_len=4, traj_key="traj")},
        ),
        "round_robin": lambda: (data.TensorDictReplayBuffer, {"writer": data.TensorDictRoundRobinWriter()}),
        "max_value": lambda: (data.TensorDictReplayBuffer, {"writer": data.TensorDictMaxValueWriter(rank_key="rank")}),
        "prioritized_max_value": lambda: (
            data.TensorDictReplayBuffer,
            {
                "sampler": data.PrioritizedSampler(capacity, **priorities),
                "writer": data.TensorDictMaxValueWriter(rank_key="rank"),
            },
        ),
    }
    cls, own = parts[kind]()
    return cls(**{"storage": data.LazyTensorStorage(capacity), **own, **kwargs})


def make_collector(
    env: EnvBase | None = None,
    frames_per_batch: int = 16,
    total_frames: int | None = None,
    *,
    batches: int = 6,
    **kwargs: Any,
) -> Collector:
    """A real torchrl ``Collector`` with a ``RandomPolicy`` over ``env``.

    Args:
        env (EnvBase, optional): the env; ``CountingEnv(max_steps=7)`` when ``None``.
        frames_per_batch (int, optional): frames per batch. Defaults to ``16``.
        total_frames (int, optional): frames in all; ``frames_per_batch * batches``
            when ``None``.

    Keyword Args:
        batches (int, optional): batches in all, when ``total_frames`` is not given.
            Defaults to ``6``.
        **kwargs: passed on to ``Collector``.

    The caller shuts it down (the ``make_collector`` fixture of ``tests/conftest.py``
    does it after the test).
    """
    if env is None:
        env = CountingEnv(max_steps=7)
    if total_frames is None:
        total_frames = frames_per_batch * batches
    return Collector(
        env,
        RandomPolicy(env.action_spec),
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        **kwargs,
    )


def make_multi(cls: type, method: str, **kwargs: Any) -> Any:
    """A multiprocessing collector ``cls`` over two ``CountingEnv`` workers started with ``method``."""
    env = CountingEnv()
    with start_method(method):
        return cls([CountingEnv, CountingEnv], RandomPolicy(env.action_spec), **kwargs)


def sync_channel(logger: Any, **kwargs: Any) -> MetricsChannel:
    """A ``MetricsChannel`` without a thread (``background=False``) or health reports."""
    from rl_observers.remote import MetricsChannel

    kwargs.setdefault("health_interval", None)
    return MetricsChannel(logger, background=False, **kwargs)


def socket_handle(channel: MetricsChannel) -> MetricsHandle:
    """A handle that sends through the socket, as it does in another process."""
    return channel.handle(transport="socket")


class ListPartial:
    """An exact mergeable partial: it keeps every value, so a merge is the union."""

    def __init__(self, name: str, values=()) -> None:
        self.name = name
        self.values = tuple(values)
        self.finalized = 0

    def merge(self, other: ListPartial) -> ListPartial:
        return ListPartial(self.name, self.values + other.values)

    def finalize(self) -> dict[str, float]:
        self.finalized += 1
        return {
            f"{self.name}_count": float(len(self.values)),
            f"{self.name}_sum": float(sum(self.values)),
        }


class RecordingLogger(Logger):
    """A torchrl Logger that records every ``log_metrics`` call, and misbehaves on demand.

    Keyword Args:
        delay (float, optional): seconds each call takes (a slow sink). Defaults to ``0.0``.
        gate (threading.Event, optional): an Event each call waits on (a hung sink
            until it is set). Defaults to ``None``.
        fail (Callable[[int], bool], optional): ``fail(attempt)``; the calls for
            which it holds raise (``attempt`` counts from 1). Defaults to ``None``.

    Setting ``broken = True`` makes every call raise until it is set back to
    ``False``. Calls that raise are counted in ``attempts``, not recorded in
    ``calls``.
    """

    def __init__(
        self,
        *,
        delay: float = 0.0,
        gate: threading.Event | None = None,
        fail: Callable[[int], bool] | None = None,
    ) -> None:
        self.calls: list[tuple[dict[str, Any], int | None]] = []
        self.attempts = 0
        self.delay = delay
        self.gate = gate
        self.fail = fail
        self.broken = False
        self.shutdown_calls = 0
        self._lock = threading.Lock()
        super().__init__(exp_name="recording", log_dir="")

    def _create_experiment(self) -> None:
        return None

    def log_metrics(self, metrics, step=None, **kwargs):
        with self._lock:
            self.attempts += 1
            attempt = self.attempts
        if self.gate is not None:
            self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        if self.broken or (self.fail is not None and self.fail(attempt)):
            raise RuntimeError(f"sink failure on call #{attempt}")
        with self._lock:
            self.calls.append((dict(metrics), step))
        return metrics

    def log_scalar(self, name, value, step=None):
        self.log_metrics({name: value}, step)

    def shutdown(self, timeout=None):
        self.shutdown_calls += 1

    def log_video(self, name, video, step=None, **kwargs):
        raise NotImplementedError

    def log_hparams(self, cfg):
        raise NotImplementedError

    def log_histogram(self, name, data, **kwargs):
        raise NotImplementedError

    def __repr__(self) -> str:
        return "RecordingLogger()"

    def series(self, name: str) -> list[tuple[int | None, Any]]:
        """``(step, value)`` of every logged value of ``name``, in logging order."""
        with self._lock:
            return [(step, m[name]) for m, step in self.calls if name in m]

    def user_calls(self) -> list[tuple[dict[str, Any], int | None]]:
        """The calls that are not the channel's own health reports."""
        with self._lock:
            calls = list(self.calls)
        return [(m, s) for m, s in calls if not any(k.startswith("channel/") for k in m)]

    def health_calls(self) -> list[tuple[dict[str, Any], int | None]]:
        """The channel's own health reports (namespace ``channel``)."""
        with self._lock:
            calls = list(self.calls)
        return [(m, s) for m, s in calls if any(k.startswith("channel/") for k in m)]


def scalars(logger: Any, name: str) -> list[tuple[int, float]]:
    """The ``(step, value)`` pairs a torchrl ``CSVLogger`` logged under ``name``."""
    return logger.experiment.scalars.get(name, [])


class CountingHandle:
    """Stands for a Ray actor handle on the driver and counts the remote calls made through it."""

    def __init__(self, handle: Any, counts: Counter[str]) -> None:
        self._handle = handle
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        counts = self._counts

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return method.remote(*args, **kwargs)

        return _Method


@contextlib.contextmanager
def counting_rpcs(rb: Any) -> Iterator[Counter[str]]:
    """Counts every call the driver makes to ``rb``'s actor, through the buffer or its client."""
    counts: Counter[str] = Counter()
    handle = rb._rb
    rb._rb = rb._client._actor = CountingHandle(handle, counts)
    try:
        yield counts
    finally:
        rb._rb = rb._client._actor = handle


@contextlib.contextmanager
def local_ray(*by_value: ModuleType) -> Iterator[Any]:
    """A local Ray cluster (2 CPUs, no dashboard) for the block, unless one already runs.

    ``by_value`` modules are shipped to Ray's workers by value: Ray pickles what it is
    handed with its own copy of cloudpickle. Skips the test when Ray is not installed.
    """
    import pytest

    ray = pytest.importorskip("ray")
    for module in by_value:
        ray.cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        for module in by_value:
            ray.cloudpickle.unregister_pickle_by_value(module)
        if started:
            ray.shutdown()


def read_csv(path: Any) -> list[tuple[int, float]]:
    """The ``(step, value)`` rows of one scalar file written by torchrl's ``CSVLogger``."""
    import csv

    with open(path, newline="") as file:
        return [(int(step), float(value)) for step, value in csv.reader(file)]


def free_port() -> int:
    """A free port whose next one is free too (torchrl's store listens on port + 1)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
        try:
            with socket.socket() as second:
                second.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port


def preloaded_forkserver() -> None:
    """Starts multiprocessing workers from a forkserver that imported torch and torchrl once.

    A forkserver has spawn's semantics (a fresh process, arguments pickled) but forks each
    worker from a server that imported torch and torchrl once, instead of importing them
    again per worker (~6 s of CPU each). For the suite (tests/conftest.py) and the fresh
    interpreters it starts (:class:`FreshRun`, tests/resume_runs.py).
    """
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "torchrl.collectors", "torchrl.envs", "rl_observers"])


class FreshRun:
    """``function`` (``"module:name"``) called with ``args`` in a fresh interpreter, started now.

    For torch.distributed and RPC, which keep process-wide state (a second RPC collector in
    one process waits forever). Its workers start as the suite's do (:func:`preloaded_forkserver`).
    Its stderr goes to a file (a pipe nobody reads yet would stop it when full).
    """

    def __init__(self, function: str, *args: str) -> None:
        import os
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        root = Path(__file__).resolve().parents[1]
        module, name = function.split(":")
        code = (
            "import sys\n"
            "from tests.helpers import preloaded_forkserver\n"
            "if __name__ == '__main__':\n"
            "    preloaded_forkserver()\n"
            f"    from {module} import {name}\n"
            f"    {name}(*sys.argv[1:])\n"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            text=True,
            start_new_session=True,  # its own process group: stop() ends its workers too
        )

    def wait(self, timeout: float = 280) -> None:
        """Waits for the interpreter to end; fails with the end of its stderr unless it exited with 0."""
        import subprocess

        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            self._stderr.seek(0)
            raise AssertionError(f"timed out after {timeout} s; its stderr ends with:\n{self._stderr.read()[-4000:]}") from None
        self._stderr.seek(0)
        assert self._process.returncode == 0, self._stderr.read()[-4000:]

    def stop(self) -> None:
        """Kills the interpreter and what it started (its process group), if it still runs."""
        import os
        import signal

        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

