"""How payloads travel from a handle in another process to the channel's owner.

Step of the flow: **channel** (source → observer → channel → logger). A
transport has two halves:

- a :class:`Sender`, inside a :class:`~rl_observers.MetricsHandle` used in a
  worker or actor: :meth:`Sender.send` never blocks and never raises for
  transport reasons; it is bounded, coalesces per namespace with
  :meth:`~rl_observers.channel.payload.Payload.absorb`, and drops and counts
  beyond that (warning once);
- a :class:`Receiver`, started by the owning
  :class:`~rl_observers.MetricsChannel` when its first handle is made: it
  hands every message to the channel as ``accept(payload,
  (unreported_dropped, unreported_coalesced))`` and reports unreadable ones
  with ``refuse()``.

What travels is the submitted object itself: a
:class:`~rl_observers.channel.payload.Payload`, or an observer copy's
:class:`~rl_observers.remote.window.Window`.

Transports register themselves with :func:`register_transport`; a handle
keeps the address of every receiver of its channel and, when first used in
another process, takes the first reachable one by priority (lowest first).
The Unix-datagram socket (:mod:`rl_observers.remote.socket`) is one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from torchrl._utils import logger as torchrl_logger

from rl_observers.channel.payload import Payload

__all__ = [
    "Receiver",
    "Sender",
    "Transport",
    "Unreachable",
    "make_sender",
    "register_transport",
    "transport",
    "transports",
]

#: ``accept(payload, (unreported_dropped, unreported_coalesced))``.
Accept = Callable[[Payload, tuple], None]


class Sender(Protocol):
    """The sending half of a transport, used by a handle in another process."""

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
        """Starts receiving; with ``background=False`` messages arrive only through :meth:`poll`."""

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
            :class:`Sender` for a receiver's address (``None`` if it cannot).
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


class Unreachable:
    """The sender of a handle that reaches its owner by no transport: it drops and counts.

    It warns once, at the first payload, naming the owner and why each
    transport cannot reach it.
    """

    name = "unreachable"

    def __init__(self, owner: str, reason: str) -> None:
        self.owner = owner
        self.reason = reason
        self.submitted = 0
        self.dropped = 0
        self.coalesced = 0
        self._warned = False
        self._lock = threading.Lock()

    def send(self, payload: Payload) -> None:
        with self._lock:
            self.submitted += 1
            self.dropped += 1
            warn, self._warned = not self._warned, True
        if warn:
            torchrl_logger.warning(
                f"MetricsHandle cannot reach its owner {self.owner} from pid {os.getpid()} on "
                f"{os.uname().nodename}: {self.reason}. Its metrics are dropped and counted "
                "(handle.dropped). If the owner is still running, the likely cause is that its "
                "channel was closed (channel.close()) before the source feeding it (a collector's "
                "workers, a buffer's actor) shut down: shut the source down, or remove its "
                "observers, before closing the channel. This is reported once."
            )

    def flush(self, timeout: float | None) -> bool:
        return True

    def pending(self) -> int:
        return 0


def _why_not(candidates: tuple[Transport, ...], addresses: Mapping[str, Any]) -> str:
    reasons = []
    for candidate in candidates:
        address = addresses.get(candidate.name)
        if address is None:
            reasons.append(f"{candidate.name}: the owner has no {candidate.name} receiver")
        else:
            reasons.append(f"{candidate.name}: {address!r} is not reachable from here")
    return "; ".join(reasons) or "no transport is registered"


def make_sender(
    addresses: Mapping[str, Any], prefer: str | None = None, owner: str = "the channel's owner"
) -> Sender:
    """A sender for the first reachable address, by priority (``prefer`` if given).

    When none is reachable (or ``prefer``'s is not), the sender is an
    :class:`Unreachable` one: it warns once, naming ``owner`` and the
    reason, then drops and counts.
    """
    candidates = (transport(prefer),) if prefer is not None else transports()
    for candidate in candidates:
        address = addresses.get(candidate.name)
        if address is None or not candidate.reachable(address):
            continue
        sender = candidate.make_sender(address)
        if sender is not None:
            return sender
    return Unreachable(owner, _why_not(candidates, addresses))
