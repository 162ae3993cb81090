"""Logging: :class:`LoggerObserver` folds, schedules and submits; :mod:`~.defaults` says what it gets when not told."""

from __future__ import annotations

from rl_observers.logging.attach import attach_logger
from rl_observers.logging.defaults import default_metrics, default_schedule
from rl_observers.logging.observer import LoggerObserver

__all__ = ["LoggerObserver", "attach_logger", "default_metrics", "default_schedule"]
