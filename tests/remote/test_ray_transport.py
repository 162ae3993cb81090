"""The Ray transport: senders on any node reach the owner's ingest actor.

Every test shares one Ray cluster per module: the two-node cluster of
:mod:`tests.remote.multinode` where it can run (root, ``unshare``), a local one
otherwise (then the multi-node tests skip). Actors here take no CPU.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from rl_observers.channel.payload import Payload
from rl_observers.remote.aggregate import Aggregate
from rl_observers.remote.ray import transport as ray_transport
from rl_observers.remote.ray.ingest import Message
from rl_observers.remote.window import Window
from rl_observers.stats import Count, Moments
from tests.helpers import local_ray, wait_for
from tests.remote.multinode import (
    ONE_CLUSTER_AT_A_TIME,
    Cluster,
    _groups_of_sessions,
    shared_cluster,
)

pytestmark = ONE_CLUSTER_AT_A_TIME

# What a flush that must succeed may take (the ingest, a new Ray worker process, may still be
# starting with the other core busy). Returns when done.
FLUSH_SECONDS = 120.0


def load_transport() -> ModuleType:
    """``rl_observers.remote.ray.transport`` (kept for the benchmarks that import it)."""
    return ray_transport


class RayEnv:
    def __init__(self, ray: Any, cluster: Cluster | None) -> None:
        self.ray = ray
        self.cluster = cluster
        self.transport = load_transport()


@pytest.fixture(scope="module")
def ray_env() -> Iterator[RayEnv]:
    """The two-node cluster where it can run, else a local Ray."""
    ray = pytest.importorskip("ray")
    try:
        cluster = shared_cluster()
    except pytest.skip.Exception as skipped:
        reason = str(skipped)
    else:
        yield RayEnv(ray, cluster)
        return
    with local_ray() as ray:
        env = RayEnv(ray, None)
        env.skip_reason = reason
        yield env


class Recorder:
    """An ``accept`` that records what the owner receives: ``(payload, counts)`` pairs."""

    def __init__(self) -> None:
        self.messages: list[tuple[Payload | None, tuple[int, int]]] = []
        self.lock = threading.Lock()

    def __call__(self, payload: Payload | None, counts: tuple[int, int]) -> None:
        with self.lock:
            self.messages.append((payload, counts))

    def wait_for(self, condition, timeout: float = 60.0) -> bool:
        """Whether ``condition(messages)`` came to hold within ``timeout`` seconds."""

        def holds() -> bool:
            with self.lock:
                return condition(self.messages)

        return wait_for(holds, timeout)

    def total(self, key: str, namespace: str | None = None) -> Any:
        partial = None
        for payload, _ in self.messages:
            if payload is None:  # a message that only carries counts
                continue
            metrics = payload.metrics
            if key in metrics and (namespace is None or payload.namespace == namespace):
                partial = metrics[key] if partial is None else partial.merge(metrics[key])
        return partial

    def counts(self) -> tuple[int, int]:
        return (
            sum(m[1][0] for m in self.messages),
            sum(m[1][1] for m in self.messages),
        )


@pytest.fixture
def receiver(ray_env) -> Iterator[tuple[Any, Recorder]]:
    recorder = Recorder()
    receiver = ray_env.transport.RayReceiver(uuid.uuid4().hex[:12])
    receiver.start(recorder)
    yield receiver, recorder
    receiver.close(time.monotonic() + 5)


def n_of(recorder: Recorder, namespace: str | None = None) -> float:
    total = recorder.total("n", namespace)
    return 0.0 if total is None else total.n


def test_registry_hooks(ray_env, receiver):
    transport = ray_env.transport
    recv, _ = receiver
    address = recv.address()
    assert transport.NAME == "ray" and transport.PRIORITY > 0
    assert transport.reachable(address)
    assert not transport.reachable("/tmp/some.sock")
    assert isinstance(transport.make_sender(address), transport.RaySender)
    assert isinstance(transport.make_receiver("t"), transport.RayReceiver)
    sender = transport.make_sender(address)
    assert transport.make_sender(address) is sender  # one per process and address
    import pickle

    assert pickle.loads(pickle.dumps(address)) == address


def test_round_trip_keeps_every_payload(ray_env, receiver):
    recv, recorder = receiver
    sender = ray_env.transport.RaySender(recv.address())
    for i in range(20):  # windows of 20 workers (none merges with another on the way)
        window = Window(
            f"ns{i % 2}",
            {"x": float(i), "n": Count("n", 1)},
            i,
            observer="obs",
            worker=i,
            counters={"k": i},
        )
        sender.send(window)
    assert sender.flush(FLUSH_SECONDS)
    assert recorder.wait_for(lambda m: len(m) == 20)
    for ns in ("ns0", "ns1"):
        got = [
            (p.__class__, p.metrics["x"], p.step, p.observer, p.worker, p.counters)
            for p, _ in recorder.messages
            if p.namespace == ns
        ]
        assert got == [
            (Window, float(i), i, "obs", i, {"k": i}) for i in range(20) if f"ns{i % 2}" == ns
        ]
    assert recorder.counts() == (0, 0)
    assert sender.submitted == 20 and sender.dropped == 0
    sender.close(1.0)


def stalled_ingest(ray, transport) -> tuple[str, Any, Callable[[], Any]]:
    """An owner's token and address, and a call starting an ingest there whose pushes hang.

    The call can be made again once the previous ingest was killed (its name is reused).
    """
    token = uuid.uuid4().hex[:12]

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Stalled:
        def push(self, data, messages, dropped, coalesced):
            time.sleep(3600)

    address = transport.RayAddress(
        token, f"rl_observers-ingest-{token}", transport.ACTOR_NAMESPACE, "test owner"
    )

    def stall() -> Any:
        deadline = time.monotonic() + 10
        while True:
            try:
                actor = Stalled.options(name=address.ingest, namespace=address.namespace).remote()
                ray.get(actor.__ray_ready__.remote())
                return actor
            except ValueError:  # the name of the one killed before is not free yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    return token, address, stall


def test_bounded_in_flight_coalesces_then_drops_and_counts(ray_env):
    """A stalled ingest: at most ``in_flight`` calls wait, the buffer coalesces, then drops."""
    ray, transport = ray_env.ray, ray_env.transport
    token, address, stall = stalled_ingest(ray, transport)
    stalled = stall()
    sender = transport.RaySender(address, in_flight=2, capacity=4, interval=0.005)

    def send(ns):
        start = time.perf_counter()
        sender.send(Payload(ns, {"n": Count("n", 1), "g": 1.0}))
        return time.perf_counter() - start

    times = []
    for _ in range(2):  # two calls go out and hang
        times.append(send("a"))
        deadline = time.monotonic() + 10
        while sender.stats["calls"] < len(times) and time.monotonic() < deadline:
            time.sleep(0.005)
    assert sender.stats["in_flight"] == 2
    times += [send(ns) for ns in ["a", "b"] * 50 + ["c"] * 5]
    time.sleep(0.1)
    assert sender.stats["in_flight"] == 2  # bounded
    # a, b, a, b fill the buffer, the other 96 coalesce into them; the first c finds it full
    # and drops the oldest entry (one a, as the owner's queue does), the other c coalesce
    assert sender.coalesced == 100 and sender.dropped == 1
    assert sender.pending() == 4  # a, b, a, b wait in the buffer (health()'s "pending")
    assert max(times) < 0.05, times  # never waits for Ray
    assert not sender.flush(0.2)  # cannot finish: returns at its timeout

    ray.kill(stalled)  # the two calls in flight fail: their payloads are lost, counted
    deadline = time.monotonic() + 10
    while sender.dropped < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.dropped == 3

    recorder = Recorder()  # the owner comes (back): what was buffered gets through
    recv = transport.RayReceiver(token)
    recv.start(recorder)
    try:
        assert sender.flush(FLUSH_SECONDS)
        assert recorder.wait_for(lambda m: len(m) == 4)
        assert n_of(recorder) == 107 - 1 - 2  # 107 sent, one a dropped, 2 lost in flight
        assert recorder.counts() == (sender.dropped, sender.coalesced)
    finally:
        recv.close(time.monotonic() + 5)
        sender.close(1.0)


# -- many workers --------------------------------------------------------------------------------


def contribution(worker, values, frames, held=(1, 0), **fields) -> Message:
    """A message holding a window of the observer ``obs`` (``fields``: more :class:`Window` fields)."""
    metrics = {"r": Moments.from_values("r", values, stats=("count", "mean", "std", "min", "max"))}
    metrics["n"] = Count("n", 1)
    metrics["batch"] = float(len(values))
    window = Window(
        "obs", metrics, None, observer="obs", worker=worker, counters={"frames": frames}, **fields
    )
    return Message(window, (0, 0), held)


def rows_of(messages):
    aggregate = Aggregate("obs", scope="both")
    rows = []
    for window, _ in messages:
        rows += aggregate.contribute(window.worker, window.metrics, window.counters)
    return aggregate, rows


def merged(rows, namespace, key):
    total = None
    for ns, metrics, _ in rows:
        if ns == namespace and key in metrics:
            total = metrics[key] if total is None else total.merge(metrics[key])
    return total


def test_merge_is_exact_across_workers(ray_env, receiver):
    """Senders of several workers: the owner's aggregate equals the union of the data."""
    ray = ray_env.ray
    recv, recorder = receiver
    address = tuple(recv.address())

    @ray.remote(num_cpus=0)
    class Workers:
        def run(self, address, first, count, rounds):
            from tests.remote.test_ray_transport import contribution, load_transport

            sender = load_transport().RaySender(address)
            for i in range(rounds):
                for worker in range(first, first + count):
                    values = [float((worker * 7 + i * 3) % 11 - 5), float(i)]
                    sender.send(contribution(worker, values, (i + 1) * 2).payload)
            ok = sender.flush(FLUSH_SECONDS)
            return ok, sender.submitted, sender.dropped

    rounds = 40
    actors = [Workers.remote() for _ in range(3)]
    results = ray.get([a.run.remote(address, 4 * j, 4, rounds) for j, a in enumerate(actors)])
    assert all(ok and dropped == 0 for ok, _, dropped in results)
    assert recorder.wait_for(lambda m: sum(x[0].metrics["n"].n for x in m) == 12 * rounds)
    truth_values = [float((w * 7 + i * 3) % 11 - 5) for w in range(12) for i in range(rounds)] + [
        float(i) for w in range(12) for i in range(rounds)
    ]
    _, rows = rows_of(recorder.messages)
    stats = merged(rows, "obs", "r").finalize()
    truth = Moments.from_values(
        "r", truth_values, stats=("count", "mean", "std", "min", "max")
    ).finalize()
    assert stats.keys() == truth.keys()
    for key in truth:
        assert math.isclose(stats[key], truth[key], rel_tol=1e-12, abs_tol=1e-12), key
    for w in range(12):  # per-worker rows: each worker's own data, its last counters
        values = [float((w * 7 + i * 3) % 11 - 5) for i in range(rounds)] + [
            float(i) for i in range(rounds)
        ]
        got = merged(rows, f"obs/worker_{w}", "r").finalize()
        assert math.isclose(got["r_mean"], sum(values) / len(values), rel_tol=1e-12)
        assert got["r_count"] == len(values)
    for a in actors:
        ray.kill(a)


# -- faults --------------------------------------------------------------------------------------


def test_killing_the_ingest_mid_run(ray_env, receiver):
    """Sends never wait nor raise; the sender re-finds the new ingest; the restart is noticed."""
    ray, transport = ray_env.ray, ray_env.transport
    recv, recorder = receiver
    address = recv.address()
    sender = transport.RaySender(address)
    for _ in range(10):
        sender.send(Payload("a", {"n": Count("n", 1)}))
    assert sender.flush(FLUSH_SECONDS)
    assert recorder.wait_for(lambda m: n_of(recorder) == 10)
    ray.kill(ray.get_actor(address.ingest, namespace=address.namespace))
    worst = 0.0
    stop = time.monotonic() + 3.0
    sent = 10
    while time.monotonic() < stop:
        start = time.perf_counter()
        sender.send(Payload("a", {"n": Count("n", 1)}))
        worst = max(worst, time.perf_counter() - start)
        sent += 1
        time.sleep(0.002)
    assert worst < 0.5  # a send that waited on Ray would take its call's timeout, seconds
    start = time.monotonic()
    sender.flush(10.0)
    assert time.monotonic() - start < 12.0
    for _ in range(5):  # what comes after the fault gets through
        sender.send(Payload("b", {"n": Count("n", 1)}))
        sent += 1
    assert sender.flush(FLUSH_SECONDS)
    assert recorder.wait_for(lambda m: n_of(recorder, "b") == 5)
    assert recv.restarts >= 1  # what the dead ingest held is lost; its death is counted
    sender.close(1.0)


# -- a lost message costs every payload merged into it -------------------------------------------


def send_payloads(sender, namespace: str, count: int) -> int:
    """Sends ``count`` payloads, each ``Count("n", 1)``: what reaches the owner adds up to ``n``."""
    for _ in range(count):
        sender.send(Payload(namespace, {"n": Count("n", 1)}))
    return count


def flood(sender, namespace: str, bursts: int, size: int) -> int:
    """Sends ``bursts`` bursts of ``size`` payloads, each waiting for the sender's next call.

    With a sender of capacity 1 the payloads of a burst merge (coalesce) into
    the one message it buffers: a burst mostly leaves in one call.
    """
    for _ in range(bursts):
        calls = sender.stats["calls"]
        send_payloads(sender, namespace, size)
        wait_for(lambda calls=calls: sender.stats["calls"] > calls, timeout=10)
    return bursts * size


def assert_exact(recorder: Recorder, sender, sent: int) -> None:
    """The owner's counts are the sender's, and they account for every payload ``sent``.

    Each message that got through holds one payload plus those coalesced into
    it; every other payload is counted as dropped.
    """
    delivered = n_of(recorder)
    dropped, coalesced = recorder.counts()
    assert (dropped, coalesced) == (sender.dropped, sender.coalesced)
    assert dropped == sent - delivered, (sent, delivered, dropped)
    assert coalesced == delivered - sum(
        p is not None and "n" in p.metrics for p, _ in recorder.messages
    )


def test_a_full_ingest_counts_every_merged_payload_it_drops(ray_env):
    transport = ray_env.transport
    recorder = Recorder()
    recv = transport.RayReceiver(uuid.uuid4().hex[:12], capacity=1)
    recv.start(recorder, background=False)  # drained only when polled: it fills up
    try:
        sender = transport.RaySender(recv.address(), capacity=1, interval=0.005)
        sent = flood(sender, "a", bursts=10, size=20)
        assert sender.flush(FLUSH_SECONDS)  # every call returned (the ingest kept one batch)
        recv.poll(time.monotonic() + 10)
        delivered = n_of(recorder)
        dropped, coalesced = recorder.counts()
        assert 0 < delivered < sent
        assert dropped == sent - delivered, (sent, delivered, dropped)
        assert len(recorder.messages) + coalesced == delivered
        assert sender.dropped == 0
        sender.close(1.0)
    finally:
        recv.close(time.monotonic() + 5)


def test_a_drain_whose_get_times_out_hands_its_reply_to_the_next_drain(ray_env):
    """The ingest hands its messages out as the drain call runs: a get that times out (a flush's
    deadline; the thread's bounded wait) must not leave them behind."""
    transport = ray_env.transport
    recorder = Recorder()
    recv = transport.RayReceiver(uuid.uuid4().hex[:12])
    recv.start(recorder, background=False)
    try:
        # the ingest is empty: the call waits there for the first push, and this get times out
        assert recv.drain(5.0, timeout=0.0) == 0
        sender = transport.RaySender(recv.address(), interval=0.005)
        sent = flood(sender, "a", bursts=3, size=5)  # the first push is handed to that call
        assert sender.flush(FLUSH_SECONDS)
        recv.poll(time.monotonic() + 10)
        assert n_of(recorder) == sent and recorder.counts()[0] == 0
        sender.close(1.0)
    finally:
        recv.close(time.monotonic() + 5)


def test_a_call_that_fails_counts_every_payload_merged_into_its_messages(ray_env):
    ray, transport = ray_env.ray, ray_env.transport
    token, address, stall = stalled_ingest(ray, transport)
    first = stall()
    sender = transport.RaySender(address, in_flight=1, capacity=1, interval=0.005)
    sent = send_payloads(sender, "a", 1)
    assert wait_for(lambda: sender.stats["calls"] == 1, timeout=10)  # out, and hanging
    sent += send_payloads(sender, "a", 50)  # no call free: all merge into one buffered message
    assert sender.coalesced == 49
    ray.kill(first)
    assert wait_for(lambda: sender.dropped == 1, timeout=10)  # the call in flight held one payload
    second = stall()
    assert wait_for(lambda: sender.stats["calls"] == 2, timeout=10)  # the merged message hangs in it
    ray.kill(second)
    assert wait_for(lambda: sender.stats["in_flight"] == 0, timeout=10)
    assert (sender.dropped, sender.coalesced) == (51, 0)

    recorder = Recorder()  # the owner comes: the losses travel with what gets through
    recv = transport.RayReceiver(token)
    recv.start(recorder)
    try:
        sent += send_payloads(sender, "b", 5)
        assert sender.flush(FLUSH_SECONDS)
        assert recorder.wait_for(lambda m: n_of(recorder) == 5)
        assert_exact(recorder, sender, sent)
    finally:
        recv.close(time.monotonic() + 5)
        sender.close(1.0)


# -- the channel's side ---------------------------------------------------------------------------


def test_channel_handles_carry_both_addresses_and_pick_or_are_told(ray_env, tmp_path):
    """Connected to Ray, a channel's handles know the socket and Ray; the socket wins here."""
    import pickle

    from rl_observers import MetricsChannel
    from tests.helpers import RecordingLogger

    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    try:
        handle = channel.handle()
        assert handle.transport == "local"
        remote = pickle.loads(pickle.dumps(handle))
        assert set(remote._addresses) == {"socket", "ray"}
        forced = channel.handle(transport="ray")
        assert forced.transport == "ray" and "transport='ray'" in repr(forced)
        assert forced._send_through() is ray_transport.make_sender(forced.address)  # one per process
        forced.submit_metrics({"x": 1.0}, 3, namespace="through_ray")
        assert forced.flush(FLUSH_SECONDS)
        assert channel.flush(timeout=30)
        assert logger.series("through_ray/x") == [(3, 1.0)]
    finally:
        start = time.monotonic()
        assert channel.close(timeout=10)
        assert time.monotonic() - start < 12
    token = remote._token
    names = [a["name"] for a in ray_env.ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if token in n]  # close killed the ingest


# -- two nodes -----------------------------------------------------------------------------------


def test_far_node_reaches_the_owner_through_ray_and_not_through_its_socket(ray_env, receiver):
    cluster = ray_env.cluster
    if cluster is None:
        pytest.skip(ray_env.skip_reason)
    ray = ray_env.ray
    recv, recorder = receiver
    address = tuple(recv.address())
    directory = tempfile.mkdtemp(prefix="rlobs-sock-")
    path = os.path.join(directory, "owner.sock")
    owner = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    owner.bind(path)

    @ray.remote(num_cpus=0)
    def report(address, path, count):
        import errno
        import socket

        from tests.remote.test_ray_transport import contribution, load_transport

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.sendto(b"x", path)
            reached = True
        except OSError as err:
            reached = err.errno not in (errno.ENOENT, errno.ECONNREFUSED)
        sender = load_transport().RaySender(address)
        for i in range(count):
            sender.send(contribution(0, [float(i)], i + 1).payload)
        return (
            ray.get_runtime_context().get_node_id(),
            os.path.exists(path),
            reached,
            sender.flush(FLUSH_SECONDS),
            sender.dropped,
        )

    try:
        far = ray.get(report.options(resources=cluster.far).remote(address, path, 50))
        node, exists, reached, flushed, dropped = far
        assert node == cluster.far_node_id
        assert not exists and not reached  # the driver's socket does not exist there
        assert flushed and dropped == 0
        assert recorder.wait_for(lambda m: n_of(recorder) == 50)
        got = recorder.total("r").finalize()
        truth = Moments.from_values(
            "r", [float(i) for i in range(50)], stats=("count", "mean", "std", "min", "max")
        ).finalize()
        assert got == pytest.approx(truth, rel=1e-12)
        head = ray.get(report.options(resources=cluster.head).remote(address, path, 1))
        assert head[0] == cluster.head_node_id and head[1] and head[2]  # control: same machine
    finally:
        owner.close()
        os.unlink(path)
        os.rmdir(directory)


def test_far_node_does_not_see_the_drivers_temporary_files(ray_env):
    cluster = ray_env.cluster
    if cluster is None:
        pytest.skip(ray_env.skip_reason)
    ray = ray_env.ray
    fd, path = tempfile.mkstemp(prefix="rlobs-visible-")
    os.close(fd)

    @ray.remote(num_cpus=0)
    def sees(path):
        import tempfile

        return os.path.exists(path), sorted(os.listdir(tempfile.gettempdir()))

    try:
        far_sees, far_listing = ray.get(sees.options(resources=cluster.far).remote(path))
        head_sees, _ = ray.get(sees.options(resources=cluster.head).remote(path))
        assert head_sees and not far_sees
        assert os.path.basename(path) not in far_listing
    finally:
        os.unlink(path)


def test_cluster_stops_cleanly_and_plain_ray_init_works_after(ray_env):
    """Runs last in this module: stops the cluster, then a plain local Ray starts."""
    cluster = ray_env.cluster
    if cluster is None:
        pytest.skip(ray_env.skip_reason)
    ray = ray_env.ray
    start = time.monotonic()
    cluster.stop()
    stop_seconds = time.monotonic() - start
    assert not _groups_of_sessions({p.pid for p in cluster.processes})
    assert not os.path.exists(cluster.temp_dir)
    assert stop_seconds < 15
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.cluster_resources()["CPU"] == 2
    finally:
        ray.shutdown()
    print(
        f"two-node cluster: started in {cluster.start_seconds:.1f} s, stopped in {stop_seconds:.1f} s"
    )


def test_merging_keeps_the_newest_plain_numbers_of_windows_that_passed_each_other():
    # The ingest takes a copy's windows out of order (4 calls in flight, a threaded actor), and
    # the owner's full queue merges them: the gauges of the window sent last win, the partials
    # merge, the counters are the newest.
    newer, older = contribution(0, [1.0], 5, seq=5), contribution(0, [2.0, 3.0], 4, seq=4)
    merged = newer.payload
    assert merged.absorb(older.payload) is None
    assert merged.metrics["batch"] == 1.0  # not 2.0, the stale window's gauge
    assert merged.metrics["r"].finalize()["r_count"] == 3
    assert merged.counters == {"frames": 5} and merged.seq == 5
    newer, older = contribution(0, [1.0], 5, seq=5), contribution(0, [2.0, 3.0], 4, seq=4)
    in_order = older.payload
    assert in_order.absorb(newer.payload) is None
    assert in_order.metrics["batch"] == 1.0 and in_order.counters == {"frames": 5}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_own_sending_thread():
    """``send`` reads a flag, not the pid: a fork clears it, so the child's first send starts a thread."""
    sender = ray_transport.RaySender(("token", "ingest", "namespace", "owner"))
    sender.send(Payload("ns", {"n": Count("n", 1)}))  # no Ray here: the thread just retries
    assert sender._running
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        ok = not sender._running
        sender.send(Payload("ns", {"n": Count("n", 1)}))
        ok = ok and sender._running
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert sender._running
    assert sender.submitted == 1
