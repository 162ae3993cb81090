"""The Ray transport's actors: one relay per node and the owner's ingest.

See :mod:`rl_observers.remote.ray.transport` for the flow. Also here: the
bounded fire-and-forget :class:`_Forwarder` that senders and relays push
through, and :func:`premerge`, the relay's exact merge of one worker's
consecutive windows.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from rl_observers.channel.payload import Payload
from rl_observers.remote.window import Window, worker_key

#: The transport's name (``handle.transport``).
NAME = "ray"
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



class Message:
    """One payload on its way through Ray, with the counts it carries.

    ``counts``: ``(dropped, coalesced)`` not yet reported. ``held``:
    ``(payloads, merged)``, which count as dropped if the message is lost.
    """

    __slots__ = ("counts", "held", "payload")

    def __init__(
        self, payload: Payload, counts: tuple[int, int] = (0, 0), held: tuple[int, int] = (1, 0)
    ) -> None:
        self.payload = payload
        self.counts = counts
        self.held = held

    def carrying(self, dropped: int, coalesced: int) -> Message:
        """This message, carrying ``dropped`` and ``coalesced`` more unreported counts."""
        self.counts = (self.counts[0] + dropped, self.counts[1] + coalesced)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return Message, (self.payload, self.counts, self.held)

    def __repr__(self) -> str:
        return f"Message({self.payload!r}, counts={self.counts}, held={self.held})"


class RayAddress(NamedTuple):
    """What a sender needs to reach an owner through Ray (plain, picklable data)."""

    token: str
    ingest: str  # the ingest actor's name
    namespace: str  # the Ray namespace it lives in
    owner: str  # who the owner is, in words (for warnings)


def _ray() -> Any:
    """Ray if this process imported it (a Ray worker always has), else ``None``."""
    return sys.modules.get("ray")


def _is_address(address: Any) -> bool:
    return (
        isinstance(address, tuple)
        and len(address) == 4
        and all(isinstance(a, str) for a in address)
    )


def _relay_name(token: str, node: str) -> str:
    return f"rl_observers-relay-{token}-{node}"


def premerge(messages: list[Message]) -> list[Message]:
    """Merges consecutive windows of one worker that :meth:`~rl_observers.remote.window.Window.joins`.

    Everything else keeps its order; the messages given are not changed.
    """
    out: list[Message] = []
    # (namespace, observer, worker, process) -> index in out of its open run
    open_runs: dict[tuple, int] = {}
    for message in messages:
        payload = message.payload
        if payload.__class__ is Window:
            key = (payload.namespace, payload.observer, worker_key(payload.worker), payload.process)
            at = open_runs.get(key)
            if not payload.final:
                if at is not None and out[at].payload.joins(payload):
                    into = out[at]
                    into.payload.absorb(payload)  # the newest counters, every window counted
                    counts, held = message.counts, message.held
                    into.counts = (into.counts[0] + counts[0], into.counts[1] + counts[1])
                    # not coalesced (nothing overflowed), but lost together from now on
                    into.held = (into.held[0] + held[0], into.held[1] + held[1])
                    continue
                open_runs[key] = len(out)
            elif at is not None:
                del open_runs[key]
            payload = copy.copy(payload)  # merging into it must not change the message given
            payload.metrics = dict(payload.metrics)
        out.append(Message(payload, message.counts, message.held))
    return out



def _cost(batch: list[Message]) -> tuple[int, int, int, int]:
    """What losing ``batch`` costs: ``(payloads, merged, dropped, coalesced)``.

    A loss adds ``payloads + dropped`` to the drops and ``coalesced - merged``
    to the coalesced payloads.
    """
    payloads = merged = dropped = coalesced = 0
    for message in batch:
        counts, held = message.counts, message.held
        dropped += counts[0]
        coalesced += counts[1]
        payloads += held[0]
        merged += held[1]
    return payloads, merged, dropped, coalesced


# ------------------------------------------------------------------------------- actors
class _Ingest:
    """The owner's mailbox: bounded, drained by the owner's thread; holds pickled bytes (never imports torch)."""

    def __init__(self, capacity: int = INGEST_CAPACITY) -> None:
        self._batches: deque[tuple[bytes, int]] = deque()
        self._held = 0  # messages in _batches
        self._capacity = capacity
        self._dropped = 0  # payloads dropped here, plus what dropped batches carried
        self._coalesced = 0
        self._received = 0
        self._calls = 0
        self._ready = threading.Condition()

    def push(self, data: bytes, messages: int, dropped: int, coalesced: int) -> bool:
        """Keeps one pickled batch of ``messages``, or drops it whole.

        Args:
            data (bytes): the pickled batch.
            messages (int): how many messages it holds (the room it takes).
            dropped (int): what dropping it adds to the drops: the payloads it
                holds and the drops it carries.
            coalesced (int): what dropping it adds to the coalesced payloads:
                the count it carries less the payloads merged into its messages.

        Returns:
            bool: whether it was kept.
        """
        with self._ready:
            self._calls += 1
            if self._held + messages > self._capacity:
                self._dropped += dropped
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

    Runs on its owner's thread only; a failed call adds its :func:`_cost` to the drops.
    """

    def __init__(self, resolve: Callable[[], Any], in_flight: int) -> None:
        self._resolve = resolve
        self._limit = in_flight
        self._target: Any = None
        self._failed_at = -float("inf")
        self._calls: dict[Any, tuple[int, int, int, int]] = {}  # ref -> its batch's cost
        self.lost: tuple[int, int] = (0, 0)  # to add to the next batch's counts
        self.dropped = 0  # payloads lost with calls that failed
        self.merged_lost = 0  # of those, payloads counted as coalesced where they merged
        self.error: BaseException | None = None
        self.sent_calls = 0
        # (relay round that forwards them, their cost): what a relay holds for us
        self._unconfirmed: deque[tuple[int, tuple[int, int, int, int]]] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def _ray_down(self) -> bool:
        """Whether Ray was shut down in this process (then no call is made: it would start a new Ray)."""
        ray = _ray()
        if ray is not None and ray.is_initialized():
            return False
        for cost in self._calls.values():
            self._lose(cost)
        self._calls.clear()
        self._fail(RuntimeError("Ray was shut down in this process"))
        return True

    def reap(self) -> None:
        """Accounts for the calls that finished (never waits)."""
        if not self._calls or self._ray_down():
            return
        ray = _ray()
        refs = list(self._calls)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            cost = self._calls.pop(ref)
            try:
                result = ray.get(ref, timeout=0)
            except Exception as err:  # the target died: what it held is lost
                self._fail(err)
                self._lose(cost)
                continue
            if result.__class__ is int:  # a relay: its forwarding rounds confirm what it held
                self._confirm(result)
                self._unconfirmed.append((result + 1, cost))

    def _confirm(self, rounds: int) -> None:
        """Forgets the messages a relay forwarded (it finished ``rounds`` rounds)."""
        unconfirmed = self._unconfirmed
        while unconfirmed and unconfirmed[0][0] <= rounds:
            unconfirmed.popleft()

    def confirmed_all(self) -> None:
        """The relay forwarded everything (its flush returned)."""
        self._unconfirmed.clear()

    def _lose(self, cost: tuple[int, int, int, int]) -> None:
        """Counts a failed call's batch lost, with what a dead relay had not forwarded yet."""
        payloads, merged, dropped, coalesced = cost
        for _, held in self._unconfirmed:  # a target that failed lost what it held, too
            payloads += held[0]
            merged += held[1]
            dropped += held[2]
            coalesced += held[3]
        self._unconfirmed.clear()
        self.dropped += payloads
        self.merged_lost += merged
        d, c = self.lost
        self.lost = (d + payloads + dropped, c + coalesced - merged)

    def _fail(self, err: BaseException) -> None:
        self.error = err
        self._target = None
        self._failed_at = time.monotonic()

    def ready(self) -> bool:
        """Whether a batch may be sent now (a target is known and a slot is free)."""
        if len(self._calls) >= self._limit or self._ray_down():
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
            batch[0] = batch[0].carrying(*self.lost)
            self.lost = (0, 0)
        cost = _cost(batch)
        payloads, merged, dropped, coalesced = cost
        try:
            data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            # what the target adds to its counts if it has to drop the batch whole
            ref = self._target.push.remote(data, len(batch), payloads + dropped, coalesced - merged)
        except Exception as err:
            self._fail(err)
            self._lose(cost)
            return False
        self._calls[ref] = cost
        self.sent_calls += 1
        return True

    def wait(self, deadline: float | None) -> bool:
        """Waits for the calls in flight (flush/close only); whether none is left."""
        ray = _ray()
        while self._calls:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self._ray_down():
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
        self._dropped = 0  # payloads this relay dropped (plus what dropped messages carried)
        self._coalesced = 0
        self.received = 0
        self.forwarded = 0
        self.rounds = 0  # forwarding rounds done: what was pushed before round n is forwarded after it
        self._forwarder = _Forwarder(self._find_ingest, RELAY_IN_FLIGHT)
        self._wake = threading.Event()
        self._flushes: list[tuple[threading.Event, float, list[bool]]] = []
        threading.Thread(target=self._run, name="rl_observers-relay", daemon=True).start()

    def _find_ingest(self) -> Any:
        return _ray().get_actor(self._address.ingest, namespace=self._address.namespace)

    def push(self, data: bytes, messages: int, dropped: int, coalesced: int) -> int:
        """Holds a batch until the next round; returns the rounds done (what came before is forwarded)."""
        batch = pickle.loads(data)
        with self._lock:
            self.received += len(batch)
            room = self._capacity - len(self._messages)
            if len(batch) > room:  # full: keep what fits, drop the rest
                payloads, merged, dropped, coalesced = _cost(batch[max(room, 0) :])
                self._dropped += payloads + dropped
                self._coalesced += coalesced - merged
                batch = batch[: max(room, 0)]
            self._messages.extend(batch)
            return self.rounds

    def flush(self, timeout: float = 5.0) -> bool:
        """Forwards what is held now and waits until the ingest has it; whether it has."""
        done = threading.Event()
        result: list[bool] = []
        with self._lock:
            self._flushes.append((done, timeout, result))
        self._wake.set()
        return done.wait(timeout + 0.5) and bool(result) and result[0]

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
            if flushes:  # until everything held reached the ingest (an ingest still starting: retried)
                deadline = time.monotonic() + max(timeout for _, timeout, _ in flushes)
                while True:
                    forwarder.wait(deadline)
                    self._forward()
                    forwarder.wait(deadline)
                    with self._lock:
                        held = bool(self._messages)
                    if (not held and not forwarder.in_flight) or time.monotonic() >= deadline:
                        break
                    time.sleep(0.05)
                flushed = not held and not forwarder.in_flight and forwarder.error is None
                for done, _, result in flushes:
                    result.append(flushed)
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
        batch[0] = batch[0].carrying(*counts)
        if forwarder.send(batch):
            with self._lock:
                self.forwarded += len(batch)
