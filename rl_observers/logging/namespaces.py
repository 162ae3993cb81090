"""Namespace claims: one observer per ``<name>/`` on a logger, even through two channels.

Claims are process-global, keyed by the channel's logger (or the
channel), and keep neither the logger nor the observer alive.

Examples:
    >>> import tempfile, weakref
    >>> from rl_observers import MetricsChannel
    >>> from rl_observers.logging.namespaces import Namespace
    >>> from torchrl.record import CSVLogger
    >>> channel = MetricsChannel(CSVLogger(exp_name="names", log_dir=tempfile.mkdtemp()))
    >>> class Owner: ...
    >>> first, second = Owner(), Owner()
    >>> ours, theirs = (Namespace(weakref.ref(channel), given=True) for _ in range(2))
    >>> ours.claim("collector", first)
    'collector'
    >>> theirs.claim("collector", second)
    Traceback (most recent call last):
    ...
    ValueError: LoggerObserver: the namespace 'collector' is already used on this logger by ...
    >>> ours.release("collector", first)
    >>> theirs.claim("collector", second)
    'collector'
    >>> channel.close()
    True
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["Namespace"]

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


class Namespace:
    """One observer's hold on its namespace (the channel held weakly): taken at attach, freed at removal or shutdown, taken back on reuse."""

    __slots__ = ("channel_ref", "given", "held")

    def __init__(self, channel_ref: Any, given: bool) -> None:
        self.channel_ref = channel_ref  # a weak reference to the channel, or None (a handle)
        self.given = given  # the user passed name=
        self.held = False

    def _channel(self) -> Any:
        return None if self.channel_ref is None else self.channel_ref()

    def claim(self, name: str, owner: Any) -> str:
        """Takes ``name`` on the channel's logger for ``owner`` and returns it; a ``ValueError`` if another live owner holds it."""
        channel = self._channel()
        if channel is not None:
            with _LOCK:
                taken = _NAMES.setdefault(_names_on(channel), weakref.WeakValueDictionary())
                other = taken.get(name)
                if other is not None and other is not owner:
                    hint = "" if self.given else " (the default for this kind of target)"
                    raise ValueError(
                        f"LoggerObserver: the namespace {name!r}{hint} is already used on this "
                        f"logger by {other!r}; pass name= to tell them apart, e.g. "
                        f"name={name + '_2'!r}."
                    )
                taken[name] = owner
        self.held = True
        return name

    def claim_again(self, name: str, owner: Any, what: str) -> None:
        """Takes ``name`` back for ``owner`` if it was freed, its source (``what``) being used after its shutdown."""
        if self.held or self.channel_ref is None:
            return
        try:
            self.claim(name, owner)
        except ValueError:
            raise ValueError(
                f"LoggerObserver {name!r}: {what} is used again after shutdown(), which freed "
                f"the namespace {name!r}, and another observer now uses it on this logger; "
                "this window is not logged. Remove this observer, or attach one of them "
                "with another name=."
            ) from None

    def __getstate__(self) -> tuple[bool, bool]:
        return self.given, self.held  # a copy elsewhere has no channel here

    def __setstate__(self, state: tuple[bool, bool]) -> None:
        self.channel_ref = None
        self.given, self.held = state

    def release(self, name: str | None, owner: Any) -> None:
        """Frees ``name`` if ``owner`` holds it."""
        self.held = False
        channel = self._channel()
        if channel is not None and name is not None:
            with _LOCK:
                taken = _NAMES.get(_names_on(channel))
                if taken is not None and taken.get(name) is owner:
                    del taken[name]
