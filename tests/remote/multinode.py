"""A two-node Ray cluster on this one machine, for tests of what crosses nodes.

The head node runs as usual; the second ("far") node runs in its own mount
namespace (``unshare --mount``) with an empty tmpfs over the driver's
temporary directory, so it shares no temporary files with the driver: a Unix
socket or a file the driver creates under ``tempfile.gettempdir()`` does not
exist there, as on another machine. The far node has the custom resource
``far_node`` (the head ``head_node``): pin actors with
``.options(resources={"far_node": 0.01})``.

Every process is started in its own session and stopped by its process
group; the cluster's temporary directory (and its ``ray_current_cluster``
file) is removed, so a later plain ``ray.init(num_cpus=...)`` works.

Needs root (for the mount namespace), ``unshare`` and a working ``ray start``;
otherwise :func:`two_node_cluster` skips the test with the reason.

Examples:
    >>> with two_node_cluster() as cluster:  # doctest: +SKIP
    ...     ray.get(probe.options(resources={"far_node": 0.01}).remote())
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = [
    "ONE_CLUSTER_AT_A_TIME", "Cluster", "cluster_fixture", "in_cluster_group", "shared_cluster", "stop_shared_cluster", "two_node_cluster",
]

HEAD_IP = "127.0.0.1"
# The far node gets its own loopback address, so the driver (which connects to
# the raylet on its own IP) can never be attached to it by mistake.
FAR_IP = "127.0.0.2"
# How long the cluster may take to come up before the test is skipped.
START_TIMEOUT = 60.0
#: The mark of a module that starts a two-node cluster: under ``pytest -n`` one such module
#: runs at a time (two clusters side by side only compete for the cores).
ONE_CLUSTER_AT_A_TIME = pytest.mark.xdist_group("two_node_cluster")


@dataclass
class Cluster:
    """A running two-node cluster; the driver is connected to it."""

    address: str
    temp_dir: str
    head_node_id: str
    far_node_id: str
    start_seconds: float
    processes: list[subprocess.Popen] = field(default_factory=list)

    stop: Callable[[], None] = lambda: None

    #: resources that pin a task or actor to a node (a small fraction of the custom resource)
    far: dict[str, float] = field(default_factory=lambda: {"far_node": 0.01})
    head: dict[str, float] = field(default_factory=lambda: {"head_node": 0.01})


def _skip(reason: str) -> None:
    import pytest

    pytest.skip(f"two-node Ray cluster not available: {reason}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HEAD_IP, 0))
        return sock.getsockname()[1]


def _ray_command() -> list[str]:
    """``ray`` next to this interpreter, else the CLI module run by this interpreter."""
    binary = os.path.join(os.path.dirname(sys.executable), "ray")
    if os.access(binary, os.X_OK):
        return [binary]
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ADDRESS", None)
    return env


def _start(command: list[str], log: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_environment(),
            start_new_session=True,
        )


def _groups_of_sessions(sessions: set[int]) -> set[int]:
    """Process groups of every process in ``sessions`` (Ray's workers start their own group)."""
    groups = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                fields = file.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # after the command: state ppid pgrp session ...
        if int(fields[3]) in sessions:
            groups.add(int(fields[2]))
    return groups


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _paths_to_keep(hidden: str) -> list[str]:
    """The checkout and the interpreter's prefixes that live under ``hidden``.

    The far node hides the driver's temporary directory; a checkout (and its
    ``.venv``) that lives there too, as a CI clone under ``/tmp`` does, is
    bound back in, so the far node runs the same code. Nothing else of
    ``hidden`` is visible there.
    """
    candidates = {
        os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)),
        os.path.realpath(sys.prefix),
        os.path.realpath(sys.base_prefix),
    }
    keep: list[str] = []
    for path in sorted(candidates, key=len):
        if _under(path, hidden) and not any(_under(path, kept) for kept in keep):
            keep.append(path)
    return keep


def _stop(processes: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """Kills the process groups of the sessions the cluster's processes lead.

    ``ray start --block`` takes many seconds to act on SIGTERM and the cluster
    keeps no state worth saving, so its groups get SIGKILL. Each process was
    started with ``start_new_session=True``: its session holds exactly the
    processes it started, also Ray's workers, which live in groups of their own.
    """
    sessions = {proc.pid for proc in processes}
    deadline = time.monotonic() + timeout
    while True:
        groups = _groups_of_sessions(sessions)
        if not groups or time.monotonic() > deadline:
            break
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for proc in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
        time.sleep(0.05)
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)


def _tail(path: str, size: int = 2000) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - size))
            return file.read().decode(errors="replace")
    except OSError:
        return ""


def _wait_for_port(port: int, proc: subprocess.Popen, log: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start --head exited with {proc.returncode}: {_tail(log)}")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((HEAD_IP, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the head node did not listen on port {port}: {_tail(log)}")


def _wait_for_nodes(
    ray: Any, count: int, procs: list[tuple[subprocess.Popen, str]], deadline: float
) -> list[dict]:
    while time.monotonic() < deadline:
        for proc, log in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a ray node exited with {proc.returncode}: {_tail(log)}")
        alive = [node for node in ray.nodes() if node["Alive"]]
        if len(alive) >= count:
            return alive
        time.sleep(0.1)
    raise RuntimeError(f"fewer than {count} Ray nodes came up within {START_TIMEOUT} s")


@contextlib.contextmanager
def two_node_cluster(num_cpus: int = 1) -> Iterator[Cluster]:
    """Starts the cluster, connects this process as its driver; stops it all on exit.

    Args:
        num_cpus (int, optional): CPUs each node advertises. Defaults to ``1``.

    Skips the calling test (``pytest.skip``) when the cluster cannot run here:
    not root, no ``unshare``, Ray missing or already initialized, or a node
    failing to start.
    """
    import pytest

    ray = pytest.importorskip("ray")
    if os.geteuid() != 0:
        _skip("the far node's mount namespace (unshare --mount) needs root")
    unshare = shutil.which("unshare")
    if unshare is None:
        _skip("the 'unshare' command (util-linux) is not installed")
    if ray.is_initialized():
        _skip("Ray is already initialized in this process")
    hidden = tempfile.gettempdir()
    check = subprocess.run(
        [unshare, "--mount", "sh", "-c", f"mount -t tmpfs rlobs-hide {hidden}"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        _skip(f"cannot mount a tmpfs in a new mount namespace: {check.stderr.strip()}")

    started = time.monotonic()
    temp_dir = tempfile.mkdtemp(prefix="rlobs-ray-")
    port = _free_port()
    ray_cmd = _ray_command()
    common = ["--disable-usage-stats", "--block"]
    head_log = os.path.join(temp_dir, "head.log")
    head_cmd = [
        *ray_cmd, "start", "--head",
        f"--node-ip-address={HEAD_IP}",
        f"--port={port}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={num_cpus}",
        f"--resources={json.dumps({'head_node': 1})}",
        "--include-dashboard=false",
        f"--dashboard-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        *common,
    ]  # fmt: skip
    # The far node's temporary directory lives inside the tmpfs that hides the driver's.
    far_temp = os.path.join(hidden, f"rlobs-far-{uuid.uuid4().hex[:8]}")
    far_cmd = [
        *ray_cmd, "start",
        f"--address={HEAD_IP}:{port}",
        f"--node-ip-address={FAR_IP}",
        f"--temp-dir={far_temp}",
        f"--num-cpus={num_cpus}",
        f"--resources={json.dumps({'far_node': 1})}",
        f"--dashboard-agent-listen-port={_free_port()}",
        *common,
    ]  # fmt: skip
    # Paths the far node needs that the tmpfs would hide: bound aside first, then back in.
    stashes = [
        (path, f"/run/rlobs-keep-{uuid.uuid4().hex[:8]}") for path in _paths_to_keep(hidden)
    ]
    steps = [f"mkdir -p {shlex.quote(st)} && mount --bind {shlex.quote(p)} {shlex.quote(st)}" for p, st in stashes]
    steps.append(f"mount -t tmpfs rlobs-hide {shlex.quote(hidden)}")
    steps += [f"mkdir -p {shlex.quote(p)} && mount --bind {shlex.quote(st)} {shlex.quote(p)}" for p, st in stashes]
    steps.append(f"mkdir -p {shlex.quote(far_temp)}")
    far_script = " && ".join(steps) + " && exec " + " ".join(shlex.quote(arg) for arg in far_cmd)
    far_log = os.path.join(temp_dir, "far.log")
    processes: list[subprocess.Popen] = []
    connected = False
    stopped = False

    def stop() -> None:
        """Disconnects the driver, stops every process, removes the temporary directory."""
        nonlocal stopped, connected
        if stopped:
            return
        stopped = True
        if connected:
            ray.shutdown()
            connected = False
        _stop(processes)
        shutil.rmtree(temp_dir, ignore_errors=True)  # also removes its ray_current_cluster
        for _, stash in stashes:  # empty mount points, made on the host's /run
            with contextlib.suppress(OSError):
                os.rmdir(stash)

    try:
        try:
            head = _start(head_cmd, head_log)
            processes.append(head)
            deadline = started + START_TIMEOUT
            _wait_for_port(port, head, head_log, deadline)
            far = _start([unshare, "--mount", "sh", "-c", far_script], far_log)
            processes.append(far)
            address = f"{HEAD_IP}:{port}"
            ray.init(
                address=address,
                _node_ip_address=HEAD_IP,
                log_to_driver=False,
                include_dashboard=False,
            )
            connected = True
            nodes = _wait_for_nodes(ray, 2, [(head, head_log), (far, far_log)], deadline)
        except Exception as err:  # a node that does not start: skip, with its log
            _skip(f"ray start failed: {err}")
        by_resource = {
            key: node["NodeID"]
            for node in nodes
            for key in node["Resources"]
            if key in ("head_node", "far_node")
        }
        cluster = Cluster(
            address=address,
            temp_dir=temp_dir,
            head_node_id=by_resource["head_node"],
            far_node_id=by_resource["far_node"],
            start_seconds=time.monotonic() - started,
            processes=processes,
            stop=stop,
        )
        yield cluster
    finally:
        stop()


#: The cluster :func:`shared_cluster` started, with what stops it; ``None`` while none runs.
_shared: tuple[contextlib.ExitStack, Cluster] | None = None


def shared_cluster() -> Cluster:
    """The two-node cluster (one CPU a node) that the modules of :data:`ONE_CLUSTER_AT_A_TIME` share.

    Started on first use, or again once a test stopped it; it runs on while the next test is
    of the group: ``tests/conftest.py`` calls :func:`stop_shared_cluster` after a test whose
    next one is not (one start serves every module of the group, which run one after another).
    Skips the calling test as :func:`two_node_cluster` does.
    """
    global _shared
    if _shared is not None and not os.path.exists(_shared[1].temp_dir):  # a test stopped it
        stop_shared_cluster()
    if _shared is None:
        stack = contextlib.ExitStack()
        cluster = stack.enter_context(two_node_cluster())
        _shared = (stack, cluster)
    return _shared[1]


def in_cluster_group(item: pytest.Item) -> bool:
    """Whether the test ``item`` is of the group :data:`ONE_CLUSTER_AT_A_TIME` (it may use :func:`shared_cluster`)."""
    group = item.get_closest_marker("xdist_group")
    return group is not None and group.args[:1] == ONE_CLUSTER_AT_A_TIME.args


def stop_shared_cluster() -> None:
    """Stops the cluster :func:`shared_cluster` started, if it runs; disconnects the driver."""
    global _shared
    if _shared is not None:
        stack, _shared = _shared[0], None
        stack.close()


def cluster_fixture(scope: str = "module") -> Callable[..., Any]:
    """A pytest fixture (``scope`` defaults to the module) yielding the running :func:`shared_cluster`.

    Examples:
        >>> cluster = cluster_fixture()  # at the top of a test module
    """
    import pytest

    @pytest.fixture(scope=scope)
    def cluster() -> Cluster:
        return shared_cluster()

    return cluster
