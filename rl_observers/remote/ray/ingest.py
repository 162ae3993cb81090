"""The Ray transport's parts: the owner's ingest actor and the calls that reach it.

See :mod:`rl_observers.remote.ray.transport` for the flow. Also here: the
bounded fire-and-forget :class:`_Forwarder` that senders push through.
"""

from __future__ import annotations

import functools
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from rl_observers.channel.payload import Payload

#: The transport's name (``handle.transport``).
NAME = "ray"
#: Seconds between two rounds of a sender's thread.
SENDER_INTERVAL = 0.02
#: The Ray namespace of the ingest actors (their names hold the channel's token).
ACTOR_NAMESPACE = "rl_observers"
#: Messages the ingest actor holds before it drops.
INGEST_CAPACITY = 1 << 18
#: Messages the owner takes from the ingest per call.
DRAIN_BATCH = 16384
#: Seconds a drain call waits for messages in the ingest.
DRAIN_WAIT = 0.1
#: Seconds between two attempts to find the owner's ingest after a failure.
RETRY_AFTER = 1.0


@dataclass(slots=True)
class Message:
    """One payload on its way through Ray, with the counts it carries.

    ``counts``: ``(dropped, coalesced)`` not yet reported. ``held``:
    ``(payloads, merged)``: the payloads merged into it, numbered windows aside
    (the owner counts those by their gaps), which count as dropped if the
    message is lost, and the merges among them.
    """

    payload: Payload
    counts: tuple[int, int] = (0, 0)
    held: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.held is None:
            self.held = (1 - self.payload.counted_by_number, 0)

    def carrying(self, dropped: int, coalesced: int) -> Message:
        """This message, carrying ``dropped`` and ``coalesced`` more unreported counts."""
        self.counts = (self.counts[0] + dropped, self.counts[1] + coalesced)
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # positional: smaller and faster than a slotted state
        return Message, (self.payload, self.counts, self.held)


class RayAddress(NamedTuple):
    """What a sender needs to reach an owner through Ray (plain, picklable data)."""

    token: str
    ingest: str  # the ingest actor's name
    namespace: str  # the Ray namespace it lives in
    owner: str  # who the owner is, in words (for warnings)


def _ray() -> Any:
    """Ray if this process imported it (a Ray worker always has), else ``None``."""
    return sys.modules.get("ray")


def no_start(call: Callable[..., Any]) -> Callable[..., Any]:
    """Ray's ``call`` without its ``ray.init()`` when Ray is down: one racing a ``ray.shutdown()`` raises, starting no Ray."""
    return getattr(call, "__wrapped__", call)


def call_remote(method: Any, *args: Any) -> Any:
    """``method.remote(*args)`` for an actor method, without Ray's start-on-call (:func:`no_start`)."""
    return no_start(type(method)._remote)(method, args, {})


def ready_within(refs: list[Any], timeout: float | None) -> list[Any]:
    """The ``refs`` ready within ``timeout``, polled: a call waiting in Ray can outlive ``ray.shutdown()``."""
    wait = no_start(_ray().wait)
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        ready = wait(refs, num_returns=len(refs), timeout=0)[0]
        if len(ready) == len(refs) or (deadline is not None and time.monotonic() >= deadline):
            return ready
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def _is_address(address: Any) -> bool:
    return isinstance(address, tuple) and len(address) == 4 and all(isinstance(a, str) for a in address)


def _cost(batch: list[Message]) -> tuple[int, int, int, int, int]:
    """What losing ``batch`` costs: ``(payloads, merged, dropped, coalesced, numbered)``.

    A loss adds ``payloads + dropped`` to the drops and ``coalesced - merged``
    to the coalesced payloads that travel on; the ``numbered`` windows among
    them the owner counts by their gaps (the sender counts them too).
    """
    payloads = merged = dropped = coalesced = numbered = 0
    for message in batch:
        counts, held = message.counts, message.held
        dropped += counts[0]
        coalesced += counts[1]
        payloads += held[0]
        merged += held[1]
        numbered += message.payload.counted_by_number
    return payloads, merged, dropped, coalesced, numbered


# ------------------------------------------------------------------------------- actors
class _Ingest:
    """The owner's mailbox: bounded, drained by the owner's thread; holds pickled bytes (never imports torch)."""

    def __init__(self, capacity: int = INGEST_CAPACITY) -> None:
        self._batches: deque[tuple[bytes, int]] = deque()
        self._held = 0  # messages in _batches
        self._capacity = capacity
        self._dropped = 0  # payloads dropped here, plus what dropped batches carried
        self._coalesced = 0
        self._ready = threading.Condition()

    def push(self, data: bytes, messages: int, dropped: int, coalesced: int) -> bool:
        """Keeps one pickled batch of ``messages``, or drops it whole; whether it was kept.

        ``dropped`` and ``coalesced``: what dropping it adds to those counts
        (see :func:`_cost`).
        """
        with self._ready:
            if self._held + messages > self._capacity:
                self._dropped += dropped
                self._coalesced += coalesced
                return False
            self._batches.append((data, messages))
            self._held += messages
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


class _Forwarder:
    """Bounded fire-and-forget ``push.remote`` calls to one target actor, found by ``resolve``.

    Runs on its owner's thread only; a failed call adds its :func:`_cost` to the drops.
    """

    def __init__(self, resolve: Callable[[], Any], in_flight: int) -> None:
        self._resolve = resolve
        self._limit = in_flight
        self._target: Any = None
        self._failed_at = -float("inf")
        self._calls: dict[Any, tuple[int, int, int, int, int]] = {}  # ref -> its batch's cost
        self.lost: tuple[int, int] = (0, 0)  # to add to the next batch's counts
        self.dropped = 0  # payloads lost with calls that failed
        self.merged_lost = 0  # of those, payloads counted as coalesced where they merged
        self.error: BaseException | None = None
        self.sent_calls = 0
        self._ray_seen = self._ray_gone = False  # Ray was up here; then it was shut down

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def _ray_down(self) -> bool:
        """Whether Ray was shut down in this process (then no call is made: it would start a new Ray).

        Once it was, a later ``ray.init()`` is another session: this thread never calls Ray again
        (a call racing that session's start or shutdown could take the process down).
        """
        ray = _ray()
        if not self._ray_gone and ray is not None and ray.is_initialized():
            self._ray_seen = True
            return False
        self._ray_gone = self._ray_seen
        for cost in self._calls.values():
            self._lose(cost)
        self._calls.clear()
        self._fail(RuntimeError("Ray was shut down in this process"))
        return True

    def _finished(self, timeout: float | None) -> list[Any]:
        """The calls finished within ``timeout``; none once Ray was shut down (its calls are then counted lost)."""
        try:
            return ready_within(list(self._calls), timeout)
        except Exception:
            if self._ray_down():
                return []
            raise

    def reap(self, timeout: float | None = 0.0) -> None:
        """Accounts for the calls that finished, waiting ``timeout`` at most for all of them."""
        if not self._calls or self._ray_down():
            return
        for ref in self._finished(timeout):
            cost = self._calls.pop(ref)
            try:
                no_start(_ray().get)(ref, timeout=0)
            except Exception as err:  # the target died: the batch is lost
                self._fail(err)
                self._lose(cost)

    def _lose(self, cost: tuple[int, int, int, int, int]) -> None:
        """Counts a failed call's batch lost."""
        payloads, merged, dropped, coalesced, numbered = cost
        self.dropped += payloads + numbered
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
        payloads, merged, dropped, coalesced, _ = cost
        try:
            data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            # what the target adds to its counts if it has to drop the batch whole
            lost = (payloads + dropped, coalesced - merged)
            ref = call_remote(self._target.push, data, len(batch), *lost)
        except Exception as err:
            self._fail(err)
            self._lose(cost)
            return False
        self._calls[ref] = cost
        self.sent_calls += 1
        return True

    def wait(self, deadline: float | None) -> bool:
        """Waits for the calls in flight (flush/close only); whether none is left."""
        while self._calls:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self._ray_down():
                return False
            self.reap(left)
        return True


@functools.cache
def ingest_class() -> Any:
    """:class:`_Ingest` as a Ray actor class, made once."""
    return _ray().remote(num_cpus=0, max_concurrency=8)(_Ingest)
