"""Namespace claims: one observer per ``<name>/`` on a logger, even through two channels.

Claims are process-global, keyed by the channel's logger (or the
channel), and keep neither the logger nor the observer alive.

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

__all__ = ["Namespace", "claim", "claim_again", "release"]

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
    """Takes ``name`` on ``channel``'s logger for ``owner``; a ``ValueError`` if another live owner holds it."""
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


def claim_again(channel: Any, name: str, owner: Any, what: str) -> None:
    """Takes ``name`` back for ``owner`` when its source (``what``) is used after its shutdown.

    If another observer took it meanwhile, the window is not logged.

    Raises:
        ValueError: another live owner holds ``name`` on that logger now.
    """
    try:
        claim(channel, name, owner)
    except ValueError:
        raise ValueError(
            f"LoggerObserver {name!r}: {what} is used again after shutdown(), which freed "
            f"the namespace {name!r}, and another observer now uses it on this logger; "
            "this window is not logged. Remove this observer, or attach one of them "
            "with another name=."
        ) from None


class Namespace:
    """One observer's hold on its namespace (the channel held weakly): taken at attach, freed at removal or shutdown, taken back on reuse."""

    __slots__ = ("channel_ref", "given", "held")

    def __init__(self, channel_ref: Any, given: bool) -> None:
        self.channel_ref = channel_ref  # a weak reference to the channel, or None (a handle)
        self.given = given  # the user passed name=
        self.held = False

    def claim(self, name: str, owner: Any) -> str:
        """Takes ``name`` for ``owner`` and returns it; refuses a name another owner holds there."""
        channel = None if self.channel_ref is None else self.channel_ref()
        if channel is not None:
            claim(channel, name, owner, hint="" if self.given else " (the default for this kind of target)")
        self.held = True
        return name

    def claim_again(self, name: str, owner: Any, what: str) -> None:
        """Takes ``name`` back if it was freed (see :func:`claim_again`)."""
        if self.held or self.channel_ref is None:
            return
        channel = self.channel_ref()
        if channel is not None:
            claim_again(channel, name, owner, what)
        self.held = True

    def __getstate__(self) -> tuple[bool, bool]:
        return self.given, self.held  # a copy elsewhere has no channel here

    def __setstate__(self, state: tuple[bool, bool]) -> None:
        self.channel_ref = None
        self.given, self.held = state

    def release(self, name: str | None, owner: Any) -> None:
        """Frees ``name`` if ``owner`` holds it."""
        self.held = False
        channel = None if self.channel_ref is None else self.channel_ref()
        if channel is not None and name is not None:
            release(channel, name, owner)
