"""MetricsHandle: a picklable, non-owning way to submit to a channel from anywhere.

Step of the flow: **observer → channel** (source → observer → channel →
logger), for observers running away from the channel's owner. In the
owner's process a handle submits to the channel directly; elsewhere it
sends through a transport (:mod:`rl_observers.remote.transport`) chosen
when it is first used.
"""

from __future__ import annotations

import os
import socket
import sys
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from rl_observers.channel.owner import Owner
from rl_observers.channel.payload import Payload, check_metrics
from rl_observers.remote.transport import Sender, make_sender
from rl_observers.remote.window import Window

__all__ = ["MetricsHandle"]


class _Channel(Protocol):
    """What a handle uses of the :class:`~rl_observers.MetricsChannel` it refers to.

    A protocol: the channel is local (:mod:`rl_observers.channel`) and knows no handle.
    """

    _state: Any

    def submit_metrics(self, metrics: Mapping[str, Any], step: int | None = None, *, namespace: str = "") -> None: ...

    def submit_window(self, window: Window) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...



# Channels owned by this process, by token: an unpickled handle whose token is
# found here submits to the channel itself. A forked child forgets them.
OWNERS: weakref.WeakValueDictionary[str, _Channel] = weakref.WeakValueDictionary()
# Their wings (:class:`~.owner.RemoteWing`), which know the receivers' addresses.
WINGS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class MetricsHandle:
    """A picklable, non-owning reference to a :class:`~rl_observers.MetricsChannel`.

    Get one from :meth:`MetricsChannel.handle` and send it to workers:
    multiprocessing workers (fork or spawn), Ray actors on the same machine.
    It has the channel's :meth:`submit_metrics` signature and never blocks
    nor raises because of the transport.

    - In the channel's process, it submits to the channel directly and keeps
      the channel alive (it never closes it: a channel referenced by nobody
      but its handles is still usable, and is stopped when the last one goes).
    - In another process, it sends through the first reachable transport
      of its channel (:attr:`transport`), chosen at its first use there:
      a bounded queue that coalesces per namespace while the transport is
      full (:class:`~rl_observers.remote.transport.Outbox`). What it loses
      (owner gone, a payload that cannot be pickled or is larger than one
      datagram carries: about 416 KiB with Linux's defaults) is counted in
      :attr:`dropped` and, unless the owner is gone, reported at once to the
      owner's ``health()["remote_dropped"]``.

    A handle made with ``channel.handle(transport=name)`` always sends
    through that transport, even in the channel's own process.

    The handle never closes the channel. A forked child that inherited the
    channel itself (not a handle) may use it too: there it behaves like a
    handle. Unix-domain sockets only reach processes on the same machine;
    elsewhere (another node of a Ray cluster) a process connected to Ray
    sends through Ray (``transport == "ray"``), merged per node on the way.
    A handle that can reach its owner by no transport warns once, naming
    the owner and the reason, and counts what it drops
    (``transport == "unreachable"``).
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
        channel: _Channel | None = None,
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
        """Submits one window of an observer's copy (:class:`~rl_observers.remote.window.Window`).

        Sent from another process, the window is numbered first (its ``copy``
        and ``seq``), so that the owner knows what each copy sent.
        """
        channel = self._channel
        if channel is not None:
            channel.submit_window(window)
            return
        check_metrics(window.metrics, window.namespace, "MetricsHandle")
        if self._copy_pid != os.getpid():
            self._copy_pid, self._copy, self._seq = os.getpid(), _copy_identity(), 0
        self._seq += 1
        self._send_through().send(window.numbered(self._copy, self._seq))

    def flush(self, timeout: float | None = None) -> bool:
        """Pushes what the handle holds towards the channel.

        In the channel's process, this is :meth:`MetricsChannel.flush`. In
        another process, it retries what the handle holds back (its queue
        while the owner's was full, and the count of what it dropped that
        the owner has not heard of); it does not wait
        for the owner to log (a worker cannot see that), so call it before a
        worker exits. A handle a forked child inherited with its channel
        pushes what the channel's stand-in there holds.

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
        """The channel's stand-in (:class:`~.owner.Forwarder`), for a handle a forked child
        inherited with its channel."""
        channel = self._channel
        state = None if channel is None else channel._state
        return None if state is None or isinstance(state, Owner) else state

    @property
    def transport(self) -> str:
        """How payloads travel: ``"local"`` in the channel's process, else the transport's name.

        A handle a forked child inherited with its channel submits to the
        channel's stand-in there, which sends through a transport: its name.
        """
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
        """Payloads this handle dropped in transit (owner gone, payload unpicklable or too large).

        Always ``0`` in the channel's own process, where the channel counts its
        drops. In a forked child that inherited the handle with its channel, what
        the channel's stand-in there dropped (it sends for every such handle).
        """
        forwarder = self._forwarder()
        if forwarder is not None:
            return forwarder.health()["dropped"]
        return self._sender.dropped if self._sender is not None else 0

    @property
    def coalesced(self) -> int:
        """Payloads merged into the handle's queue while the owner's was full.

        In a forked child that inherited the handle with its channel, those of
        the channel's stand-in there.
        """
        forwarder = self._forwarder()
        if forwarder is not None:
            return forwarder.health()["coalesced"]
        return self._sender.coalesced if self._sender is not None else 0

    def __reduce__(self) -> tuple[Any, ...]:
        wing = WINGS.get(self._token)
        if wing is not None:  # in the owner's process: receivers started since (Ray) count too
            self._addresses = wing.current_addresses(self._addresses)
        return (
            _rebuild_handle,
            (self._token, self._addresses, self._forced, self._owner),
        )

    def __repr__(self) -> str:
        transport = self.transport
        if transport == "local":
            return f"{type(self).__name__}(transport='local')"
        return f"{type(self).__name__}(transport={transport!r}, address={self.address!r})"


def _copy_identity() -> str:
    """Who sends from this process, in words: ``host/pid``, and the Ray node where there is one."""
    where = f"{socket.gethostname()}/pid {os.getpid()}"
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            where += f"/node {ray.get_runtime_context().get_node_id()[:12]}"
    except Exception:  # a Ray that cannot say: the host and pid name the copy
        pass
    return where


def _rebuild_handle(
    token: str,
    addresses: Mapping[str, Any],
    transport: str | None = None,
    owner: str | None = None,
) -> MetricsHandle:
    return MetricsHandle(token, addresses, channel=OWNERS.get(token), transport=transport, owner=owner)
