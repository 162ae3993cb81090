"""The sending side of the Ray transport: a bounded queue and a thread per process.

See :mod:`rl_observers.remote.ray.transport` for the flow.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rl_observers.channel.payload import Payload
from rl_observers.remote.ray.ingest import (
    NAME,
    SENDER_INTERVAL,
    Message,
    RayAddress,
    _Forwarder,
    _is_address,
    _ray,
    no_start,
)
from rl_observers.remote.transport import Outbox

#: Messages a sender buffers before it coalesces per namespace (room for an ingest that
#: stalls a few hundred milliseconds at thousands of windows a second: a full buffer
#: makes every send take the merging path).
SENDER_CAPACITY = 4096
#: Batches a sender has in flight to the ingest at most.
SENDER_IN_FLIGHT = 4


class RaySender(Outbox):
    """Sends payloads to the owner at ``address`` through Ray; never blocks, never raises.

    An :class:`~rl_observers.remote.transport.Outbox` whose queue a thread of
    its own ships in batches, so that no Ray call runs in ``send``.

    Args:
        address (RayAddress): the owner's :meth:`RayReceiver.address`.

    Keyword Args:
        capacity (int, optional): messages buffered here before they coalesce
            per namespace (or drop the oldest). Defaults to ``SENDER_CAPACITY``.
        in_flight (int, optional): batches in flight at most. Defaults to
            ``SENDER_IN_FLIGHT``.
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
        interval: float = SENDER_INTERVAL,
    ) -> None:
        if not _is_address(address):
            raise TypeError(f"RaySender expected a RayAddress, got {address!r}.")
        super().__init__(None, capacity)
        address = self.address = RayAddress(*address)
        self._capacity = capacity
        # a buffer half full wakes the sending thread early: at a high rate it would otherwise
        # fill before the next round and every further send would take the merging path
        self._wake_at = max(capacity // 2, 1)
        self._interval = interval
        self._forwarder = _Forwarder(
            lambda: no_start(_ray().get_actor)(address.ingest, namespace=address.namespace), in_flight
        )
        self._wake = threading.Event()
        # (done, deadline, result) of each flush waiting for the sending thread
        self._flush_requests: list[tuple[threading.Event, float | None, list[bool]]] = []
        # whether this process runs the sending thread: ``send`` reads a flag, not the pid
        # (``os.getpid()`` is a system call, ~1 us here); a fork clears it in the child
        self._running = False
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("RaySender is not picklable: pickle its address and make a new one.")

    # -- worker side: never waits ---------------------------------------------------------------
    def send(self, payload: Payload) -> None:
        """Queues one payload for the owner; returns at once."""
        if not self._running:
            self._start_thread()
        queue = self.queue
        if queue.backlog() < self._capacity:
            queue.put(payload)
            if queue.backlog() == self._wake_at:
                self._wake.set()
            return
        # full: the queue merges into the newest entry of the namespace, or drops the oldest
        dropped = queue.losses()[0]
        error = queue.put(payload)
        if queue.losses()[0] > dropped:
            error = (
                f"its buffer of {self._capacity} messages to its owner {self.address.owner} is "
                "full (Ray does not keep up): the oldest payload was dropped"
            )
        if error is not None:
            self._warn("ray", f"namespace {payload.namespace!r}: {error}")

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until what was sent before reached the owner's ingest (or ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._start_thread()
        done = threading.Event()
        result: list[bool] = []
        with self._lock:  # a list, not one slot: a request made while the thread takes one waits its turn
            self._flush_requests.append((done, deadline, result))
        self._wake.set()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return done.wait(left) and bool(result) and result[0]

    def close(self, timeout: float | None = None) -> bool:
        """Flushes, then stops the sending thread."""
        flushed = self.flush(timeout)
        self._closed = True
        self._wake.set()
        return flushed

    # -- the sending thread -----------------------------------------------------------------------
    def _start_thread(self) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
            threading.Thread(target=self._run, name="rl_observers-ray-sender", daemon=True).start()

    def _run(self) -> None:
        forwarder = self._forwarder
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            with self._lock:
                requests, self._flush_requests = self._flush_requests, []
            flushed = False
            try:
                forwarder.reap()
                self._send_pending()
                if requests:
                    deadlines = [r[1] for r in requests]
                    flushed = self._flush(None if None in deadlines else max(deadlines))
            except Exception as err:  # never expected: keep sending, say it once
                self._warn("ray", f"failed to send through Ray: {err!r}")
            for done, _, result in requests:
                result.append(flushed)
                done.set()
            if forwarder.error is not None:
                self._warn(
                    "ray",
                    f"cannot reach its owner {self.address.owner} through Ray "
                    f"({forwarder.error!r}); what it cannot send is dropped and counted"
                )

    def _send_pending(self) -> None:
        # not ready: beyond its capacity, the queue coalesces or drops
        if not self.queue.backlog() or not self._forwarder.ready():
            return
        taken = self.queue.take_all()  # what senders append meanwhile waits for the next round
        if taken:
            # lost on a later hop, an entry counts as dropped but for its numbered windows (counted by their gap)
            batch = [Message(e.payload, (0, 0), (e.payloads - e.payload.counted_by_number, e.payloads - 1)) for e in taken]
            batch[0].counts = self.queue.untold()
            self._forwarder.send(batch)  # a failed call is counted by the forwarder

    def _flush(self, deadline: float | None) -> bool:
        forwarder = self._forwarder
        while self.queue.backlog():
            if deadline is not None and time.monotonic() > deadline:
                return False
            forwarder.reap()
            if forwarder.ready():
                self._send_pending()
            elif forwarder.in_flight:
                forwarder.wait(time.monotonic() + 0.05)
            else:  # no target now: try again until the deadline
                time.sleep(0.05)
        return forwarder.wait(deadline) and forwarder.error is None

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's sending thread is not here (the next send starts one)."""
        super().forget_after_fork()
        self._running = False

    @property
    def dropped(self) -> int:
        """Payloads dropped here: beyond the buffer, or lost with a call that failed (all it had merged)."""
        return super().dropped + self._forwarder.dropped

    @property
    def coalesced(self) -> int:
        """Payloads merged into a buffered one, but for those lost with it (counted as dropped)."""
        return super().coalesced - self._forwarder.merged_lost

    @property
    def stats(self) -> dict[str, int]:
        """Batches sent and in flight, and what the transport itself lost."""
        f = self._forwarder
        return {"calls": f.sent_calls, "in_flight": f.in_flight, "lost": f.dropped}
