"""The socket transport of ``rl_observers.remote``: handles send datagrams to the channel's owner.

A handle forced onto the socket (``transport="socket"``) sends as it does in a
worker process; real forked, spawned and killed child processes send through
the handles they were given. Moved out of ``tests/test_channel.py``, whose
tests are the channel's own (queue, coalescing, delivery, health, loggers).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import threading

import pytest

from rl_observers.remote import MetricsChannel, MetricsHandle
from tests.helpers import ListPartial, RecordingLogger, assert_balanced, socket_handle, sync_channel


def test_reducers_partials_cross_the_socket():
    reducers = pytest.importorskip("rl_observers.stats")
    logger = RecordingLogger()
    channel = sync_channel(logger)
    handle = socket_handle(channel)
    handle.submit_metrics(
        {"ret": reducers.Moments.from_values("episode_return", [1.0, 3.0])}, step=2, namespace="w"
    )
    channel.step()
    assert logger.calls == [
        (
            {
                "w/episode_return_mean": 2.0,
                "w/episode_return_std": 1.0,
                "w/episode_return_min": 1.0,
                "w/episode_return_max": 3.0,
            },
            2,
        )
    ]
    channel.close()


# ---------------------------------------------------------------------------
# handles and the datagram transport
# ---------------------------------------------------------------------------


def test_a_handle_unpickled_in_the_same_process_submits_directly():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    handle = pickle.loads(pickle.dumps(channel.handle()))
    assert isinstance(handle, MetricsHandle)
    handle.submit_metrics({"x": 1.0}, step=5, namespace="w")
    assert channel.health()["pending"] == 1  # no transport in between
    assert handle.flush(timeout=10)  # the channel's flush
    assert logger.calls == [({"w/x": 1.0}, 5)]
    with pytest.raises(TypeError, match="mapping"):
        handle.submit_metrics(None)
    channel.close()


def test_remote_handle_sends_datagrams_to_the_owner():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    handle = socket_handle(channel)
    assert handle.transport == "socket"
    assert repr(handle) == f"MetricsHandle(transport='socket', address={handle.address!r})"
    handle.submit_metrics({"x": 1.0, "r": ListPartial("r", [1.0, 2.0])}, step=3, namespace="w")
    assert channel.health()["submitted"] == 0  # still in the socket
    assert channel.step() == 1
    assert logger.calls == [({"w/x": 1.0, "w/r_count": 2.0, "w/r_sum": 3.0}, 3)]
    with pytest.raises(TypeError, match="str namespace"):
        handle.submit_metrics({"x": 1.0}, namespace=None)
    channel.close()


@pytest.mark.timeout(30)
def test_remote_payloads_are_coalesced_not_lost_when_the_socket_queue_is_full():
    logger = RecordingLogger()
    channel = sync_channel(logger)  # nobody reads the socket until step()
    handle = socket_handle(channel)
    sent = {f"ns{i}": [] for i in range(4)}
    for i in range(2000):  # more than any net.unix.max_dgram_qlen
        namespace = f"ns{i % 4}"
        sent[namespace].append(float(i))
        handle.submit_metrics(
            {"r": ListPartial("r", [float(i)]), "last": float(i)}, step=i, namespace=namespace
        )
    assert handle.coalesced > 0 and handle.dropped == 0
    for _ in range(1000):
        channel.step()
        if handle.flush(timeout=0):
            break
    channel.step()
    for namespace, values in sent.items():
        assert sum(v for _, v in logger.series(f"{namespace}/r_count")) == len(values)
        assert sum(v for _, v in logger.series(f"{namespace}/r_sum")) == sum(values)
        assert logger.series(f"{namespace}/last")[-1] == (
            len(values) * 4 - 4 + int(namespace[2:]),
            values[-1],
        )
    health = channel.health()
    # merged in the handle's queue or the owner's, every submission counted once
    assert health["submitted"] == 2000 and health["dropped"] == 0
    assert health["coalesced"] >= handle.coalesced
    assert_balanced(health)
    channel.close()


def test_closing_removes_the_socket_and_remote_senders_drop_and_count():
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = socket_handle(channel)
    path = handle.address
    assert os.path.exists(path)
    assert channel.close(timeout=10)
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    handle.submit_metrics({"x": 1.0})  # never raises
    assert handle.dropped == 1


def test_unreadable_datagrams_are_counted_and_ignored():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    path = socket_handle(channel).address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"not a pickle", path)
        sock.sendto(pickle.dumps(("ns", {1: 2.0}, None, None, (0, 0))), path)
    channel.submit_metrics({"x": 1.0})
    channel.step()
    assert logger.calls == [({"x": 1.0}, None)]
    health = channel.health()
    assert health["dropped"] == 2
    assert_balanced(health)
    channel.close()


def _latest_window(size: int):
    """A real window of the last ``size`` episodes (what ``episode_window=size`` sends)."""
    from rl_observers.stats import LatestWindow

    entries = [((i * 7, 1, i % 4), (float(i) * 0.37, float(i % 50))) for i in range(size)]
    return LatestWindow(
        size, ("episode_return", "episode_length"), stats=[("mean",), ("mean",)], entries=entries
    )


def test_payloads_larger_than_64_kib_cross_the_socket():
    logger = RecordingLogger()
    channel = sync_channel(logger)
    handle = socket_handle(channel)
    window = _latest_window(3000)
    assert len(pickle.dumps(window, protocol=pickle.HIGHEST_PROTOCOL)) > 1 << 16
    handle.submit_metrics({"w": window}, step=1, namespace="collector")
    channel.step()
    assert handle.dropped == 0
    assert logger.calls == [({f"collector/{k}": v for k, v in window.finalize().items()}, 1)]
    assert channel.close()


def test_a_payload_too_large_for_a_datagram_is_counted_at_the_owner_at_once(warnings_seen):
    from rl_observers.remote.socket import SocketWire

    logger = RecordingLogger()
    channel = sync_channel(logger)
    handle = socket_handle(channel)
    too_large = {f"k{i}": float(i) for i in range(SocketWire.max_payload() // 10)}
    for step in range(3):  # every payload too large: no later datagram carries the count
        handle.submit_metrics(too_large, step=step, namespace="w")
    assert handle.dropped == 3
    channel.step()
    health = channel.health()
    assert health["dropped"] == health["submitted"] == 3
    assert logger.calls == []
    (message,) = [m for m in warnings_seen if "MetricsHandle" in m]
    assert "bytes pickled" in message and "health()['dropped']" in message
    assert channel.close() is False  # payloads were lost: close() does not say all went well


def test_unpicklable_payloads_are_dropped_by_the_sender_and_counted_at_the_owner(warnings_seen):
    channel = sync_channel(RecordingLogger())
    handle = socket_handle(channel)
    unpicklable = ListPartial("x", [1.0])
    unpicklable.lock = threading.Lock()  # a partial that cannot travel
    handle.submit_metrics({"x": unpicklable})
    assert handle.dropped == 1
    assert len(warnings_seen) == 1 and "pickle" in warnings_seen[0]
    channel.step()
    assert channel.health()["dropped"] == 1  # reported at once, alone
    channel.close()


_CHILD_SENDS_TOO_LARGE = """
import pickle
from rl_observers.remote.socket import SocketWire
handle = pickle.loads(handle)
payload = {f"k{i}": float(i) for i in range(SocketWire.max_payload() // 10)}
for i in range(4):
    handle.submit_metrics(payload, step=i, namespace="big")
assert handle.transport == "socket" and handle.dropped == 4
assert handle.flush(timeout=10)
"""


@pytest.mark.timeout(60)
def test_a_worker_whose_every_payload_is_too_large_is_seen_at_the_owner():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    ctx = mp.get_context("fork")
    child = ctx.Process(
        target=exec, args=(_CHILD_SENDS_TOO_LARGE, {"handle": pickle.dumps(channel.handle())})
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert channel.flush(timeout=10) is False
    assert channel.health()["dropped"] == 4
    assert channel.close(timeout=10)  # nothing more was lost since the flush


_CHILD_FLOODS = """
import pickle
from rl_observers.stats import Count
handle = pickle.loads(handle)
for i in range(3000):  # "hot" always waits in a full queue (merged); the others find none (the oldest goes)
    handle.submit_metrics({"n": Count("n", 1)}, step=i, namespace="hot" if i % 2 else f"ns{i % 200}")
assert handle.transport == "socket" and handle.dropped > 0 and handle.coalesced > 0
submitted.set()
assert handle.flush(timeout=30)  # the owner steps meanwhile: the last counts reach it
"""


@pytest.mark.timeout(60)
def test_a_worker_flooding_small_queues_balances_at_the_owner_every_loss_counted_once():
    """Merged or dropped in the worker's queue or the owner's, each submission counts once at the owner."""
    logger = RecordingLogger()
    channel = sync_channel(logger, capacity=4)  # the socket is read only at step(): it fills
    ctx = mp.get_context("fork")
    submitted = ctx.Event()
    child = ctx.Process(
        target=exec,
        args=(_CHILD_FLOODS, {"handle": pickle.dumps(channel.handle()), "submitted": submitted}),
    )
    child.start()
    assert submitted.wait(30)  # the worker's queue overflowed: it merged and dropped
    while child.is_alive():  # a burst larger than the owner's queue at each step: it merges and drops too
        channel.step()
    assert child.exitcode == 0
    assert channel.flush(timeout=10) is False  # payloads were lost, and it says so
    health = channel.health()
    assert_balanced(health)
    assert health["submitted"] == 3000 and health["pending"] == health["sink_errors"] == 0
    assert health["dropped"] > 0
    # what was logged is exactly what was neither dropped nor still counted elsewhere
    logged = sum(v for m, _ in logger.user_calls() for k, v in m.items() if k.endswith("/n"))
    assert logged == 3000 - health["dropped"] == health["logged"] + health["coalesced"]
    assert channel.close(timeout=10)


class _TwoCountReceiver:
    """A transport's receiver written before messages carried ``held``: it tells two counts."""

    def start(self, accept, refuse, background):  # noqa: ANN001, ANN201
        self.accept = accept

    def address(self):  # noqa: ANN201
        return "two-counts"

    def poll(self, deadline):  # noqa: ANN001, ANN201
        pass

    def close(self, deadline):  # noqa: ANN001, ANN201
        pass

    def release(self):  # noqa: ANN201
        pass


def test_a_transport_telling_two_counts_still_balances_at_the_owner(monkeypatch):
    """``accept(payload, (dropped, coalesced))`` from a registered transport: its payload holds one."""
    from rl_observers.remote import transport
    from rl_observers.stats import Count

    monkeypatch.setattr(transport, "_TRANSPORTS", dict(transport._TRANSPORTS))  # registered for this test only
    receiver = _TwoCountReceiver()
    transport.register_transport("two-counts", lambda address: None, lambda token, name: receiver, lambda a: False)
    logger = RecordingLogger()
    channel = sync_channel(logger)
    channel.handle()  # starts the receivers
    from rl_observers.channel.payload import Payload

    receiver.accept(Payload("a", {"n": Count("n", 1)}), (2, 3))
    channel.step()
    assert channel.flush(timeout=10) is False  # two were dropped on the way
    health = channel.health()
    assert (health["submitted"], health["logged"], health["dropped"], health["coalesced"]) == (6, 1, 2, 3)
    assert_balanced(health)
    assert [m for m, _ in logger.user_calls()] == [{"a/n": 1.0}]
    channel.close(timeout=10)


_CHILD_SUBMITS = """
for i in range(5):
    handle.submit_metrics({"x": float(i)}, step=i, namespace=namespace)
assert handle.flush(timeout=10)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_handle_submits_from_a_spawned_process():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    ctx = mp.get_context("spawn")
    # exec is picklable by reference, so the child needs no test module
    child = ctx.Process(
        target=exec,
        args=(
            _CHILD_SUBMITS,
            {"handle": channel.handle(), "namespace": "spawned"},
        ),
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert channel.flush(timeout=10)
    assert logger.series("spawned/x") == [(i, float(i)) for i in range(5)]
    assert channel.close(timeout=10)


_INHERITED_AFTER_CLOSE = """
child_ready.set()  # the channel's stand-in here was made while the owner's socket existed
owner_closed.wait()
for i in range(5):
    handle.submit_metrics({"x": 1.0}, namespace="w")
assert handle.transport == "socket", handle.transport
assert handle.dropped == 5 and channel.health()["dropped"] == 5, handle.dropped
assert handle.flush(timeout=1)  # nothing is left in it: the drops are counted
assert channel.flush(timeout=1) is False  # but the channel says payloads were lost
"""


@pytest.mark.timeout(60)
def test_a_handle_inherited_by_a_forked_child_reports_its_transport_and_drops():
    channel = MetricsChannel(RecordingLogger(), health_interval=None)
    handle = channel.handle()
    ctx = mp.get_context("fork")
    child_ready, owner_closed = ctx.Event(), ctx.Event()
    child = ctx.Process(
        target=exec,
        args=(
            _INHERITED_AFTER_CLOSE,
            {
                "handle": handle,
                "channel": channel,
                "child_ready": child_ready,
                "owner_closed": owner_closed,
            },
        ),
    )
    child.start()
    assert child_ready.wait(30)
    assert channel.close(timeout=10)  # the child's payloads now have nowhere to go
    owner_closed.set()
    child.join(30)
    assert child.exitcode == 0


_FORKED_CHILD = """
import pickle
for i in range(3):
    inherited.submit_metrics({"x": float(i)}, step=i, namespace="inherited")
    pickle.loads(pickled).submit_metrics({"x": float(i)}, step=i, namespace="pickled")
    channel.submit_metrics({"x": float(i)}, step=i, namespace="channel_in_child")
assert inherited.flush(timeout=10) and channel.flush(timeout=10)
assert channel.close(timeout=1)  # closes the child's stand-in only
"""


@pytest.mark.timeout(60)
def test_handles_and_the_channel_itself_submit_from_a_forked_process():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    handle = channel.handle()
    path = channel.handle(transport="socket").address
    ctx = mp.get_context("fork")
    child = ctx.Process(
        target=exec,
        args=(
            _FORKED_CHILD,
            {"inherited": handle, "pickled": pickle.dumps(handle), "channel": channel},
        ),
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.path.exists(path)  # the child did not remove the owner's socket
    assert channel.flush(timeout=10)
    for namespace in ("inherited", "pickled", "channel_in_child"):
        assert logger.series(f"{namespace}/x") == [(i, float(i)) for i in range(3)], namespace
    channel.submit_metrics({"y": 1.0})  # the owner keeps working
    assert channel.flush(timeout=10)
    assert channel.close(timeout=10)


_KILLED_CHILD = """
import os, signal
for i in range(3):
    handle.submit_metrics({"x": float(i)}, step=i, namespace="doomed")
handle.flush(timeout=10)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_a_sender_that_dies_does_not_hurt_the_owner():
    logger = RecordingLogger()
    channel = MetricsChannel(logger, health_interval=None)
    handle = channel.handle()
    child = mp.get_context("fork").Process(target=exec, args=(_KILLED_CHILD, {"handle": handle}))
    child.start()
    child.join(30)
    assert child.exitcode == -9
    handle.submit_metrics({"y": 1.0}, namespace="alive")
    channel.submit_metrics({"y": 2.0}, namespace="alive")
    assert channel.flush(timeout=10)
    assert logger.series("doomed/x") == [(i, float(i)) for i in range(3)]
    assert logger.series("alive/y") == [(None, 1.0), (None, 2.0)]
    assert channel.close(timeout=10)


def test_a_forked_child_starts_with_an_empty_outbox_and_never_resends_the_parents():
    logger = RecordingLogger()
    channel = sync_channel(logger)  # nobody reads the socket until step(): the outbox fills
    handle = socket_handle(channel)
    for i in range(2000):
        handle.submit_metrics({"r": ListPartial("r", [1.0])}, step=i, namespace=f"ns{i % 4}")
    assert not handle.flush(timeout=0)  # the parent's outbox holds payloads
    pid = os.fork()
    if pid == 0:  # the child: nothing of its parent's to send, nothing lost
        os._exit(0 if handle.flush(timeout=0) and handle.dropped == 0 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    for _ in range(1000):
        channel.step()
        if handle.flush(timeout=0):
            break
    channel.step()
    for namespace in ("ns0", "ns1", "ns2", "ns3"):  # each payload once: the child sent none
        assert sum(v for _, v in logger.series(f"{namespace}/r_count")) == 500
    assert_balanced(channel.health())
    channel.close()



def test_an_unusable_temporary_directory_leaves_the_channel_without_a_socket(monkeypatch, tmp_path, warnings_seen):
    import tempfile

    from rl_observers.remote.socket import SocketReceiver

    # a temporary directory under a file: no socket can be made, and that is a warning, not an error
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "tmp"))
    assert SocketReceiver.create("token", "run") is None
    assert any("could not bind its socket" in m for m in warnings_seen)
    logger = RecordingLogger()
    channel = sync_channel(logger)
    channel.handle()  # starts the receivers: the socket's is left out
    channel.submit_metrics({"a": 1.0}, step=0, namespace="w")
    assert channel.close() is True
    assert logger.calls == [({"w/a": 1.0}, 0)]
