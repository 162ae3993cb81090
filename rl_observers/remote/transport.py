"""How payloads travel from a handle in another process to the channel's owner.

Step **observer → channel**, across processes. A transport has two halves:
a :class:`Wire`, whose ``send(data)`` carries one message of bytes without
blocking (``SENT``, ``RETRY`` or ``GONE``), fed by a handle's
:class:`Outbox` (or a whole :class:`Sender`, as Ray gives); and a
:class:`Receiver` at the owner, started with the channel's first handle,
which hands each message to the channel. Transports register with
:func:`register_transport`; a handle takes the first reachable one by
priority. The Unix-datagram socket (:mod:`rl_observers.remote.socket`) is one.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from torchrl._utils import logger as torchrl_logger

from rl_observers import lifecycle
from rl_observers.channel.payload import Payload
from rl_observers.channel.queue import PendingQueue

__all__ = [
    "GONE",
    "RETRY",
    "SENT",
    "Outbox",
    "Receiver",
    "Sender",
    "Transport",
    "Unreachable",
    "make_sender",
    "register_transport",
    "transport",
    "transports",
    "Wire",
]

#: ``accept(payload, (dropped, coalesced, held))``: see :meth:`Receiver.start`.
Accept = Callable[[Payload, tuple], None]
SENT, RETRY, GONE = "sent", "retry", "gone"
#: Payloads a handle in another process holds while its wire says to retry.
OUTBOX_CAPACITY = 64


class Sender(Protocol):
    """What a handle in another process sends through (an :class:`Outbox`, or Ray's sender).

    ``send`` never blocks nor raises for transport reasons: it is bounded,
    coalesces per namespace, drops and counts beyond that (warning once);
    ``flush(timeout)`` says whether nothing is left; ``pending()`` counts what waits.
    """

    name: str
    submitted: int
    dropped: int
    coalesced: int

    def send(self, payload: Payload) -> None: ...

    def flush(self, timeout: float | None) -> bool: ...

    def pending(self) -> int: ...


class Receiver(Protocol):
    """The owner's receiving half of a transport."""

    name: str

    def start(self, accept: Accept, refuse: Callable[[], None], background: bool) -> None:
        """Starts receiving: ``accept(payload, counts)`` per message, ``refuse()`` per unreadable one.

        ``counts``: ``(dropped, coalesced, held)``: payloads dropped and merged on
        the way since the previous message, and how many ``payload`` holds (a
        2-tuple means one). With ``background=False`` messages arrive only
        through :meth:`poll`.
        """

    def address(self) -> Any:
        """A picklable address senders reach this receiver with (``None`` if unusable)."""

    def poll(self, deadline: float | None) -> None:
        """Hands over the messages already received (flush, step)."""

    def close(self, deadline: float | None) -> None:
        """Stops receiving, after handing over what was already sent."""

    def release(self) -> None:
        """Stops without waiting or locking (the channel was garbage-collected)."""

    def forget_after_fork(self) -> None:
        """In a forked child: drops the inherited copies, never the parent's resources."""


class Transport(NamedTuple):
    """A registered transport (see :func:`register_transport`)."""

    name: str
    make_sender: Callable[[Any], Sender | None]
    make_receiver: Callable[[str, str], Receiver | None]
    reachable: Callable[[Any], bool]
    priority: int
    retry: bool = False


_TRANSPORTS: dict[str, Transport] = {}


def register_transport(
    name: str,
    make_sender: Callable[[Any], Sender | None],
    make_receiver: Callable[[str, str], Receiver | None],
    reachable: Callable[[Any], bool],
    priority: int = 100,
    *,
    retry: bool = False,
) -> None:
    """Registers (or replaces) a transport.

    Args:
        name (str): the transport's name (``"socket"``, ``"ray"``, ...).
        make_sender (Callable): ``make_sender(address)`` returns a
            :class:`Wire` (or a whole :class:`Sender`) for a receiver's
            address (``None`` if it cannot).
        make_receiver (Callable): ``make_receiver(channel_token, channel_name)``
            returns the owner's :class:`Receiver` (``None`` if unavailable here).
        reachable (Callable): ``reachable(address)`` says, cheaply, whether a
            sender in this process can reach that address.
        priority (int, optional): lower is tried first. Defaults to ``100``.

    Keyword Args:
        retry (bool, optional): a ``make_receiver`` that returned ``None`` is
            asked again when the next handle is made or pickled (the
            transport may become available later, as Ray does once
            ``ray.init()`` ran). Defaults to ``False`` (asked once).
    """
    _TRANSPORTS[name] = Transport(name, make_sender, make_receiver, reachable, priority, retry)


def transports() -> tuple[Transport, ...]:
    """The registered transports, by priority."""
    return tuple(sorted(_TRANSPORTS.values(), key=lambda t: t.priority))


def transport(name: str) -> Transport:
    """The transport registered as ``name``.

    Raises:
        ValueError: if none is, naming those that are.
    """
    found = _TRANSPORTS.get(name)
    if found is None:
        raise ValueError(
            f"transport must be one of {sorted(_TRANSPORTS)}, got {name!r}."
        )
    return found


class Wire(Protocol):
    """What carries bytes to the owner: :meth:`send` never blocks nor raises."""

    name: str

    def send(self, data: bytes) -> str:
        """Sends one message: ``SENT``, ``RETRY`` (full now, keep it) or ``GONE`` (lost)."""


class Outbox:
    """A handle's sender: the bounded, coalescing queue of payloads waiting for its wire.

    ``send`` queues, then pumps into the wire inline (no thread: no GIL
    hand-over in a worker); ``RETRY`` keeps the rest for the next ``send`` or
    :meth:`flush`. Each message is the pickled ``(payload, (dropped,
    coalesced, held))`` (:meth:`Receiver.start`), the counts alone (``None``
    payload) when nothing else carries them.
    """

    def __init__(self, wire: Wire | None, capacity: int = OUTBOX_CAPACITY) -> None:
        if wire is not None:  # None: a subclass that ships the queue itself (Ray's sender)
            self.name = wire.name
        self.wire = wire
        self.queue = PendingQueue(capacity)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        _OUTBOXES.add(self)

    def forget_after_fork(self) -> None:
        """In a forked child: the parent sends what it holds; its lock may have been held."""
        self._lock = threading.Lock()
        self.queue = PendingQueue(self.queue.capacity)

    def send(self, payload: Payload) -> None:
        with self._lock:
            error = self.queue.put(payload)
            if error is not None:
                self._warn("merge", f"could not merge a partial of namespace {payload.namespace!r}: {error!r}")
            self._pump()

    def flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while True:
            with self._lock:
                if self._pump():
                    return True
            if deadline is not None and time.monotonic() + delay > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _pump(self) -> bool:
        """Sends what waits, then any count not told yet; whether nothing is left. Holds ``_lock``."""
        queue = self.queue
        status = None
        while (entry := queue.take()) is not None:
            status = self._ship(entry.payload, entry.payloads)
            if status == RETRY:
                queue.untake(entry)
                return False
            queue.done(entry, True, lost=status != SENT)
        # the last message sent told every count; an owner that is gone never hears of them
        return status == SENT or self._ship(None, 0) != RETRY

    def _ship(self, payload: Payload | None, held: int) -> str:
        dropped, coalesced = self.queue.untold()
        if payload is None and not (dropped or coalesced):
            return SENT
        try:
            data = pickle.dumps((payload, (dropped, coalesced, held)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            self._warn(
                "pickle",
                f"could not pickle a payload of namespace {payload.namespace!r}: {err!r}; it is "
                "dropped and counted in this handle's dropped (and the owner's health()['dropped'])",
            )
            status = GONE
        else:
            status = self.wire.send(data)
        if status != SENT and (dropped or coalesced):
            self.queue.retell(dropped, coalesced)
        return status

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            torchrl_logger.warning(f"MetricsHandle {message}. Further such errors are silent.")

    @property
    def submitted(self) -> int:
        return self.queue.counts()["submitted"]

    @property
    def dropped(self) -> int:
        return self.queue.losses()[0]

    @property
    def coalesced(self) -> int:
        return self.queue.losses()[1]

    def pending(self) -> int:
        return self.queue.backlog()


#: Every outbox of this process, so that a forked child empties its own.
_OUTBOXES: weakref.WeakSet[Outbox] = weakref.WeakSet()


def _empty_outboxes_after_fork() -> None:
    for outbox in list(_OUTBOXES):
        outbox.forget_after_fork()


lifecycle.after_fork_in_child(_empty_outboxes_after_fork)


class Unreachable:
    """The wire of a handle that reaches its owner by no transport: all is ``GONE``, with one warning saying why."""

    name = "unreachable"

    def __init__(self, owner: str, reason: str) -> None:
        self.owner = owner
        self.reason = reason
        self._warned = False

    def send(self, data: bytes) -> str:
        if not self._warned:
            self._warned = True
            torchrl_logger.warning(
                f"MetricsHandle cannot reach its owner {self.owner} from pid {os.getpid()} on "
                f"{os.uname().nodename}: {self.reason}. Its metrics are dropped and counted "
                "(handle.dropped). If the owner is still running, the likely cause is that its "
                "channel was closed (channel.close()) before the source feeding it (a collector's "
                "workers, a buffer's actor) shut down: shut the source down, or remove its "
                "observers, before closing the channel. This is reported once."
            )
        return GONE


def make_sender(
    addresses: Mapping[str, Any], prefer: str | None = None, owner: str = "the channel's owner"
) -> Sender:
    """A sender for the first reachable address, by priority (``prefer`` if given), else :class:`Unreachable`."""
    candidates = (transport(prefer),) if prefer is not None else transports()
    reasons = []
    for candidate in candidates:
        name, address = candidate.name, addresses.get(candidate.name)
        if address is None:
            reasons.append(f"{name}: the owner has no {name} receiver")
            continue
        sender = candidate.make_sender(address) if candidate.reachable(address) else None
        if sender is not None:
            return sender if hasattr(sender, "flush") else Outbox(sender)
        reasons.append(f"{name}: {address!r} is not reachable from here")
    return Outbox(Unreachable(owner, "; ".join(reasons) or "no transport is registered"))
