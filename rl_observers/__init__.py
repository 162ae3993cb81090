"""rl_observers: event observers and data metrics for TorchRL collectors and replay buffers.

``import rl_observers`` adds ``add_observer``, ``remove_observer`` and
``observers`` to every torchrl collector and replay buffer.
"""

from __future__ import annotations

from rl_observers import signals
from rl_observers.observer import ON_ERROR_POLICIES, Observer, ObserverHandle, OnError
from rl_observers.targets import install as _install

_install()

__version__ = "0.1.0"

__all__ = [
    "ON_ERROR_POLICIES",
    "Observer",
    "ObserverHandle",
    "OnError",
    "signals",
]
