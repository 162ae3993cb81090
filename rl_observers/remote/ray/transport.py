"""Metrics over Ray: a transport that reaches the channel's owner from any node.

A sender's ``send`` only queues (the bounded, coalescing
:class:`~rl_observers.channel.queue.PendingQueue`); its thread pushes
batches fire-and-forget to the owner's ingest actor; the owner's
:class:`~.receiver.RayReceiver` drains it. Drops and coalescing travel with
the next message; a lost message counts its payloads as dropped (numbered
windows by their gap, at the owner). See
``docs/distributed.rst``, "Across machines".
"""

from __future__ import annotations

import os
import threading
from typing import Any

from rl_observers.remote.ray.ingest import (
    ACTOR_NAMESPACE,
    NAME,
    RayAddress,
    _is_address,
    _ray,
)
from rl_observers.remote.ray.receiver import RayReceiver
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
    "reachable",
]

#: Selection order among transports: lower first (the socket comes before Ray).
PRIORITY = 20


def reachable(address: Any) -> bool:
    """Whether this process is connected to Ray (never imports it: a process that did not is no Ray worker)."""
    ray = _ray()
    return _is_address(address) and ray is not None and ray.is_initialized()


_SENDERS: dict[tuple[int, tuple], RaySender] = {}
_SENDERS_LOCK = threading.Lock()


def make_sender(address: Any) -> RaySender | None:
    """The sender of this process to ``address`` (one per process and address); ``None`` without Ray."""
    if not reachable(address):
        return None
    key = (os.getpid(), tuple(address))
    with _SENDERS_LOCK:
        if key not in _SENDERS:
            _SENDERS[key] = RaySender(address)
        return _SENDERS[key]


def make_receiver(token: str, name: str = "") -> RayReceiver | None:
    """The owner's side for the channel ``token``; ``None`` where this process is not connected to Ray.

    Never initializes Ray: a channel whose owner never uses Ray starts no actor.
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
