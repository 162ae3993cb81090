"""What the logging package uses of a channel beyond its public contract: ``channel._logging`` (internal).

Examples:
    >>> import tempfile
    >>> from rl_observers import MetricsChannel
    >>> from torchrl.record import CSVLogger
    >>> logger = CSVLogger(exp_name="close_demo", log_dir=tempfile.mkdtemp())
    >>> channel = MetricsChannel(logger, background=False)
    >>> channel._logging.add_close_callback(lambda: channel.submit_metrics({"last": 1.0}))
    >>> channel.close()
    True
    >>> logger.experiment.scalars["last"]
    [(0, 1.0)]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rl_observers.channel.delivery import Router
from rl_observers.channel.owner import Owner
from rl_observers.channel.payload import Payload

__all__ = ["LoggingSide"]


class LoggingSide:
    """The private interface of one channel for :mod:`rl_observers.logging`, over its state in this process.

    Most calls do nothing in a forked child's stand-in.
    """

    __slots__ = ("_state",)

    def __init__(self, state: Any) -> None:
        self._state = state

    def add_router(self, kind: type[Payload], router: Router) -> None:
        """Hands the payloads of class ``kind`` to ``router`` instead of the logger (owner only)."""
        state = self._state
        if isinstance(state, Owner):
            state.delivery.add_router(kind, router)

    def add_watcher(self, watch: Callable[..., Any]) -> None:
        """Calls ``watch(namespace, metrics, logged, step)`` on the channel's thread after each row is logged.

        What it raises counts as a sink error.

        Raises:
            ValueError: in a process that does not own the channel.
        """
        state = self._state
        if not isinstance(state, Owner):
            raise ValueError(
                f"MetricsChannel {state.name!r} delivers in another process; watch its rows where "
                "the channel was created."
            )
        state.delivery.watchers = (*state.delivery.watchers, watch)

    def router(self, kind: type[Payload]) -> Router | None:
        """The router of the payloads of class ``kind`` (``None`` if none or not the owner)."""
        state = self._state
        return state.delivery.router(kind) if isinstance(state, Owner) else None

    def has_pending(self, wanted: Callable[[Payload], bool]) -> bool:
        """Whether a ``wanted`` payload waits or is being delivered (not reading other processes')."""
        state = self._state
        return isinstance(state, Owner) and state.queue.has_pending(wanted)

    def receive(self, timeout: float | None = None) -> None:
        """Queues what handles in other processes sent so far, waiting at most ``timeout`` for a busy receiver."""
        state = self._state
        if isinstance(state, Owner):
            state.wing.poll(None if timeout is None else time.monotonic() + timeout)

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        """Registers ``callback()`` to run once at close, before the final flush (held weakly if a bound method)."""
        self._state.add_close_callback(callback)

    def _tell_wing(self, what: str, *args: Any) -> None:
        note = getattr(getattr(self._state, "wing", None), what, None)
        if note is not None:  # a wing that does not track copies, or a forked child's stand-in
            note(*args)

    def copies_attached(self, feeder: Any, description: str) -> None:
        """Notes that copies of ``feeder`` send here from other processes: until :meth:`copies_gone`, ``close`` warns."""
        self._tell_wing("copies_attached", feeder, description)

    def copies_expected(self, feeder: Any, workers: Any) -> None:
        """Notes the workers ``feeder``'s copies were attached in; one never heard from counts in ``copies_lost``."""
        self._tell_wing("copies_expected", feeder, workers)

    def copies_gone(self, feeder: Any) -> None:
        """Notes that ``feeder``'s copies are gone (removed, or their source shut down)."""
        self._tell_wing("copies_gone", feeder)
