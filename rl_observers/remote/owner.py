"""The channel's wing for other processes: receivers, handles, the account of copies.

Step **channel**, plugged in with :func:`~rl_observers.channel.channel.register_wing`.
:class:`RemoteWing`, in the owner's process, starts the receivers (at the
first handle), queues what other processes send and keeps the account of
copies; :class:`Forwarder` is the channel in a forked child, sending to the
parent's owner as a handle would.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchrl._utils import logger as torchrl_logger

from rl_observers.channel.owner import Owner, Wing
from rl_observers.channel.payload import Payload, is_partial
from rl_observers.remote.account import Account
from rl_observers.remote.handle import OWNERS, WINGS, MetricsHandle
from rl_observers.remote.transport import Receiver, make_sender, transports
from rl_observers.remote.transport import transport as find_transport
from rl_observers.remote.window import Window
from rl_observers.sources.placement import IdentityMap

__all__ = ["LAST_WINDOWS_WAIT", "Forwarder", "RemoteWing"]

#: Seconds gone copies' last windows (already acknowledged, on their way) have to reach the owner
#: before the missing ones are counted lost; settled by ``flush``, ``health()`` or ``close``.
LAST_WINDOWS_WAIT = 3.0


class RemoteWing(Wing):
    """What a channel does, where it was created, for the processes that send to it."""

    losses = ("copies_lost",)

    def __init__(self, owner: Owner, channel: Any) -> None:
        self.owner = owner
        self.queue = owner.queue
        # producers (weakly) whose copies elsewhere (workers, actors) still feed this channel: their
        # description, None once their copies are gone
        self._feeders = IdentityMap()
        self._lock = threading.Lock()
        self._receivers: dict[str, Receiver] = {}
        self._addresses: dict[str, Any] = {}
        self.account = Account(owner.name, self.queue.count_lost)
        # observers whose copies are gone with some last window missing: name -> (settle by, copies)
        self._unsettled: dict[str, tuple[float, frozenset[Any]]] = {}
        self._copies_lost_seen = 0
        self._receivers_started = False
        self._receivers_lock = threading.Lock()
        OWNERS[owner.token] = channel
        WINGS[owner.token] = self

    def _accept(self, payload: Any, counts: Any) -> None:
        """Queues one payload from another process like a local submission (``None``: counts only)."""
        counted = False  # whether the counts it carries are readable
        try:
            # a transport written before ``held`` sends two counts: its payload holds one
            lost, coalesced, held = counts if len(counts) == 3 else (*counts, int(payload is not None))
            valid = counted = lost.__class__ is int and coalesced.__class__ is int and held.__class__ is int
            if valid and payload is not None:
                metrics = payload.metrics
                valid = (
                    (payload.__class__ is Window or payload.__class__ is Payload)
                    and payload.namespace.__class__ is str
                    and metrics.__class__ is dict
                    and all(key.__class__ is str for key in metrics)
                )
        except Exception:
            valid = False
        if not valid:  # lost with what it held, its counts kept if readable
            if counted and held > 0:
                self.queue.count_lost(lost + held, coalesced + 1 - held)
            else:
                self.queue.count_lost()
            return
        if lost or coalesced:
            self.queue.count_lost(lost, coalesced)
        if payload is None:
            return
        if payload.__class__ is Window and payload.seq is not None:
            late = self.account.note(payload)
            if late is None:  # counted lost when its copy was settled: counted once
                return
            if late:  # its copy's newest counters replaced its own; its gauges are older too
                payload.metrics = {k: v for k, v in metrics.items() if is_partial(v)}
        self.owner.submit(payload, held)

    def addresses(self) -> dict[str, Any]:
        """Starts every registered transport's receiver on first use; returns their addresses."""
        with self._receivers_lock:
            if not self.owner.close_requested:
                first = not self._receivers_started
                self._receivers_started = True
                for candidate in transports():
                    if candidate.name in self._receivers or not (first or candidate.retry):
                        continue
                    receiver = candidate.make_receiver(self.owner.token, self.owner.name)
                    if receiver is not None:
                        receiver.start(self._accept, self.queue.count_lost, self.owner.background)
                        self._receivers[candidate.name] = receiver
            return {name: r.address() for name, r in self._receivers.items()}

    def current_addresses(self, known: Mapping[str, Any]) -> dict[str, Any]:
        """The receivers' addresses now (starting those that became available, as Ray's)."""
        if not self.owner.closed:
            self._addresses = self.addresses()
            return self._addresses
        return dict(known)

    def handle(self, channel: Any, transport: str | None) -> MetricsHandle:
        if transport is not None:
            find_transport(transport)  # refuses an unknown name
        self._addresses = self.addresses()
        return MetricsHandle(
            self.owner.token,
            self._addresses,
            channel=channel,
            transport=transport,
            owner=f"MetricsChannel {self.owner.name!r} (pid {self.owner.pid} on {socket.gethostname()})",
        )

    def poll(self, deadline: float | None) -> None:
        for receiver in list(self._receivers.values()):
            receiver.poll(deadline)

    def flush(self, deadline: float | None) -> bool:
        for receiver in list(self._receivers.values()):  # through every hop a receiver has
            (getattr(receiver, "barrier", None) or receiver.poll)(deadline)
        return self.settle_gone(deadline)

    def clean_since_last_check(self) -> bool:
        """Whether no copy was counted lost since the previous check (lost windows count in ``dropped``)."""
        seen, self._copies_lost_seen = self._copies_lost_seen, self.account.copies_lost
        return seen == self._copies_lost_seen

    def counts(self) -> dict[str, int]:
        if self._unsettled:
            self.settle_gone(0.0)  # those whose windows came in or whose time is up
        return {"copies_lost": self.account.copies_lost}

    def copies_attached(self, feeder: Any, description: str) -> None:
        """Notes that copies of ``feeder`` run elsewhere and send to this channel.

        Until :meth:`copies_gone`, closing the channel warns and returns ``False``.
        """
        with self._lock:  # not into a map that before_close has just taken
            self._feeders.set(feeder, description)
        name = getattr(feeder, "name", None)
        if isinstance(name, str):  # the name its copies' windows carry (``Window.observer``)
            self.account.describe(name, description)

    def copies_expected(self, feeder: Any, workers: Any) -> None:
        """Notes the workers ``feeder``'s copies were attached in: each one is expected to report."""
        name = getattr(feeder, "name", None)
        if isinstance(name, str) and not self.owner.close_requested:
            self.account.expect(name, workers)

    def copies_gone(self, feeder: Any) -> None:
        """Notes that ``feeder``'s copies are gone (removed, or their source shut down); never waits.

        Their account is settled now if every last window is in, else once
        they arrive or ``LAST_WINDOWS_WAIT`` seconds passed (:meth:`settle_gone`).
        """
        self._feeders.set(feeder, None)
        name = getattr(feeder, "name", None)
        if not isinstance(name, str) or self.owner.close_requested:
            return
        self.poll(time.monotonic() + LAST_WINDOWS_WAIT)
        members = self.account.members(name)
        if self.account.waiting(name, members):
            with self._lock:
                self._unsettled[name] = (time.monotonic() + LAST_WINDOWS_WAIT, members)
            return
        self.account.settle(name, members)

    def settle_gone(self, deadline: float | None = None) -> bool:
        """Settles the account of observers whose copies are gone; whether none is left unsettled.

        Waits until the missing last windows arrive, ``LAST_WINDOWS_WAIT``
        passes, or ``deadline`` (``0``: no wait).
        """
        while True:
            now = time.monotonic()
            with self._lock:
                unsettled = dict(self._unsettled)
            for name, (until, members) in unsettled.items():
                if now >= until or not self.account.waiting(name, members):
                    with self._lock:
                        if self._unsettled.get(name, (None, None))[1] is members:
                            del self._unsettled[name]
                    self.account.settle(name, members)
            if not self._unsettled:
                return True
            if deadline is not None and now >= deadline:
                return False
            time.sleep(0.05)
            self.poll(deadline)

    def before_close(self) -> bool:
        # Read what other processes sent first: close callbacks see it, and a Ray shut down
        # under running copies is noticed here (they count as lost, not as still attached).
        self.poll(time.monotonic() + 1.0)
        # copies still feeding this channel are forgotten, not counted lost, with a warning
        with self._lock:
            feeders, self._feeders = self._feeders.items(), IdentityMap()
        live = [description for _, description in feeders if description is not None]
        for feeder, description in feeders:
            name = getattr(feeder, "name", None)
            if description is not None and isinstance(name, str):
                self.account.forget(name)
        if not live:
            return False
        torchrl_logger.warning(
            f"MetricsChannel {self.owner.name!r} is closing while observers still have copies attached "
            f"in other processes or actors ({'; '.join(live)}): what those copies have not sent "
            "yet (their last windows at least) is lost. Shut the source down (collector.shutdown(), "
            "the buffer's close()) or remove its observers before closing the channel."
        )
        return True

    def close(self, deadline: float | None) -> None:
        self.settle_gone(deadline)
        with self._receivers_lock:
            self._receivers_started = True
            for receiver in self._receivers.values():
                receiver.close(deadline)
        with self._lock:
            self._unsettled = {}
        self.account.settle()  # copies that never sent their last window are reported

    def release(self) -> None:
        for receiver in list(self._receivers.values()):
            receiver.release()

    def in_forked_child(self, owner: Owner) -> Forwarder:
        """The channel in a forked child: a forwarder; the inherited receivers' files stay the parent's."""
        OWNERS.pop(owner.token, None)
        WINGS.pop(owner.token, None)
        forwarder = Forwarder(owner, self._addresses)
        for receiver in self._receivers.values():
            receiver.forget_after_fork()
        return forwarder


class Forwarder:
    """A channel's stand-in in a forked child process: it forwards to the parent's owner."""

    loss_keys = ("dropped",)

    def __init__(self, owner: Owner, addresses: Mapping[str, Any]) -> None:
        self.token = owner.token
        self.logger = owner.logger
        self.name = owner.name
        self.capacity = owner.capacity
        self.closed = owner.closed
        self._addresses = {} if owner.closed else dict(addresses)
        self._sender = make_sender(self._addresses, owner=f"MetricsChannel {owner.name!r} (pid {owner.pid})")
        self._dropped_after_close = 0
        self._lost_seen = self._sender.dropped
        self._close_callbacks: list[Callable[[], Any]] = []

    def submit(self, payload: Payload) -> None:
        if self.closed:
            self._dropped_after_close += 1
            return
        self._sender.send(payload)

    def handle(self, channel: Any, transport: str | None) -> MetricsHandle:
        if transport is not None:
            find_transport(transport)  # refuses an unknown name
        where = f"pid {os.getppid()} on {socket.gethostname()}"
        return MetricsHandle(
            self.token, self._addresses, transport=transport, owner=f"MetricsChannel {self.name!r} ({where})"
        )

    @property
    def transport(self) -> str:
        """The name of the transport it sends through."""
        return self._sender.name

    @property
    def address(self) -> Any:
        """The owner's address it sends to."""
        return self._addresses.get(self._sender.name)

    def flush(self, timeout: float | None) -> bool:
        """Sends what the sender holds; whether all went and nothing was dropped since the last call."""
        done = self._sender.flush(timeout)
        lost = self._sender.dropped + self._dropped_after_close
        clean, self._lost_seen = lost == self._lost_seen, lost
        return clean and done

    def send_held(self, timeout: float | None) -> bool:
        """Sends what the sender holds back (a handle's flush); whether nothing is left."""
        return self._sender.flush(timeout)

    def step(self) -> int:
        self._sender.flush(0)
        return 0

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        self._close_callbacks.append(callback)

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> bool:
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception as err:
                torchrl_logger.warning(
                    f"MetricsChannel close callback {callback!r} raised: {err!r}."
                )
        done = self.flush(timeout)
        self.closed = True
        return done

    def health(self) -> dict[str, int]:
        sender = self._sender
        extra = self._dropped_after_close
        return {
            "submitted": sender.submitted + extra,
            "logged": 0,
            "pending": sender.pending(),
            "coalesced": sender.coalesced,
            "dropped": sender.dropped + extra,
            "sink_errors": 0,
        }

    def release(self) -> None:
        pass
