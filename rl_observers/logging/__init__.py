"""Logging: when observers submit their metrics, and how workers' windows merge at the owner.

Step of the flow: **observer → channel → logger** (source → observer →
channel → logger). Modules, in the order a window meets them:

- :mod:`~rl_observers.schedule`: when torchrl's ``Every`` is due;
- :mod:`~rl_observers.logging.defaults`: what an observer gets when not told (:func:`default_metrics`, :func:`default_schedule`) and the checks of what it is told;
- :mod:`~rl_observers.logging.observer`: :class:`LoggerObserver`, one class: fold, schedule, submit, its checkpoint and its copies' side (:mod:`~rl_observers.logging.attach`: ``attach_logger``);
- :mod:`~rl_observers.logging.namespaces`: one observer per namespace on a logger;
- :mod:`~rl_observers.logging.resume`: steps on the source's own axis, and what a saved state must fit;
- :mod:`~rl_observers.logging.copies`: where copies away from the channel plug in. Their side
  is :mod:`rl_observers.remote`'s, which imports this package, never the reverse: copies
  contribute windows (:mod:`~rl_observers.remote.contributions`) that the owner merges
  (:mod:`~rl_observers.remote.aggregate`).
"""

from __future__ import annotations

from rl_observers.logging.attach import attach_logger
from rl_observers.logging.defaults import default_metrics, default_schedule
from rl_observers.logging.observer import LoggerObserver

__all__ = ["LoggerObserver", "attach_logger", "default_metrics", "default_schedule"]
