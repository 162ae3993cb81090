"""What a channel owns in its own process, and where the cross-process :class:`Wing` plugs in.

Step **channel** of the flow. Threads reference the :class:`Owner`, never the public channel, so an
unreferenced channel is collected and its finalizer stops them.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torchrl._utils import logger as torchrl_logger

from rl_observers.channel.delivery import Delivery
from rl_observers.channel.payload import Payload
from rl_observers.channel.queue import PendingQueue
from rl_observers.observer import check_on_error

__all__ = ["Owner", "Wing", "check_alive"]


def check_alive(logger: Any) -> None:
    """Refuses a torchrl logger (or logger service) that was already shut down."""
    if getattr(logger, "is_alive", True) is False:
        raise ValueError(
            f"MetricsChannel expected a running logger, got a {type(logger).__name__} that is "
            "shut down (its is_alive is False): metrics sent to it would be lost. Create the "
            "channel before shutting the logger down, or start a new logger."
        )


class Wing:
    """What a channel does for other processes: nothing, unless a plug-in (:mod:`rl_observers.remote`) registers its own."""

    #: The ``health()`` counters it adds that count something lost.
    losses: tuple[str, ...] = ()

    def poll(self, deadline: float | None) -> None:
        """Queues what other processes sent so far."""

    def flush(self, deadline: float | None) -> bool:
        """Brings in everything sent before the call; whether every copy's account is settled."""
        return True

    def clean_since_last_check(self) -> bool:
        """Whether nothing was counted lost here since the previous check."""
        return True

    def counts(self) -> dict[str, int]:
        """Counters added to the channel's ``health()``."""
        return {}

    def before_close(self) -> bool:
        """Called once when the channel starts closing; whether it leaves producers behind."""
        return False

    def close(self, deadline: float | None) -> None:
        """Called after the close callbacks, before the queue closes."""

    def release(self) -> None:
        """The channel was garbage-collected: stop without waiting."""

    def handle(self, channel: Any, transport: str | None) -> Any:
        raise RuntimeError(
            f"MetricsChannel {channel.name!r} has no handles: import rl_observers (its remote "
            "wing sends from other processes) before creating the channel."
        )

    def in_forked_child(self, owner: Owner) -> Any:
        """The channel's state in a child forked from the owner's process (``None``: none)."""
        return None


class Owner:
    """What a channel owns in its own process: queue, delivery, close callbacks, its wing."""

    def __init__(
        self,
        logger: Any,
        token: str,
        *,
        capacity: int,
        on_error: str,
        name: str,
        background: bool,
        health_interval: float | None,
        log_health: bool,
        make_wing: Callable[[Owner], Wing],  # called before delivery starts
    ) -> None:
        if isinstance(logger, type):
            raise TypeError(
                f"MetricsChannel expected a logger instance, got the class {logger.__name__}; "
                f"create the logger first, e.g. {logger.__name__}(exp_name=..., log_dir=...), "
                "and pass that."
            )
        if not any(callable(getattr(logger, name, None)) for name in ("log_metrics", "log_scalar")):
            raise TypeError(
                "MetricsChannel expected a torchrl Logger or an object with "
                f"log_metrics(metrics, step=None) or log_scalar(name, value, step), got {logger!r}."
            )
        check_alive(logger)
        if capacity.__class__ is bool or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}.")
        check_on_error(on_error)
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}.")
        if health_interval is not None and not health_interval >= 0:
            raise ValueError(f"health_interval must be >= 0 or None, got {health_interval!r}.")
        self.logger = logger
        self.token = token
        self.capacity = capacity
        self.on_error = on_error
        self.name = name
        self.background = background
        self.pid = os.getpid()
        self.queue = PendingQueue(capacity)
        self.closed = False
        self._closed_warned = False
        self.close_requested = False
        self._close_callbacks: list[Callable[[], Any]] = []
        self._lock = threading.Lock()
        self.wing = make_wing(self)
        self.delivery = Delivery(self, health_interval, bool(log_health))

    def submit(self, payload: Payload, held: int = 1) -> None:
        """Queues a payload (holding ``held``) whose metrics were checked (:func:`~rl_observers.channel.payload.check_metrics`)."""
        if not payload.metrics and payload.__class__ is Payload:  # nothing to log: not counted
            return
        if not self.closed:  # (the queue checks again under its lock)
            error = self.queue.put(payload, held)
            self.delivery.wake()
            if error is not None:
                self.delivery.report(error, f"could not merge a partial of namespace {payload.namespace!r}")
            return
        # those merged on the way no longer count as coalesced
        self.queue.count_lost(held, 1 - held)
        with self._lock:
            warn = not self._closed_warned and self.on_error != "ignore"
            self._closed_warned = True
        if warn:
            torchrl_logger.warning(
                f"MetricsChannel {self.name!r} is closed: metrics submitted after close() are "
                "dropped and counted in health()['dropped']. This is reported once."
            )

    @property
    def loss_keys(self) -> tuple[str, ...]:
        """The ``health()`` counters that count something lost (a ``False`` flush warns of them)."""
        return ("dropped", "sink_errors", *self.wing.losses)

    def flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        settled = self.wing.flush(deadline)
        return self.delivery.flush(deadline) & settled & self.wing.clean_since_last_check()

    def step(self) -> int:
        return self.delivery.step()

    def health(self) -> dict[str, int]:
        wing = self.wing.counts()  # first: settling a copy counts its lost windows in the queue's
        return {**self.queue.counts(), **wing}

    def handle(self, channel: Any, transport: str | None) -> Any:
        return self.wing.handle(channel, transport)

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        bound = getattr(callback, "__self__", None) is not None and hasattr(callback, "__func__")
        ref = weakref.WeakMethod(callback) if bound else (lambda: callback)  # type: ignore[arg-type]
        with self._lock:
            # forget those of objects gone: attaching and removing over and over does not grow it
            live = [r for r in self._close_callbacks if r() is not None]
            live.append(ref)
            self._close_callbacks = live

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            first = not self.close_requested
            self.close_requested = True
        orphaned = False
        if first:
            # what other processes already sent is read first, so that close callbacks see it
            orphaned = self.wing.before_close()
            with self._lock:
                callbacks, self._close_callbacks = self._close_callbacks, []
            for callback in (ref() for ref in callbacks):
                try:
                    if callback is not None:  # (None: its object is gone)
                        callback()
                except Exception as err:
                    self.delivery.report(err, f"close callback {callback!r} raised")
            self.wing.close(deadline)
            self.closed = True
            self.queue.close()
            self.delivery.stop(at_exit)
        done = self.delivery.join(deadline)
        clean = self.delivery.clean_since_last_check() & self.wing.clean_since_last_check()
        self.delivery.raise_stored_error()
        return done and clean and not orphaned

    def release(self) -> None:
        """Stops the threads without waiting or locking (the channel was garbage-collected)."""
        if os.getpid() != self.pid or self.close_requested:
            return
        self.close_requested = True
        self.delivery.release()
        self.wing.release()

    def in_forked_child(self) -> Any:
        """The channel's state in a forked child: the wing's stand-in, or this owner, closed."""
        state = self.wing.in_forked_child(self)
        self.close_requested = True
        self.closed = True
        self.delivery.release()
        return self if state is None else state
