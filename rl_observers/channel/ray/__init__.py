"""The Ray transport: reaches the channel's owner from any node of a Ray cluster.

One transport, one folder; the flow is described in
:mod:`~rl_observers.channel.ray.transport`:

- :mod:`~rl_observers.channel.ray.transport`: registration, ``make_sender``, ``make_receiver``;
- :mod:`~rl_observers.channel.ray.sender`: :class:`RaySender`, the workers' side;
- :mod:`~rl_observers.channel.ray.actors`: the per-node relay, the owner's ingest and the
  bounded forwarder both push through;
- :mod:`~rl_observers.channel.ray.receiver`: :class:`RayReceiver`, the owner's side.

Importing it never imports Ray.
"""

from __future__ import annotations

from rl_observers.channel.ray.receiver import RayReceiver
from rl_observers.channel.ray.sender import RaySender
from rl_observers.channel.ray.transport import make_receiver, make_sender, reachable

__all__ = ["RayReceiver", "RaySender", "make_receiver", "make_sender", "reachable"]
