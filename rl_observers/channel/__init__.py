"""The local channel: payloads, the bounded queue, the delivery thread; knows nothing of RL, workers or copies."""

from __future__ import annotations

from rl_observers.channel.channel import MetricsChannel, register_wing
from rl_observers.channel.delivery import Delivery, Router, register_router
from rl_observers.channel.queue import PendingQueue

__all__ = ["Delivery", "MetricsChannel", "PendingQueue", "Router", "register_router", "register_wing"]
