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
 RayReceiver → accept(payload, (remote_dropped, remote_coalesced))
```

A :class:`~rl_observers.remote.ray.relay.Message` holds one payload (a
:class:`~rl_observers.remote.window.Window`, or a plain
:class:`~rl_observers.channel.payload.Payload`), its ``counts``
``(dropped, coalesced)`` and what it ``held``, ``(payloads, merged)``: the
drops and coalescing not yet reported travel with the next message, so the owner shows losses that happened elsewhere once anything gets
through. ``payloads`` is how many payloads the message holds and ``merged``
how many of them were counted as coalesced: wherever a message is lost (a
sender's call that fails, a full relay or ingest, a relay that dies), all its
payloads count as dropped and its merged ones no longer as coalesced, as in
the owner's queue.

Nothing on a worker's path waits for Ray: :meth:`RaySender.send` puts into
the bounded queue the owner uses too
(:class:`~rl_observers.channel.queue.PendingQueue`: beyond its capacity it
coalesces per namespace, or drops the oldest entry, and counts). A daemon thread of the sender's process makes the ``.remote()``
calls and checks finished ones with ``ray.wait(..., timeout=0)``. A relay or
ingest actor that dies costs the messages it held (counted as dropped); the
next batch finds (or creates) a new one by name.

What the relay merges: consecutive windows of one copy of one observer
(:meth:`~rl_observers.remote.window.Window.joins`: same observer, worker,
process and settings, neither closing) merge like the owner's aggregate
merges them: partials exactly, gauges and counters newest. Everything else (plain
payloads, closing windows, windows of other workers) is forwarded as it came.
The totals the owner logs are exactly those of the separate contributions;
a row boundary can move by at most one relay interval, as if the worker had
contributed a little less often.

The transport lives in four modules: this one (registration, ``make_sender``,
``make_receiver``), :mod:`~rl_observers.remote.ray.sender`,
:mod:`~rl_observers.remote.ray.relay` (the relay, the ingest, and the
bounded forwarder both push through) and
:mod:`~rl_observers.remote.ray.receiver`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from rl_observers.remote.ray.receiver import RayReceiver
from rl_observers.remote.ray.relay import (
    ACTOR_NAMESPACE,
    NAME,
    RayAddress,
    _is_address,
    _ray,
    premerge,
)
from rl_observers.remote.ray.sender import RaySender
from rl_observers.remote.transport import register_transport

__all__ = [
    "ACTOR_NAMESPACE",
    "NAME",
    "PRIORITY",
    "RayAddress",
    "RayReceiver",
    "RaySender",
    "make_receiver",
    "make_sender",
    "premerge",
    "reachable",
]

#: Selection order among transports: lower first (the socket comes before Ray).
PRIORITY = 20


def reachable(address: Any) -> bool:
    """Whether this process can send to ``address`` through Ray: it is connected to Ray.

    Never imports Ray: a process that did not import it is no Ray worker.
    """
    ray = _ray()
    return _is_address(address) and ray is not None and ray.is_initialized()


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


register_transport(
    NAME,
    make_sender=make_sender,
    make_receiver=make_receiver,
    reachable=reachable,
    priority=PRIORITY,
    retry=True,
)
