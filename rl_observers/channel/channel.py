"""MetricsChannel: the bounded, never-blocking way from observers to a logger.

The public face and the registry of live channels; the work is the
:class:`~.owner.Owner`'s, and other processes are the registered wing's.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from torchrl._utils import logger as torchrl_logger

from rl_observers import lifecycle
from rl_observers.channel.delivery import counts_line
from rl_observers.channel.logging_side import LoggingSide
from rl_observers.channel.owner import Owner, Wing, check_alive
from rl_observers.channel.payload import Payload, check_metrics
from rl_observers.observer import OnError

__all__ = ["MetricsChannel", "register_wing"]

# The most seconds the interpreter's exit waits for live channels to deliver.
_EXIT_TIMEOUT = 5.0

# Process-local registry of live channels, by token (closed at exit, told about forks).
_CHANNELS: weakref.WeakValueDictionary[str, MetricsChannel] = weakref.WeakValueDictionary()
# Shared channels of MetricsChannel.for_logger, by id(logger). A channel holds
# its logger, so the id cannot be reused while the entry lives.
_SHARED: weakref.WeakValueDictionary[int, MetricsChannel] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()
_WING: list[Callable[[Owner, Any], Wing]] = []


def register_wing(make_wing: Callable[[Owner, Any], Wing]) -> None:
    """Has every channel created from now on do ``make_wing(owner, channel)``'s work for other processes."""
    _WING[:] = [make_wing]


class MetricsChannel:
    """A bounded, never-blocking channel from metric producers to a torchrl logger.

    :meth:`submit_metrics` only queues; the channel's daemon thread makes the
    blocking ``logger.log_metrics`` calls, as ``"<namespace>/<name>"``. On
    overflow a payload merges into the newest pending entry of its namespace, or
    the oldest entry is dropped, both counted in :meth:`health`. The channel
    never shuts the logger down. See :ref:`channel`.

    Args:
        logger (Logger): any torchrl
            :class:`~torchrl.record.loggers.common.Logger` or logger service, or
            any object with ``log_metrics(metrics, step=None)`` or
            ``log_scalar(name, value, step)``; not one already shut down.

    Keyword Args:
        capacity (int, optional): the most entries pending, at least 1.
            Defaults to ``1024``.
        on_error (str, optional): when the logger (or a partial) raises:
            ``"warn"`` (default) warns once per failure streak, ``"raise"``
            raises the first error from the next :meth:`flush`, :meth:`step`
            or :meth:`close`, ``"ignore"`` only counts it.
        name (str, optional): the namespace of the health metrics. Defaults
            to ``"channel"``.
        background (bool, optional): deliver from a daemon thread (default);
            ``False`` delivers only in :meth:`step` and :meth:`flush`, in the
            calling thread (deterministic tests).
        health_interval (float, optional): the least seconds between two
            health reports; ``None`` turns them off. Defaults to ``1.0``.
        log_health (bool, optional): log the health counters even when all is
            well (by default only once something is wrong). Defaults to
            ``False``.

    Examples:
        >>> import tempfile
        >>> from torchrl.record import CSVLogger
        >>> from rl_observers import MetricsChannel
        >>> logger = CSVLogger(exp_name="channel_demo", log_dir=tempfile.mkdtemp())
        >>> channel = MetricsChannel(logger, background=False)
        >>> channel.submit_metrics({"loss": 0.5, "lr": 1e-3}, step=10, namespace="train")
        >>> channel.step()
        1
        >>> logger.experiment.scalars["train/loss"]
        [(10, 0.5)]
        >>> channel.close()
        True

        With the default background thread, :meth:`flush` waits for delivery:

        >>> with MetricsChannel(logger) as channel:
        ...     channel.submit_metrics({"reward": 1.0}, step=3, namespace="collector")
        ...     channel.flush(timeout=10.0)
        True
        >>> logger.experiment.scalars["collector/reward"]
        [(3, 1.0)]
    """

    __slots__ = ("__weakref__", "_finalizer", "_losses_told", "_on_error", "_state", "_token")

    def __init__(
        self,
        logger: Any,
        *,
        capacity: int = 1024,
        on_error: OnError = "warn",
        name: str = "channel",
        background: bool = True,
        health_interval: float | None = 1.0,
        log_health: bool = False,
    ) -> None:
        self._token = uuid.uuid4().hex
        self._on_error = on_error
        self._losses_told: tuple[int, ...] = ()
        make_wing = _WING[0] if _WING else lambda owner, channel: Wing()
        owner = Owner(
            logger,
            self._token,
            capacity=capacity,
            on_error=on_error,
            name=name,
            background=background,
            health_interval=health_interval,
            log_health=log_health,
            make_wing=lambda owner: make_wing(owner, self),
        )
        self._state: Any = owner
        self._finalizer = weakref.finalize(self, owner.release)
        self._finalizer.atexit = False
        _CHANNELS[self._token] = self

    @classmethod
    def for_logger(cls, logger: Any, **kwargs: Any) -> MetricsChannel:
        """Returns the channel shared by everything that logs to ``logger`` (created with the first call's ``kwargs``).

        Examples:
            >>> import tempfile
            >>> from torchrl.record import CSVLogger
            >>> from rl_observers import MetricsChannel
            >>> logger = CSVLogger(exp_name="shared", log_dir=tempfile.mkdtemp())
            >>> channel = MetricsChannel.for_logger(logger, background=False)
            >>> MetricsChannel.for_logger(logger) is channel
            True
            >>> channel.close()
            True
            >>> MetricsChannel.for_logger(logger, background=False) is channel
            False
        """
        check_alive(logger)
        with _REGISTRY_LOCK:
            channel = _SHARED.get(id(logger))
            if channel is not None and channel.logger is logger and not channel.closed:
                return channel
            channel = cls(logger, **kwargs)
            _SHARED[id(logger)] = channel
            return channel

    def submit_metrics(self, metrics: Mapping[str, Any], step: int | None = None, *, namespace: str = "") -> None:
        """Queues one payload for logging and returns at once, never calling the logger.

        After :meth:`close` it is dropped and counted; an empty mapping is ignored.

        Args:
            metrics (Mapping[str, float | int | partial]): names to real numbers,
                one-element tensors or arrays, or mergeable partials (not to be
                mutated afterwards).
            step (int, optional): the namespace's step. Defaults to ``None``.

        Keyword Args:
            namespace (str, optional): prefix of the logged names, also the unit
                of coalescing. Defaults to ``""``.

        Raises:
            TypeError: if a name or ``namespace`` is not a ``str``, or a value is not one of the above.
        """
        self._state.submit(Payload(namespace, check_metrics(metrics, namespace, "MetricsChannel"), step))

    def submit_window(self, window: Payload) -> None:
        """Queues one window of an observer's copy for its class's router; never blocks.

        Raises:
            TypeError: if the window's metrics are not loggable values.
        """
        check_metrics(window.metrics, window.namespace, "MetricsChannel")
        self._state.submit(window)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything submitted anywhere before this call was delivered, failed or dropped.

        With ``background=False`` delivery runs in the calling thread, unbounded by ``timeout``.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None`` (no limit).

        Returns:
            ``True`` if everything was processed and, since the previous
            :meth:`flush` or :meth:`close`, nothing failed and nothing was lost;
            ``False`` on timeout, a failure or a loss (see :meth:`health`).

        Raises:
            Exception: with ``on_error="raise"``, the first stored logger error.
        """
        return self._said(self._state.flush(timeout), "flush")

    def step(self) -> int:
        """Delivers every pending entry in the calling thread (``background=False`` only); returns how many.

        Raises:
            RuntimeError: if the channel has a background thread.
            Exception: with ``on_error="raise"``, a stored logger error.
        """
        return self._state.step()

    @property
    def _logging(self) -> LoggingSide:
        """What :mod:`rl_observers.logging` uses beyond the contract (see :mod:`~.logging_side`)."""
        return LoggingSide(self._state)

    def close(self, timeout: float | None = None) -> bool:
        """Runs the close callbacks, flushes, logs health once more and stops; idempotent.

        The logger is left running; later submissions are dropped and counted. Without
        a ``timeout`` it gives up once one logger call has not returned for 30 seconds.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None``.

        Returns:
            ``True`` if everything was delivered and the thread stopped; ``False``
            on timeout, when observers still have copies attached in other
            processes (a warning names them), or when something failed or was lost
            since the previous :meth:`flush` or :meth:`close`.

        Raises:
            Exception: with ``on_error="raise"``, a stored logger error.
        """
        with _REGISTRY_LOCK:
            state = self._state
            if _SHARED.get(id(state.logger)) is self:
                del _SHARED[id(state.logger)]
        return self._said(state.close(timeout), "close")

    def _said(self, result: bool, what: str) -> bool:
        """``result``, warned about when ``False`` and the loss is not just a slow flush."""
        if not result and self._on_error != "ignore":
            counts = self.health()
            keys = self._state.loss_keys
            losses = tuple(counts.get(key, 0) for key in keys)
            told, self._losses_told = self._losses_told, losses
            if what == "flush" and losses == (told or (0,) * len(keys)):
                return result
            torchrl_logger.warning(
                f"MetricsChannel {self.name!r}: {what}() returns False: since the previous "
                f"flush() or close(), something failed or was not delivered ({counts_line(counts)}"
                + ("; the timeout expired with entries pending" if counts.get("pending") else "")
                + "). See channel.health() and the warnings above."
            )
        return result

    def health(self) -> dict[str, int]:
        """Returns the channel's counters (the table is on the :ref:`channel` page).

        ``submitted == logged + pending + coalesced + dropped + sink_errors`` at any moment.
        """
        return self._state.health()

    def handle(self, *, transport: str | None = None) -> Any:
        """Returns a picklable, non-owning :class:`~rl_observers.MetricsHandle` for workers and actors.

        The first call starts the receivers. In this process the handle submits
        directly; elsewhere it sends through the first reachable transport.

        Keyword Args:
            transport (str, optional): a registered transport to use even in this
                process (``"socket"``, ``"ray"``, ...). Defaults to ``None``.

        Raises:
            RuntimeError: if the channel is closed.
            ValueError: if ``transport`` names no registered transport.

        Examples:
            >>> import pickle
            >>> import tempfile
            >>> from torchrl.record import CSVLogger
            >>> from rl_observers import MetricsChannel
            >>> logger = CSVLogger(exp_name="handle_demo", log_dir=tempfile.mkdtemp())
            >>> channel = MetricsChannel(logger, background=False)
            >>> handle = pickle.loads(pickle.dumps(channel.handle()))
            >>> handle.submit_metrics({"frames": 100}, step=1, namespace="worker_0")
            >>> channel.step()
            1
            >>> logger.experiment.scalars["worker_0/frames"]
            [(1, 100.0)]
            >>> channel.close()
            True
        """
        state = self._state
        if state.closed:
            raise RuntimeError(f"MetricsChannel {self.name!r} is closed; it gives no new handles.")
        return state.handle(self, transport)

    @property
    def logger(self) -> Any:
        """The logger this channel writes to (not owned by the channel)."""
        return self._state.logger

    @property
    def name(self) -> str:
        """The namespace of the channel's health metrics."""
        return self._state.name

    @property
    def capacity(self) -> int:
        """The most entries pending at once."""
        return self._state.capacity

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._state.closed

    def __enter__(self) -> MetricsChannel:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self._state
        return (
            f"{type(self).__name__}(name={state.name!r}, logger={type(state.logger).__name__}, "
            f"capacity={state.capacity}, closed={state.closed})"
        )

    def _after_fork_in_child(self) -> None:
        state = self._state
        if isinstance(state, Owner):
            self._finalizer.detach()
            self._state = state.in_forked_child()


def _close_at_exit() -> None:
    """Closes the live channels at exit (daemon threads would die with entries pending), within ``_EXIT_TIMEOUT`` seconds in all."""
    deadline = time.monotonic() + _EXIT_TIMEOUT
    for channel in list(_CHANNELS.values()):
        state = channel._state
        if not isinstance(state, Owner) or state.pid != os.getpid() or state.close_requested:
            continue
        try:
            state.close(max(0.0, deadline - time.monotonic()), at_exit=True)
        except Exception:  # on_error="raise": nobody is left to catch it
            pass


def _after_fork_in_child() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for channel in list(_CHANNELS.values()):
        channel._after_fork_in_child()


lifecycle.at_exit(_close_at_exit, lifecycle.CHANNELS)
lifecycle.after_fork_in_child(_after_fork_in_child)
