"""What a LoggerObserver says when one of its metric sets raises (each set fails alone).

Examples:
    >>> from rl_observers.logging.failures import public_error_name
    >>> public_error_name(KeyError("reward"))
    'KeyError'
"""

from __future__ import annotations

from typing import Any

from rl_observers.metrics.keys import MissingKeyError

__all__ = ["metric_set_warning", "public_error_name"]


def public_error_name(error: BaseException) -> str:
    """The name a message shows for ``error``: the builtin it stands for when its class is private."""
    cls = type(error)
    if isinstance(error, MissingKeyError) or cls.__name__.startswith("_"):
        cls = next(c for c in cls.__mro__ if c.__module__ == "builtins")
    return cls.__name__


def metric_set_warning(name: str | None, metric_set: Any, where: str, error: BaseException) -> str:
    """The warning when ``metric_set`` of the observer ``name`` starts failing in ``where``."""
    return (
        f"rl_observers: LoggerObserver {name!r}: metric set {metric_set!r} raised in "
        f"{where} ({public_error_name(error)}: {error}). Its metrics are skipped (no rows) until "
        "it succeeds again (reported once per failure streak); the observer's other metric "
        "sets keep logging. Fix the set's configuration, or attach with "
        'on_error="raise" to stop at the error.'
    )
