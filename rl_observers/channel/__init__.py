"""The metrics channel: a bounded, never-blocking layer between observers and a logger.

Step of the flow: **channel** (source → observer → channel → logger).
Observers hand their payloads to :meth:`MetricsChannel.submit_metrics`, which
returns in microseconds whatever the logger is doing. The channel owns one
daemon thread that performs the blocking ``logger.log_metrics`` calls, keeps
at most ``capacity`` pending entries (coalescing or dropping on overflow, and
counting both), and reports its own health as metrics. Workers in other
processes get a picklable :class:`MetricsHandle` from
:meth:`MetricsChannel.handle`; it sends through a transport.

The channel knows nothing about reinforcement learning: a payload is a flat
mapping from names to numbers ("gauges") or to mergeable partial statistics,
that is objects with ``merge(other) -> partial`` (exact and associative) and
``finalize() -> dict[str, float]``.

Modules, in the order a payload meets them:

- :mod:`~rl_observers.channel.payload`: what a payload may hold; the one merge rule, ``coalesce``;
- :mod:`~rl_observers.channel.handle`: :class:`MetricsHandle`, for other processes;
- :mod:`~rl_observers.channel.transport`: the transport interface and registry;
- :mod:`~rl_observers.channel.socket`: the Unix-datagram transport (the owner's machine);
- :mod:`~rl_observers.channel.ray`: the Ray transport (any node), merged per node: its
  :mod:`~rl_observers.channel.ray.sender` (workers), :mod:`~rl_observers.channel.ray.actors`
  (per-node relays, the owner's ingest) and :mod:`~rl_observers.channel.ray.receiver` (the owner);
- :mod:`~rl_observers.channel.meta`: the ``meta`` keys the channel reads (defined once);
- :mod:`~rl_observers.channel.account`: what each observer copy sent and what reached the owner;
- :mod:`~rl_observers.channel.channel`: :class:`MetricsChannel`, the public face;
- :mod:`~rl_observers.channel.owner`: what the channel is in its process (owner) or a forked child;
- :mod:`~rl_observers.channel.queue`: the bounded, coalescing queue and its counters;
- :mod:`~rl_observers.channel.delivery`: the thread that writes to the logger; routers.
"""

from __future__ import annotations

from rl_observers.channel import socket as _socket  # registers the socket transport
from rl_observers.channel.channel import MetricsChannel
from rl_observers.channel.delivery import Router, register_router
from rl_observers.channel.handle import MetricsHandle
from rl_observers.channel.ray import transport as _ray_transport  # registers Ray (never imports it)
from rl_observers.channel.transport import register_transport

del _ray_transport, _socket

__all__ = ["MetricsChannel", "MetricsHandle", "Router", "register_router", "register_transport"]
