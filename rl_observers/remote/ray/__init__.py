"""Ray, both ways: observer copies into Ray actors, and their windows back to the owner.

The one place that knows Ray (importing it never imports Ray). Out:
:mod:`~rl_observers.remote.ray.observed`. Back, from any node
(:mod:`~rl_observers.remote.ray.transport`): the workers'
:mod:`~rl_observers.remote.ray.sender`, the owner's ingest actor
(:mod:`~rl_observers.remote.ray.ingest`) and
:mod:`~rl_observers.remote.ray.receiver`.
"""

from __future__ import annotations

from rl_observers.remote.ray.receiver import RayReceiver
from rl_observers.remote.ray.sender import RaySender
from rl_observers.remote.ray.transport import make_receiver, make_sender, reachable

__all__ = ["RayReceiver", "RaySender", "make_receiver", "make_sender", "reachable"]
