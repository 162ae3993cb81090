"""The local channel's parts: payloads, the bounded queue, the delivery thread.

Step **channel → logger** of the flow. Local to one process; knows nothing
of RL, workers or copies. A payload maps names to numbers or to mergeable
partials (``merge(other)``, ``finalize() -> dict[str, float]``).
"""

from __future__ import annotations

from rl_observers.channel.channel import MetricsChannel, register_wing
from rl_observers.channel.delivery import Delivery, Router, register_router
from rl_observers.channel.queue import PendingQueue

__all__ = ["Delivery", "MetricsChannel", "PendingQueue", "Router", "register_router", "register_wing"]
