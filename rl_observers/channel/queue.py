"""The bounded queue where payloads wait at every hop, and its counters.

A payload is *put*; its hop *takes* entries one at a time and marks them
*done* (or gives one back with :meth:`~PendingQueue.untake`). On overflow a
payload coalesces into the newest pending entry of its namespace, or the
oldest entry is dropped. Counted under one lock, so that ``submitted ==
logged + pending + coalesced + dropped + sink_errors`` holds at any moment:
a dropped entry counts every payload it held in ``dropped`` and those merged
into it leave ``coalesced``.

Examples:
    >>> from rl_observers.channel.payload import Payload
    >>> from rl_observers.channel.queue import PendingQueue
    >>> queue = PendingQueue(capacity=1)
    >>> queue.put(Payload("a", {"x": 1.0}, 1)), queue.put(Payload("a", {"x": 2.0}, 2))
    (None, None)
    >>> entry = queue.take()
    >>> entry.payload
    Payload('a', {'x': 2.0}, step=2)
    >>> queue.done(entry, delivered=True)
    >>> queue.counts()["coalesced"], queue.counts()["logged"]
    (1, 1)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rl_observers.channel.payload import Payload

__all__ = ["PendingEntry", "PendingQueue"]


@dataclass(slots=True, eq=False)
class PendingEntry:
    """One pending :class:`~.payload.Payload`; ``seq`` is its first submission number.

    ``payloads`` is how many submissions it holds (1 + those coalesced into it).
    """

    payload: Payload
    seq: int
    payloads: int = 1

    @property
    def namespace(self) -> str:
        return self.payload.namespace


class PendingQueue:
    """A bounded, coalescing FIFO of :class:`PendingEntry` with the channel's counters.

    Args:
        capacity (int): the most entries waiting (the one being delivered aside).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._pending: deque[PendingEntry] = deque()
        self._newest: dict[str, PendingEntry] = {}
        self._in_flight: PendingEntry | None = None
        self._waiters = 0
        self._submitted = self._logged = self._coalesced = self._dropped = self._sink_errors = 0
        self._numbered = 0  # of the dropped, payloads whose owner counts them by their numbers
        self._told_dropped = self._told_coalesced = 0  # passed on to the next hop (untold)
        self.closed = False

    def put(self, payload: Payload, held: int = 1) -> Exception | None:
        """Queues one payload (or coalesces or drops on overflow).

        Returns the error of a partial that failed to merge, if any. A payload
        put after :meth:`close` is counted as dropped. ``held``: the payloads it holds.
        """
        with self._lock:
            self._submitted += 1
            if self.closed:
                self._dropped += held
                self._coalesced -= held - 1
                return None
            pending = self._pending
            namespace = payload.namespace
            if len(pending) >= self.capacity:
                entry = self._newest.get(namespace)
                if entry is not None:
                    error = entry.payload.absorb(payload)
                    entry.payloads += held
                    self._coalesced += 1
                    return error
                oldest = pending.popleft()
                if self._newest.get(oldest.namespace) is oldest:
                    del self._newest[oldest.namespace]
                self._lose_locked(oldest)
            entry = self._newest[namespace] = PendingEntry(payload, self._submitted, held)
            pending.append(entry)
        return None

    def _lose_locked(self, entry: PendingEntry) -> None:
        # every payload merged into it is lost with it
        self._dropped += entry.payloads
        self._coalesced -= entry.payloads - 1
        self._numbered += entry.payload.counted_by_number

    def losses(self) -> tuple[int, int]:
        """Payloads ``(dropped, coalesced)`` so far."""
        with self._lock:
            return self._dropped, self._coalesced

    def count_lost(self, dropped: int = 1, coalesced: int = 0) -> None:
        """Counts submissions ``dropped`` or ``coalesced`` on the way here (submitted too)."""
        with self._lock:
            self._submitted += dropped + coalesced
            self._dropped += dropped
            self._coalesced += coalesced

    def untold(self) -> tuple[int, int]:
        """``(dropped, coalesced)`` since the previous call, for the next hop (numbered payloads aside)."""
        with self._lock:
            dropped = self._dropped - self._numbered - self._told_dropped
            coalesced = self._coalesced - self._told_coalesced
            self._told_dropped += dropped
            self._told_coalesced += coalesced
        return dropped, coalesced

    def retell(self, dropped: int, coalesced: int) -> None:
        """Gives back what :meth:`untold` returned and did not reach the next hop."""
        self._told_dropped -= dropped  # only the queue's one taker tells: no lock
        self._told_coalesced -= coalesced

    def close(self) -> None:
        """From now on, :meth:`put` drops (and counts) what it is given."""
        with self._lock:
            self.closed = True

    def take(self) -> PendingEntry | None:
        """Removes the oldest entry and marks it in flight; ``None`` when empty."""
        with self._lock:
            if not self._pending:
                return None
            entry = self._pending.popleft()
            if self._newest.get(entry.namespace) is entry:
                del self._newest[entry.namespace]
            self._in_flight = entry
            return entry

    def take_all(self) -> list[PendingEntry]:
        """Removes every waiting entry, counted as passed on (``logged``): a batch for the next hop."""
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
            self._newest.clear()
            self._logged += len(taken)
            return taken

    def untake(self, entry: PendingEntry) -> None:
        """Puts the in-flight ``entry`` back in front: its hop said to try again later."""
        with self._lock:
            self._in_flight = None
            self._pending.appendleft(entry)
            self._newest.setdefault(entry.namespace, entry)

    def done(self, entry: PendingEntry, delivered: bool, lost: bool = False) -> None:
        """Marks the in-flight ``entry`` as logged (or as a sink error) and wakes waiters.

        ``lost``: its hop lost it; it counts as dropped with every payload merged into it.
        """
        with self._lock:
            self._in_flight = None
            if lost:
                self._lose_locked(entry)
            elif delivered:
                self._logged += 1
            else:
                self._sink_errors += 1
            if self._waiters:
                self._progress.notify_all()

    def backlog(self) -> int:
        """How many entries wait (read without the lock: a hint, not a count)."""
        return len(self._pending)

    def empty(self) -> bool:
        """Whether no entry is waiting (one may be in flight)."""
        with self._lock:
            return not self._pending

    def counts(self) -> dict[str, int]:
        """The counters, read together (see :meth:`MetricsChannel.health`)."""
        with self._lock:
            return {
                "submitted": self._submitted,
                "logged": self._logged,
                "pending": len(self._pending) + (self._in_flight is not None),
                "coalesced": self._coalesced,
                "dropped": self._dropped,
                "sink_errors": self._sink_errors,
            }

    def has_pending(self, wanted: Callable[[Payload], bool]) -> bool:
        """Whether the payload of a pending or in-flight entry is ``wanted``."""
        with self._lock:
            return any(wanted(e.payload) for e in (*self._pending, self._in_flight) if e is not None)

    def _through_locked(self, target: int) -> bool:
        pending, in_flight = self._pending, self._in_flight
        return (not pending or pending[0].seq > target) and (in_flight is None or in_flight.seq > target)

    def wait_processed(self, deadline: float | None) -> bool:
        """Waits until every submission counted so far was delivered, failed or dropped.

        Returns ``False`` if ``deadline`` (a ``time.monotonic()`` value) passed first.
        """
        with self._lock:
            target = self._submitted
            self._waiters += 1
            try:
                while not self._through_locked(target):
                    if deadline is None:
                        self._progress.wait()
                    else:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._progress.wait(remaining)
                return self._through_locked(target)
            finally:
                self._waiters -= 1
