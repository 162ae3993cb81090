"""The local channel's parts: what a payload is, the bounded queue, the delivery thread.

Step of the flow: **channel → logger** (source → observer → channel → logger).
Everything here is local to one process and knows nothing of reinforcement
learning, of workers or of copies: a payload is a flat mapping from names to
numbers ("gauges") or to mergeable partial statistics (objects with
``merge(other) -> partial``, exact and associative, and ``finalize() ->
dict[str, float]``).

- :mod:`~rl_observers.channel.payload`: what a payload may hold; the one merge rule, ``coalesce``;
- :mod:`~rl_observers.channel.queue`: the bounded, coalescing queue and its counters;
- :mod:`~rl_observers.channel.delivery`: the thread that writes to the logger, its error
  policy and health; owner-side handling plugs in as a :class:`~.delivery.Router`.

- :mod:`~rl_observers.channel.owner`: what a channel owns in its process, and its wing
  (what it does for other processes, which :mod:`rl_observers.remote` plugs in);
- :mod:`~rl_observers.channel.channel`: :class:`MetricsChannel`, the public face.
"""

from __future__ import annotations

from rl_observers.channel.channel import MetricsChannel, register_wing
from rl_observers.channel.delivery import Delivery, Router, register_router
from rl_observers.channel.queue import PendingQueue

__all__ = ["Delivery", "MetricsChannel", "PendingQueue", "Router", "register_router", "register_wing"]
