"""Metrics over Ray: a transport that reaches the channel's owner from any node.

A Unix socket only exists on the owner's machine; a Ray actor on another
node reaches the owner through Ray instead:

```
 worker/actor process ── RaySender.send ── (local buffer, returns at once)
        │   its thread: fire-and-forget ``push.remote(batch)``, bounded in flight
        ▼
 relay actor of that node (``rl_observers-relay-<token>-<node_id>``, pinned there)
        │   merges contributions per (namespace, worker) for one interval,
        │   then one ``push.remote(batch)`` per interval
        ▼
 ingest actor (``rl_observers-ingest-<token>``, pinned to the owner's node, bounded)
        │   the owner's thread drains it (``ray.get`` on the owner's side only)
        ▼
 RayReceiver → accept(namespace, metrics, step, meta, (remote_dropped, remote_coalesced))
```

A message is ``(namespace, metrics, step, meta, (dropped, coalesced))``: the
drops and coalescing not yet reported travel with the next message, so the
owner shows losses that happened elsewhere once anything gets through.

Nothing on a worker's path waits for Ray: :meth:`RaySender.send` appends to a
bounded local buffer (coalescing per namespace beyond it, then dropping and
counting). A daemon thread of the sender's process makes the ``.remote()``
calls and checks finished ones with ``ray.wait(..., timeout=0)``. A relay or
ingest actor that dies costs the messages it held (counted as dropped); the
next batch finds (or creates) a new one by name.

What the relay merges: consecutive windows of one worker of one observer
(``meta["aggregate"]`` and ``meta["worker"]`` equal, the rest of ``meta`` but
``counters`` equal, no ``finish``) merge like the owner's aggregate merges
them: partials exactly, gauges and counters newest. Everything else (plain
payloads, closing windows, windows of other workers) is forwarded as it came.
The totals the owner logs are exactly those of the separate contributions;
a row boundary can move by at most one relay interval, as if the worker had
contributed a little less often.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from rl_observers.channel.payload import coalesce
from rl_observers.channel.transport import register_transport

# torchrl's logger (the same object as torchrl._utils.logger)
torchrl_logger = logging.getLogger("torchrl")

__all__ = [
    "NAME",
    "PRIORITY",
    "RayAddress",
    "RayReceiver",
    "RaySender",
    "make_receiver",
    "make_sender",
    "reachable",
]

NAME = "ray"
#: Selection order among transports: lower first (the socket comes before Ray).
PRIORITY = 20

#: Messages a sender buffers before it coalesces per namespace.
SENDER_CAPACITY = 1024
#: Batches a sender has in flight to its relay (or the ingest) at most.
SENDER_IN_FLIGHT = 4
#: Seconds between two rounds of a sender's thread.
SENDER_INTERVAL = 0.02
#: Seconds between two batches a relay forwards to the owner.
RELAY_INTERVAL = 0.25
#: Messages a relay holds before it coalesces per key, then drops.
RELAY_CAPACITY = 65536
#: Batches a relay has in flight to the ingest at most.
RELAY_IN_FLIGHT = 4
#: Seconds between two checks of a relay that its owner's ingest still exists.
RELAY_CHECK_EVERY = 10.0
#: Seconds without the owner's ingest after which a relay exits (its owner died unclosed).
RELAY_ORPHAN_AFTER = 60.0
#: The Ray namespace of the ingest and relay actors (their names hold the channel's token).
ACTOR_NAMESPACE = "rl_observers"
#: Messages the ingest actor holds before it drops.
INGEST_CAPACITY = 1 << 18
#: Messages the owner takes from the ingest per call.
DRAIN_BATCH = 16384
#: Seconds a drain call waits for messages in the ingest.
DRAIN_WAIT = 0.1
#: Seconds between two attempts to find the owner's ingest after a failure.
RETRY_AFTER = 1.0

Message = tuple  # (namespace, metrics, step, meta, (dropped, coalesced))


class RayAddress(NamedTuple):
    """What a sender needs to reach an owner through Ray (plain, picklable data)."""

    token: str
    ingest: str  # the ingest actor's name
    namespace: str  # the Ray namespace it lives in
    owner: str  # who the owner is, in words (for warnings)


def _ray() -> Any:
    """Ray if this process imported it (a Ray worker always has), else ``None``."""
    return sys.modules.get("ray")


def reachable(address: Any) -> bool:
    """Whether this process can send to ``address`` through Ray: it is connected to Ray.

    Never imports Ray: a process that did not import it is no Ray worker.
    """
    ray = _ray()
    return _is_address(address) and ray is not None and ray.is_initialized()


def _is_address(address: Any) -> bool:
    return (
        isinstance(address, tuple)
        and len(address) == 4
        and all(isinstance(a, str) for a in address)
    )


_SENDERS: dict[tuple[int, tuple], RaySender] = {}
_SENDERS_LOCK = threading.Lock()


def make_sender(address: Any) -> RaySender | None:
    """The sender of this process to ``address`` (one per process and address), or ``None``.

    ``None`` where Ray cannot reach it (this process is not connected to Ray).
    """
    if not reachable(address):
        return None
    key = (os.getpid(), tuple(address))
    sender = _SENDERS.get(key)
    if sender is None:
        with _SENDERS_LOCK:
            sender = _SENDERS.get(key)
            if sender is None:
                sender = _SENDERS[key] = RaySender(address)
    return sender


def make_receiver(token: str, name: str = "") -> RayReceiver | None:
    """The owner's side for the channel ``token``; ``None`` where this process is not connected to Ray.

    Never imports nor initializes Ray: a channel whose owner never uses Ray
    starts no actor.
    """
    ray = _ray()
    if ray is None or not ray.is_initialized():
        return None
    return RayReceiver(token, name=name)


def _relay_name(token: str, node: str) -> str:
    return f"rl_observers-relay-{token}-{node}"


def premerge(messages: list[Message]) -> list[Message]:
    """Merges consecutive windows of one worker (see the module's docstring).

    "Consecutive" is per worker: windows of other workers may come in between
    (their relative order was never defined: they come from other processes).
    A closing window (``finish``) or a window with other settings ends the run
    of windows that merge. The order of everything else is kept.
    """
    out: list[list] = []
    # (namespace, observer, worker) -> (meta without counters, index in out)
    open_runs: dict[tuple, tuple[dict, int]] = {}
    for namespace, metrics, step, meta, counts in messages:
        if meta and "aggregate" in meta:
            key = (namespace, meta["aggregate"], _hashable(meta.get("worker")))
            settings = {k: v for k, v in meta.items() if k != "counters"}
            run = open_runs.get(key)
            if not meta.get("finish"):
                if run is not None and run[0] == settings:
                    into = out[run[1]]
                    coalesce(into[1], metrics)
                    into[2] = step
                    into[3] = meta  # the newest counters
                    into[4] = (into[4][0] + counts[0], into[4][1] + counts[1])
                    continue
                open_runs[key] = (settings, len(out))
            elif run is not None:
                del open_runs[key]
        out.append([namespace, dict(metrics), step, meta, counts])
    return [tuple(m) for m in out]


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


# ------------------------------------------------------------------------------- actors
class _Ingest:
    """The owner's mailbox: bounded, drained by the owner's thread (runs as a threaded actor).

    It holds batches as the pickled bytes they came as: it never looks into a
    payload, so it never imports the classes of partials (nor torch).
    """

    def __init__(self, capacity: int = INGEST_CAPACITY) -> None:
        self._batches: deque[tuple[bytes, int]] = deque()
        self._held = 0  # messages in _batches
        self._capacity = capacity
        self._dropped = 0  # messages dropped here, plus what dropped messages carried
        self._coalesced = 0
        self._received = 0
        self._calls = 0
        self._ready = threading.Condition()

    def push(self, data: bytes, messages: int, dropped: int, coalesced: int) -> bool:
        """Keeps one pickled batch of ``messages`` (carrying these counts), or drops it whole."""
        with self._ready:
            self._calls += 1
            if self._held + messages > self._capacity:
                self._dropped += messages + dropped
                self._coalesced += coalesced
                return False
            self._batches.append((data, messages))
            self._held += messages
            self._received += messages
            self._ready.notify_all()
        return True

    def drain(self, limit: int = DRAIN_BATCH, wait: float = DRAIN_WAIT) -> tuple[list, int, int]:
        """Pickled batches of up to ``limit`` messages (at least one batch), and the drops here."""
        with self._ready:
            if not self._batches and wait > 0:
                self._ready.wait(wait)
            batches = self._batches
            out: list[bytes] = []
            taken = 0
            while batches and (not out or taken + batches[0][1] <= limit):
                data, count = batches.popleft()
                out.append(data)
                taken += count
            self._held -= taken
            dropped, coalesced = self._dropped, self._coalesced
            self._dropped = self._coalesced = 0
        return out, dropped, coalesced

    def stats(self) -> dict[str, int]:
        with self._ready:
            return {
                "calls": self._calls,
                "received": self._received,
                "pending": self._held,
            }


class _Forwarder:
    """Bounded fire-and-forget ``push.remote`` calls to one target actor, found by ``resolve``.

    Used by senders (to their relay or the ingest) and by relays (to the ingest);
    runs on its owner's thread only. Each call's messages and the counts they
    carry are remembered until it completes: a failed call adds them to the drops.
    """

    def __init__(self, resolve: Callable[[], Any], in_flight: int) -> None:
        self._resolve = resolve
        self._limit = in_flight
        self._target: Any = None
        self._failed_at = -float("inf")
        self._calls: dict[Any, tuple[int, int, int]] = {}  # ref -> (messages, dropped, coalesced)
        self.lost: tuple[int, int] = (0, 0)  # to add to the next batch's counts
        self.dropped = 0
        self.error: BaseException | None = None
        self.sent_calls = 0
        # (relay round that forwards them, messages): what a relay holds for us
        self._unconfirmed: deque[tuple[int, int]] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def reap(self) -> None:
        """Accounts for the calls that finished (never waits)."""
        if not self._calls:
            return
        ray = _ray()
        refs = list(self._calls)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            messages, dropped, coalesced = self._calls.pop(ref)
            try:
                result = ray.get(ref, timeout=0)
            except Exception as err:  # the target died: what it held is lost
                self._fail(err)
                self._lose(messages + self._forget_unconfirmed(), dropped, coalesced)
                continue
            if result.__class__ is int:  # a relay: its forwarding rounds confirm what it held
                self._confirm(result)
                self._unconfirmed.append((result + 1, messages))

    def _confirm(self, rounds: int) -> None:
        """Forgets the messages a relay forwarded (it finished ``rounds`` rounds)."""
        unconfirmed = self._unconfirmed
        while unconfirmed and unconfirmed[0][0] <= rounds:
            unconfirmed.popleft()

    def _forget_unconfirmed(self) -> int:
        """Messages a relay that died had not forwarded yet (lost with it)."""
        lost = sum(m for _, m in self._unconfirmed)
        self._unconfirmed.clear()
        return lost

    def confirmed_all(self) -> None:
        """The relay forwarded everything (its flush returned)."""
        self._unconfirmed.clear()

    def _lose(self, messages: int, dropped: int, coalesced: int) -> None:
        self.dropped += messages
        d, c = self.lost
        self.lost = (d + messages + dropped, c + coalesced)

    def _fail(self, err: BaseException) -> None:
        self.error = err
        self._target = None
        self._failed_at = time.monotonic()

    def ready(self) -> bool:
        """Whether a batch may be sent now (a target is known and a slot is free)."""
        if len(self._calls) >= self._limit:
            return False
        if self._target is None:
            if time.monotonic() - self._failed_at < RETRY_AFTER:
                return False
            try:
                self._target = self._resolve()
            except Exception as err:
                self._fail(err)
                return False
            self.error = None
        return True

    def send(self, batch: list[Message]) -> bool:
        """Sends ``batch`` (its first message carries ``lost``); ``False`` when it could not."""
        if self.lost != (0, 0):
            first = batch[0]
            d, c = self.lost
            batch[0] = (*first[:4], (first[4][0] + d, first[4][1] + c))
            self.lost = (0, 0)
        dropped = sum(m[4][0] for m in batch)
        coalesced = sum(m[4][1] for m in batch)
        try:
            data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            ref = self._target.push.remote(data, len(batch), dropped, coalesced)
        except Exception as err:
            self._fail(err)
            self._lose(len(batch) + self._forget_unconfirmed(), dropped, coalesced)
            return False
        self._calls[ref] = (len(batch), dropped, coalesced)
        self.sent_calls += 1
        return True

    def wait(self, deadline: float | None) -> bool:
        """Waits for the calls in flight (flush/close only); whether none is left."""
        ray = _ray()
        while self._calls:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            refs = list(self._calls)
            ray.wait(refs, num_returns=len(refs), timeout=left)
            self.reap()
        return True


def _pinned(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


_ACTOR_CLASSES: dict[str, Any] = {}


def _actor_class(cls: type, **options: Any) -> Any:
    remote = _ACTOR_CLASSES.get(cls.__name__)
    if remote is None:
        remote = _ACTOR_CLASSES[cls.__name__] = _ray().remote(**options)(cls)
    return remote


class _Relay:
    """Merges what the senders of one node send, and forwards one batch per interval."""

    def __init__(
        self,
        address: RayAddress,
        interval: float = RELAY_INTERVAL,
        capacity: int = RELAY_CAPACITY,
        merge: bool = True,
    ) -> None:
        self._address = address
        self._interval = interval
        self._capacity = capacity
        self._merge = merge
        self._lock = threading.Lock()
        self._messages: list[Message] = []
        self._dropped = 0  # what this relay dropped (plus what dropped messages carried)
        self._coalesced = 0
        self.received = 0
        self.forwarded = 0
        self.rounds = 0  # forwarding rounds done: what was pushed before round n is forwarded after it
        self._forwarder = _Forwarder(self._find_ingest, RELAY_IN_FLIGHT)
        self._wake = threading.Event()
        self._flushes: list[threading.Event] = []
        threading.Thread(target=self._run, name="rl_observers-relay", daemon=True).start()

    def _find_ingest(self) -> Any:
        return _ray().get_actor(self._address.ingest, namespace=self._address.namespace)

    def push(self, data: bytes, messages: int, dropped: int, coalesced: int) -> int:
        """Holds a batch until the next round; returns the rounds done (what came before is forwarded)."""
        batch = pickle.loads(data)
        with self._lock:
            self.received += len(batch)
            room = self._capacity - len(self._messages)
            if len(batch) > room:  # full: keep what fits, the rest merges or is dropped
                for message in batch[max(room, 0) :]:
                    self._dropped += 1 + message[4][0]
                    self._coalesced += message[4][1]
                batch = batch[: max(room, 0)]
            self._messages.extend(batch)
            return self.rounds

    def flush(self, timeout: float = 5.0) -> bool:
        """Forwards what is held now and waits until the ingest has it."""
        done = threading.Event()
        with self._lock:
            self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "received": self.received,
                "forwarded": self.forwarded,
                "calls": self._forwarder.sent_calls,
                "dropped": self._dropped + self._forwarder.dropped,
                "pending": len(self._messages),
            }

    def _orphaned(self) -> bool:
        """Whether the owner's ingest has been gone for ``RELAY_ORPHAN_AFTER`` seconds."""
        now = time.monotonic()
        if now - self._checked < RELAY_CHECK_EVERY:
            return False
        self._checked = now
        try:
            self._find_ingest()
        except Exception:
            return now - self._ingest_seen > RELAY_ORPHAN_AFTER
        self._ingest_seen = now
        return False

    def _run(self) -> None:
        forwarder = self._forwarder
        self._checked = self._ingest_seen = time.monotonic()
        while True:
            if self._orphaned():  # the owner died without closing: nobody will kill this relay
                os._exit(0)
            self._wake.wait(self._interval)
            self._wake.clear()
            with self._lock:
                flushes, self._flushes = self._flushes, []
            forwarder.reap()
            self._forward()
            if flushes:
                forwarder.wait(time.monotonic() + 5.0)
                self._forward()
                forwarder.wait(time.monotonic() + 5.0)
                for done in flushes:
                    done.set()

    def _forward(self) -> None:
        forwarder = self._forwarder
        if not self._messages:
            with self._lock:
                if not self._messages:
                    self.rounds += 1
                    return
        if not forwarder.ready():
            return
        with self._lock:
            messages, self._messages = self._messages, []
            counts = (self._dropped, self._coalesced)
            self._dropped = self._coalesced = 0
            self.rounds += 1
        batch = premerge(messages) if self._merge else messages
        if not batch:  # only losses to report: they wait for the next message
            with self._lock:
                self._dropped += counts[0]
                self._coalesced += counts[1]
            return
        first = batch[0]
        batch[0] = (*first[:4], (first[4][0] + counts[0], first[4][1] + counts[1]))
        if forwarder.send(batch):
            with self._lock:
                self.forwarded += len(batch)


# ------------------------------------------------------------------------------- sender
class RaySender:
    """Sends payloads to the owner at ``address`` through Ray; never blocks, never raises.

    Args:
        address (RayAddress): the owner's :meth:`RayReceiver.address`.

    Keyword Args:
        capacity (int, optional): messages buffered here before they coalesce
            per namespace (then drop). Defaults to ``SENDER_CAPACITY``.
        in_flight (int, optional): batches in flight at most. Defaults to
            ``SENDER_IN_FLIGHT``.
        relay (bool, optional): send through this node's relay actor
            (per-node pre-merge); ``False`` sends straight to the ingest.
            Defaults to ``True``.
        node (str, optional): the key of this node's relay. Defaults to this
            node's id (benchmarks simulate nodes with other keys; the relay is
            always pinned to the real node).
        interval (float, optional): seconds between two rounds of the
            sending thread. Defaults to ``SENDER_INTERVAL``.
    """

    name = NAME

    def __init__(
        self,
        address: RayAddress,
        *,
        capacity: int = SENDER_CAPACITY,
        in_flight: int = SENDER_IN_FLIGHT,
        relay: bool = True,
        node: str | None = None,
        interval: float = SENDER_INTERVAL,
        relay_interval: float = RELAY_INTERVAL,
    ) -> None:
        if not _is_address(address):
            raise TypeError(f"RaySender expected a RayAddress, got {address!r}.")
        self.address = RayAddress(*address)
        self.submitted = 0
        self._dropped = 0
        self.coalesced = 0
        self._capacity = capacity
        self._relay = relay
        self._node = node
        self._interval = interval
        self._relay_interval = relay_interval
        self._lock = threading.Lock()
        self._pending: deque[list] = deque()
        self._newest: dict[str, list] = {}
        self._unreported = [0, 0]  # dropped, coalesced
        self._forwarder = _Forwarder(self._find_target, in_flight)
        self._relay_handle: Any = None
        self._warned = False
        self._wake = threading.Event()
        self._thread_pid: int | None = None
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("RaySender is not picklable: pickle its address and make a new one.")

    # -- worker side: never waits ---------------------------------------------------------------
    def send(
        self,
        metrics: dict[str, Any],
        step: int | None,
        namespace: str,
        meta: Mapping[str, Any] | None,
    ) -> None:
        """Buffers one payload for the owner; returns at once."""
        if self._thread_pid != os.getpid():
            self._start_thread()
        error = None
        with self._lock:
            self.submitted += 1
            if len(self._pending) < self._capacity:
                entry = [namespace, metrics, step, meta]
                self._pending.append(entry)
                self._newest[namespace] = entry
            else:
                entry = self._newest.get(namespace)
                if entry is not None:
                    error = coalesce(entry[1], metrics)
                    entry[2] = step
                    if meta is not None:
                        entry[3] = meta
                    self.coalesced += 1
                    self._unreported[1] += 1
                else:
                    self._dropped += 1
                    self._unreported[0] += 1
                    error = "full"
        if error == "full":
            self._warn_once(
                f"dropped a payload of namespace {namespace!r}: its buffer of {self._capacity} "
                f"messages to its owner {self.address.owner} is full (Ray does not keep up)"
            )
        elif error is not None:
            self._warn_once(f"could not merge a partial of namespace {namespace!r}: {error!r}")

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until what was sent before reached the owner's ingest (or ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._thread_pid != os.getpid():
            self._start_thread()
        done = threading.Event()
        self._flush_request = (done, deadline)
        self._wake.set()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return done.wait(left) and self._flushed

    def close(self, timeout: float | None = None) -> bool:
        """Flushes, then stops the sending thread."""
        flushed = self.flush(timeout)
        self._closed = True
        self._wake.set()
        return flushed

    # -- the sending thread -----------------------------------------------------------------------
    def _start_thread(self) -> None:
        with self._lock:
            if self._thread_pid == os.getpid():
                return
            self._thread_pid = os.getpid()
            self._flush_request: tuple[threading.Event, float | None] | None = None
            self._flushed = False
            threading.Thread(target=self._run, name="rl_observers-ray-sender", daemon=True).start()

    def _run(self) -> None:
        forwarder = self._forwarder
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            request, self._flush_request = self._flush_request, None
            try:
                forwarder.reap()
                self._send_pending()
                if request is not None:
                    self._flushed = self._flush(request[1])
                    request[0].set()
            except Exception as err:  # never expected: keep sending, say it once
                self._warn_once(f"failed to send through Ray: {err!r}")
                if request is not None:
                    self._flushed = False
                    request[0].set()
            if forwarder.error is not None:
                self._warn_once(
                    f"cannot reach its owner {self.address.owner} through Ray "
                    f"({forwarder.error!r}); what it cannot send is dropped and counted"
                )

    def _take(self) -> list[Message]:
        with self._lock:
            if not self._pending:
                return []
            pending, self._pending = self._pending, deque()
            self._newest = {}
            d, c = self._unreported
            self._unreported = [0, 0]
        batch = [(e[0], e[1], e[2], e[3], (0, 0)) for e in pending]
        first = batch[0]
        batch[0] = (*first[:4], (d, c))
        return batch

    def _send_pending(self) -> None:
        forwarder = self._forwarder
        if not self._pending:
            return
        if not forwarder.ready():
            return  # beyond its capacity, the buffer coalesces, then drops
        batch = self._take()
        if batch:
            forwarder.send(batch)  # a failed call is counted by the forwarder

    def _flush(self, deadline: float | None) -> bool:
        forwarder = self._forwarder
        while self._pending:
            if deadline is not None and time.monotonic() > deadline:
                return False
            forwarder.reap()
            if forwarder.ready():
                self._send_pending()
            elif forwarder.in_flight:
                forwarder.wait(time.monotonic() + 0.05)
            else:  # no target now: try again until the deadline
                time.sleep(0.05)
        if not forwarder.wait(deadline):
            return False
        relay = self._relay_handle if self._relay else None
        if relay is None:
            return forwarder.error is None
        ray = _ray()
        left = 5.0 if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            flushed = bool(ray.get(relay.flush.remote(left), timeout=left + 1.0))
        except Exception:
            return False
        if flushed:
            forwarder.confirmed_all()
        return flushed

    def _find_target(self) -> Any:
        ray = _ray()
        address = self.address
        ingest = ray.get_actor(address.ingest, namespace=address.namespace)
        if not self._relay:
            return ingest
        node_id = ray.get_runtime_context().get_node_id()
        relay_class = _actor_class(_Relay, num_cpus=0, max_concurrency=4)
        self._relay_handle = relay_class.options(
            name=_relay_name(address.token, self._node or node_id),
            namespace=address.namespace,
            get_if_exists=True,
            lifetime="detached",  # outlives the worker that made it; the owner kills it
            scheduling_strategy=_pinned(node_id),
        ).remote(address, self._relay_interval)
        return self._relay_handle

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            torchrl_logger.warning(f"MetricsHandle {message}. Further such errors are silent.")

    @property
    def dropped(self) -> int:
        """Payloads dropped here: beyond the buffer, or lost with a call that failed."""
        return self._dropped + self._forwarder.dropped

    @property
    def stats(self) -> dict[str, int]:
        """Batches sent and in flight, and what the transport itself lost."""
        forwarder = self._forwarder
        return {
            "calls": forwarder.sent_calls,
            "in_flight": forwarder.in_flight,
            "lost": forwarder.dropped,
        }


# ------------------------------------------------------------------------------ receiver
class RayReceiver:
    """The owner's side: an ingest actor on the owner's node and a thread that drains it.

    Args:
        token (str): the channel's token (names the actors).

    Keyword Args:
        capacity (int, optional): messages the ingest holds before it drops.
            Defaults to ``INGEST_CAPACITY``.
        owner (str, optional): the owner, in words, for senders' warnings.
            Defaults to the channel's name, this process and host.
        name (str, optional): the channel's name. Defaults to ``""``.
    """

    name = NAME

    def __init__(
        self,
        token: str,
        *,
        capacity: int = INGEST_CAPACITY,
        owner: str | None = None,
        name: str = "",
    ) -> None:
        self.token = token
        self._capacity = capacity
        channel = f"MetricsChannel {name!r} " if name else ""
        self._owner = owner or f"{channel}(pid {os.getpid()} on {os.uname().nodename})"
        self._pid = os.getpid()
        self._actor: Any = None
        self._address: RayAddress | None = None
        self._accept: Callable[..., None] | None = None
        self._refuse: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._lock = threading.Lock()  # one drain at a time (thread, poll or close)
        self.accepted = 0
        self.drains = 0
        self.restarts = 0  # ingest actors that died (what they held is lost, uncounted)
        #: called once per restart (the owning channel counts it in its health)
        self.on_restart: Callable[[], None] | None = None
        self._held = (0, 0)  # counts waiting for the next accepted message
        self.error: BaseException | None = None

    def start(
        self,
        accept: Callable[[str, dict, int | None, Mapping | None, tuple[int, int]], None],
        refuse: Callable[[], None] | None = None,
        background: bool = True,
    ) -> None:
        """Creates the ingest actor (the owner must be connected to Ray) and the draining thread.

        With ``background=False`` messages are accepted only by :meth:`poll`.
        """
        ray = _ray()
        if ray is None or not ray.is_initialized():
            raise RuntimeError(
                "RayReceiver.start expected a process connected to Ray (ray.init())."
            )
        context = ray.get_runtime_context()
        self._address = RayAddress(
            token=self.token,
            ingest=f"rl_observers-ingest-{self.token}",
            namespace=ACTOR_NAMESPACE,
            owner=self._owner,
        )
        self._node = context.get_node_id()
        self._accept = accept
        self._refuse = refuse
        self._actor = self._create_ingest()
        if background:
            self._thread = threading.Thread(
                target=self._run, name="rl_observers-ray-ingest", daemon=True
            )
            self._thread.start()

    def _create_ingest(self) -> Any:
        ingest_class = _actor_class(_Ingest, num_cpus=0, max_concurrency=8)
        address = self._address
        return ingest_class.options(
            name=address.ingest,
            namespace=address.namespace,
            get_if_exists=True,
            scheduling_strategy=_pinned(self._node),
        ).remote(self._capacity)

    def address(self) -> RayAddress:
        if self._address is None:
            raise RuntimeError("RayReceiver.address() is known once start() ran.")
        return self._address

    def _run(self) -> None:
        while not self._stop:
            self.drain(DRAIN_WAIT)

    def poll(self, deadline: float | None) -> None:
        """Accepts what the ingest holds now (flush, step), until ``deadline`` at most."""
        while not self._stop or self._actor is not None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if not self.drain(0.0, timeout=left, lock_timeout=left):
                return

    def drain(
        self, wait: float = 0.0, timeout: float | None = None, lock_timeout: float | None = None
    ) -> int:
        """Takes what the ingest holds and accepts it; returns how many messages."""
        ray = _ray()
        if not self._lock.acquire(timeout=-1 if lock_timeout is None else max(lock_timeout, 0)):
            return 0
        try:
            actor = self._actor
            if actor is None:
                return 0
            try:
                batches, dropped, coalesced = ray.get(
                    actor.drain.remote(DRAIN_BATCH, wait), timeout=timeout
                )
            except Exception as err:  # the ingest died: start a new one, senders find it by name
                self.error = err
                if isinstance(err, ray.exceptions.GetTimeoutError):
                    return 0
                if not self._stop:
                    time.sleep(min(wait, 0.1))
                    self.restarts += 1
                    if self.on_restart is not None:
                        self.on_restart()
                    try:
                        self._actor = self._create_ingest()
                    except Exception as again:
                        self.error = again
                return 0
            self.drains += 1
            messages = [message for data in batches for message in self._load(data)]
            held_d, held_c = self._held
            held_d += dropped
            held_c += coalesced
            accept = self._accept
            for namespace, metrics, step, meta, (d, c) in messages:
                if held_d or held_c:
                    d, c = d + held_d, c + held_c
                    held_d = held_c = 0
                accept(namespace, metrics, step, meta, (d, c))
            self._held = (held_d, held_c)
            self.accepted += len(messages)
            return len(messages)
        finally:
            self._lock.release()

    def _load(self, data: bytes) -> list[Message]:
        """The messages of one batch; an unreadable batch is refused (counted as dropped)."""
        try:
            messages = pickle.loads(data)
            for namespace, metrics, _, meta, (d, c) in messages:
                if (
                    namespace.__class__ is not str
                    or metrics.__class__ is not dict
                    or not (meta is None or isinstance(meta, Mapping))
                    or d.__class__ is not int
                    or c.__class__ is not int
                ):
                    raise TypeError(f"not a message: {namespace!r}")
        except Exception as err:
            self.error = err
            if self._refuse is not None:
                self._refuse()
            else:
                held_d, held_c = self._held
                self._held = (held_d + 1, held_c)
            return []
        return messages

    def relays(self) -> list[Any]:
        """This channel's relay actors, on every node."""
        ray = _ray()
        address = self._address
        if address is None:
            return []
        prefix = _relay_name(self.token, "")
        found = []
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception:
            return []
        for entry in named:
            if entry.get("namespace") == address.namespace and entry.get("name", "").startswith(
                prefix
            ):
                try:
                    found.append(ray.get_actor(entry["name"], namespace=address.namespace))
                except Exception:  # gone meanwhile
                    pass
        return found

    def close(self, deadline: float | None = None) -> None:
        """Forwards what relays hold, accepts what is left, kills the relays and the ingest.

        Everything waits until ``deadline`` (a ``time.monotonic()`` value) at
        most: a dead relay, ingest or node costs what it held, never time.
        """
        if self._address is None or os.getpid() != self._pid:
            return
        ray = _ray()
        relays = self.relays()
        if relays:  # what the relays hold goes to the ingest first
            left = 5.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                refs = [relay.flush.remote(min(left, 5.0)) for relay in relays]
                ray.wait(refs, num_returns=len(refs), timeout=min(left, 5.0))
            except Exception:
                pass
        self._stop = True
        thread = self._thread
        if thread is not None:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        while deadline is None or time.monotonic() < deadline:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.drain(0.0, timeout=left, lock_timeout=left):
                break
        actor, self._actor = self._actor, None
        for victim in [*relays, *([actor] if actor is not None else [])]:
            try:
                ray.kill(victim)
            except Exception:
                pass

    def release(self) -> None:
        """Stops without waiting (the channel was garbage-collected): the actors are killed."""
        if os.getpid() != self._pid:
            return
        self._stop = True
        actor, self._actor = self._actor, None
        ray = _ray()
        if actor is not None and ray is not None and ray.is_initialized():
            try:
                ray.kill(actor)
            except Exception:
                pass

    def forget_after_fork(self) -> None:
        """In a forked child: forgets the parent's actors (never kills them)."""
        self._stop = True
        self._actor = None
        self._address = None


register_transport(
    NAME,
    make_sender=make_sender,
    make_receiver=make_receiver,
    reachable=reachable,
    priority=PRIORITY,
    retry=True,
)
