"""What the logging package uses of a channel beyond its public contract.

Step of the flow: **channel** (source → observer → channel → logger). A
:class:`~.channel.MetricsChannel`'s public members are the Channel contract
(submit, flush, close, handle, health, ...). The few things only
:mod:`rl_observers.logging` needs (owner-side routers, close callbacks, the
record of copies sending from other processes) are reached as
``channel._logging``, a :class:`LoggingSide` over the channel's state in this
process: internal API, not for users.

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
    """The private interface of one channel for :mod:`rl_observers.logging`, in this process.

    Made anew at each ``channel._logging`` (it holds the channel's state,
    never the channel): an :class:`~.owner.Owner` where the channel was
    created, its wing's stand-in in a forked child, where most of these
    calls do nothing.
    """

    __slots__ = ("_state",)

    def __init__(self, state: Any) -> None:
        self._state = state

    def add_router(self, kind: type[Payload], router: Router) -> None:
        """Hands the payloads of class ``kind`` to ``router`` instead of the logger.

        The router runs where entries are delivered (the channel's thread):
        ``router.route(payload)`` returns the rows ``(namespace, metrics,
        step)`` to log now, and ``router.finish()`` the last ones when the
        channel closes (:mod:`~rl_observers.remote.aggregate` registers its
        merge of copies' windows for every channel with
        :func:`~rl_observers.channel.delivery.register_router`). Does nothing
        in a process that does not own the channel.
        """
        state = self._state
        if isinstance(state, Owner):
            state.delivery.add_router(kind, router)

    def add_watcher(self, watch: Callable[..., Any]) -> None:
        """Calls ``watch(namespace, metrics, logged, step)`` with every row the channel delivers.

        On the channel's thread, after the row is logged (what it raises
        counts as a sink error): ``metrics`` holds the row's partials,
        ``logged`` its logger names and values.

        Raises:
            ValueError: in a process that does not own the channel (rows are delivered elsewhere).
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
        """Whether a payload that is ``wanted`` waits for delivery (or is being delivered).

        Payloads that handles in other processes sent are not read by this
        call (see :meth:`receive`). Always ``False`` in a process that does
        not own the channel.
        """
        state = self._state
        return isinstance(state, Owner) and state.queue.has_pending(wanted)

    def receive(self, timeout: float | None = None) -> None:
        """Queues what handles in other processes have sent so far, without delivering it.

        ``timeout``: the most seconds to wait for a receiver busy in another thread.
        """
        state = self._state
        if isinstance(state, Owner):
            state.poll_remote(None if timeout is None else time.monotonic() + timeout)

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        """Registers ``callback()`` to run once when the channel closes, before its final flush.

        Producers use it to submit their last, partial window (an observer's
        ``log_on_close``). Callbacks run in the thread that calls ``close``
        (or at interpreter exit), in registration order; an error is handled
        by the channel's ``on_error`` policy. A bound method is held weakly.
        """
        self._state.add_close_callback(callback)

    def copies_attached(self, feeder: Any, description: str) -> None:
        """Notes that copies of ``feeder`` run in other processes or actors and send here.

        Until :meth:`copies_gone` is called for it, the channel's ``close``
        warns, naming ``description`` (e.g. ``"LoggerObserver 'collector' on
        a MultiSyncCollector"``), and returns ``False``: a closed channel
        cannot receive what those copies send when their source shuts down.
        The feeder is held weakly.
        """
        note = getattr(getattr(self._state, "wing", None), "copies_attached", None)
        if note is not None:
            note(feeder, description)

    def copies_expected(self, feeder: Any, workers: Any) -> None:
        """Notes the workers ``feeder``'s copies were attached in (each ``Window.worker``): each must report.

        A copy expected here and never heard from when its observer's copies
        are gone (its worker killed before its first window arrived) is
        reported and counted in ``health()["copies_lost"]``.
        """
        note = getattr(getattr(self._state, "wing", None), "copies_expected", None)
        if note is not None:
            note(feeder, workers)

    def copies_gone(self, feeder: Any) -> None:
        """Notes that ``feeder``'s copies are gone (removed, or their source shut down)."""
        note = getattr(getattr(self._state, "wing", None), "copies_gone", None)
        if note is not None:
            note(feeder)
