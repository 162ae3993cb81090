"""Namespace claims: one observer per ``<name>/`` on a logger, even through two channels.

Step of the flow: **observer → channel** (source → observer → channel →
logger). A :class:`~rl_observers.LoggerObserver` claims its namespace when it
is attached and frees it when it is removed or its source shuts down, so two
observers on one logger never write into one namespace without being told.
Claims are process-global, keyed by the channel's logger (or by the channel
when its logger cannot be a weak key), and hold neither the logger nor the
observer alive.

Examples:
    >>> import tempfile
    >>> from rl_observers import MetricsChannel
    >>> from rl_observers.logging.namespaces import claim, release
    >>> from torchrl.record import CSVLogger
    >>> channel = MetricsChannel(CSVLogger(exp_name="names", log_dir=tempfile.mkdtemp()))
    >>> class Owner: ...
    >>> first, second = Owner(), Owner()
    >>> claim(channel, "collector", first)
    >>> claim(channel, "collector", second)
    Traceback (most recent call last):
    ...
    ValueError: LoggerObserver: the namespace 'collector' is already used on this logger by ...
    >>> release(channel, "collector", first)
    >>> claim(channel, "collector", second)
    >>> channel.close()
    True
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["claim", "release"]

# name -> the observer using it, per logger
_NAMES: weakref.WeakKeyDictionary[Any, weakref.WeakValueDictionary[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def _names_on(channel: Any) -> Any:
    """What namespaces are unique on: the channel's logger, or the channel if it cannot be a key."""
    logger = channel.logger
    try:
        weakref.ref(logger)
        hash(logger)
    except TypeError:
        return channel
    return logger


def claim(channel: Any, name: str, owner: Any, *, hint: str = "") -> None:
    """Takes ``name`` on ``channel``'s logger for ``owner``; refuses a name another owner holds there.

    Raises:
        ValueError: another live owner holds ``name`` on that logger.
    """
    with _LOCK:
        taken = _NAMES.setdefault(_names_on(channel), weakref.WeakValueDictionary())
        other = taken.get(name)
        if other is not None and other is not owner:
            raise ValueError(
                f"LoggerObserver: the namespace {name!r}{hint} is already used on this "
                f"logger by {other!r}; pass name= to tell them apart, e.g. "
                f"name={name + '_2'!r}."
            )
        taken[name] = owner


def release(channel: Any, name: str, owner: Any) -> None:
    """Frees ``name`` on ``channel``'s logger if ``owner`` holds it."""
    with _LOCK:
        taken = _NAMES.get(_names_on(channel))
        if taken is not None and taken.get(name) is owner:
            del taken[name]
