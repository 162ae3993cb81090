"""Ray, both ways: observer copies into Ray actors, and their windows back to the owner.

The one place that knows Ray. Out: :mod:`~rl_observers.remote.ray.observed`
ships observers into ``RayCollector``'s remote collectors and a
``RayReplayBuffer``'s actor. Back: the Ray transport reaches the channel's
owner from any node of a Ray cluster, merged per node on the way (the flow
is described in :mod:`~rl_observers.remote.ray.transport`):

- :mod:`~rl_observers.remote.ray.transport`: registration, ``make_sender``, ``make_receiver``;
- :mod:`~rl_observers.remote.ray.sender`: :class:`RaySender`, the workers' side;
- :mod:`~rl_observers.remote.ray.relay`: the per-node relay, the owner's ingest and the
  bounded forwarder both push through;
- :mod:`~rl_observers.remote.ray.receiver`: :class:`RayReceiver`, the owner's side.

Importing it never imports Ray.
"""

from __future__ import annotations

from rl_observers.remote.ray.receiver import RayReceiver
from rl_observers.remote.ray.sender import RaySender
from rl_observers.remote.ray.transport import make_receiver, make_sender, reachable

__all__ = ["RayReceiver", "RaySender", "make_receiver", "make_sender", "reachable"]
