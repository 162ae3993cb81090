"""MetricsHandle: a picklable, non-owning way to submit to a channel from anywhere.

Step of the flow: **observer → channel** (source → observer → channel →
logger), for observers running away from the channel's owner. In the
owner's process a handle submits to the channel directly; elsewhere it
sends through a transport (:mod:`rl_observers.remote.transport`) chosen
when it is first used.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from rl_observers.channel.owner import Owner
from rl_observers.channel.payload import Payload, check_metrics
from rl_observers.remote.transport import Sender, make_sender
from rl_observers.remote.window import Window

__all__ = ["MetricsHandle"]


# Channels owned by this process, by token: a handle unpickled here submits to the channel itself.
OWNERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
# Their wings (:class:`~.owner.RemoteWing`), which know the receivers' addresses.
WINGS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class MetricsHandle:
    """A picklable, non-owning reference to a :class:`~rl_observers.MetricsChannel`.

    Get one from :meth:`MetricsChannel.handle` and send it to workers
    (multiprocessing, fork or spawn; Ray actors). It has the channel's
    :meth:`submit_metrics` signature, never closes the channel, and never
    blocks nor raises because of the transport.

    - In the channel's process it submits directly and keeps the channel alive.
    - Elsewhere it sends through the first reachable transport
      (:attr:`transport`, chosen at first use: the Unix socket on the same
      machine, else Ray), from a bounded queue that coalesces per namespace
      while the transport is full. What it loses (owner gone, a payload
      unpicklable or over one datagram, about 416 KiB) is counted in
      :attr:`dropped` and in the owner's ``health()["dropped"]``.
      With no reachable transport it warns once and counts what it drops
      (``transport == "unreachable"``).

    ``channel.handle(transport=name)`` always sends through ``name``, even
    in the channel's process. A forked child may use an inherited channel as
    a handle.
    """

    __slots__ = (
        "__weakref__",
        "_addresses",
        "_channel",
        "_copy",
        "_copy_pid",
        "_forced",
        "_owner",
        "_sender",
        "_seq",
        "_token",
    )

    def __init__(
        self,
        token: str,
        addresses: Mapping[str, Any],
        *,
        channel: Any = None,
        transport: str | None = None,
        owner: str | None = None,
    ) -> None:
        self._token = token
        self._owner = owner or f"MetricsChannel {token}"
        self._addresses = dict(addresses)
        self._forced = transport
        self._channel = channel if transport is None else None
        self._sender: Sender | None = None
        self._copy_pid: int | None = None  # the process _copy and _seq belong to
        self._copy = ""
        self._seq = 0

    def _send_through(self) -> Sender:
        sender = self._sender
        if sender is None:
            sender = self._sender = make_sender(self._addresses, self._forced, self._owner)
        return sender

    def submit_metrics(self, metrics: Mapping[str, Any], step: int | None = None, *, namespace: str = "") -> None:
        """Submits one payload to the channel; returns at once.

        Same arguments and values as :meth:`MetricsChannel.submit_metrics`.

        Raises:
            TypeError: if ``metrics`` is not a mapping from ``str`` names to
                loggable values, or ``namespace`` is not a ``str``.
        """
        channel = self._channel
        if channel is not None:
            channel.submit_metrics(metrics, step, namespace=namespace)
            return
        self._send_through().send(Payload(namespace, check_metrics(metrics, namespace, "MetricsHandle"), step))

    def submit_window(self, window: Window) -> None:
        """Submits one window of an observer's copy, numbered (``copy``, ``seq``) when sent from another process."""
        channel = self._channel
        if channel is not None:
            channel.submit_window(window)
            return
        check_metrics(window.metrics, window.namespace, "MetricsHandle")
        if self._copy_pid != os.getpid():  # who sends from this process: host/pid, and its Ray node
            copy = f"{socket.gethostname()}/pid {os.getpid()}"
            ray = sys.modules.get("ray")
            with contextlib.suppress(Exception):  # a Ray that cannot say: the host and pid name the copy
                if ray is not None and ray.is_initialized():
                    copy += f"/node {ray.get_runtime_context().get_node_id()[:12]}"
            self._copy_pid, self._copy, self._seq = os.getpid(), copy, 0
        self._seq += 1
        self._send_through().send(window.numbered(self._copy, self._seq))

    def flush(self, timeout: float | None = None) -> bool:
        """Pushes what the handle holds towards the channel.

        In the channel's process, this is :meth:`MetricsChannel.flush`.
        Elsewhere it sends what the handle holds back, without waiting for
        the owner to log; call it before a worker exits.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None`` (until its queue is sent).

        Returns:
            ``True`` if nothing is left in the handle.
        """
        if self._channel is not None:
            forwarder = self._forwarder()
            if forwarder is not None:  # another process: what it holds, not what was lost
                return forwarder.send_held(timeout)
            return self._channel.flush(timeout)
        if self._sender is None:
            return True
        return self._sender.flush(timeout)

    def _forwarder(self) -> Any:
        """The channel's stand-in (:class:`~.owner.Forwarder`) in a forked child that inherited it."""
        channel = self._channel
        state = None if channel is None else channel._state
        return None if state is None or isinstance(state, Owner) else state

    @property
    def transport(self) -> str:
        """How payloads travel: ``"local"`` in the channel's process, else the transport's name."""
        if self._channel is not None:
            forwarder = self._forwarder()
            return "local" if forwarder is None else forwarder.transport
        return self._send_through().name

    @property
    def address(self) -> Any:
        """The address the handle's transport sends to (``None`` in the channel's process)."""
        if self._channel is not None:
            forwarder = self._forwarder()
            return None if forwarder is None else forwarder.address
        return self._addresses.get(self.transport)

    @property
    def dropped(self) -> int:
        """Payloads this handle dropped in transit (owner gone, unpicklable, too large).

        ``0`` in the channel's process, where the channel counts its drops.
        """
        return self._count("dropped")

    @property
    def coalesced(self) -> int:
        """Payloads merged into the handle's queue while the owner's was full."""
        return self._count("coalesced")

    def _count(self, key: str) -> int:
        forwarder = self._forwarder()
        if forwarder is not None:
            return forwarder.health()[key]
        return 0 if self._sender is None else getattr(self._sender, key)

    def __reduce__(self) -> tuple[Any, ...]:
        wing = WINGS.get(self._token)
        if wing is not None:  # in the owner's process: receivers started since (Ray) count too
            self._addresses = wing.current_addresses(self._addresses)
        return _rebuild_handle, (self._token, self._addresses, self._forced, self._owner)

    def __repr__(self) -> str:
        transport = self.transport
        if transport == "local":
            return f"{type(self).__name__}(transport='local')"
        return f"{type(self).__name__}(transport={transport!r}, address={self.address!r})"


def _rebuild_handle(token: str, addresses: Mapping[str, Any], transport: Any, owner: Any) -> MetricsHandle:
    channel = OWNERS.get(token)
    return MetricsHandle(token, addresses, channel=channel, transport=transport, owner=owner)
