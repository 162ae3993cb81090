"""Logging: when observers submit their metrics, and how workers' windows merge at the owner.

Step **observer → channel → logger** of the flow: :class:`LoggerObserver`
folds, schedules and submits; :mod:`~rl_observers.logging.defaults` says
what it gets when not told; copies in other processes plug in through
:mod:`~rl_observers.logging.copies`.
"""

from __future__ import annotations

from rl_observers.logging.attach import attach_logger
from rl_observers.logging.defaults import default_metrics, default_schedule
from rl_observers.logging.observer import LoggerObserver

__all__ = ["LoggerObserver", "attach_logger", "default_metrics", "default_schedule"]
