"""MetricsChannel: the owner of a bounded, never-blocking way from observers to a logger.

Step of the flow: **channel** (source → observer → channel → logger).
Observers submit payloads; the channel puts them in its
:class:`~.queue.PendingQueue` and its :class:`~.delivery.Delivery` writes them
to the logger from its own thread. That work is done by the channel's
:class:`~.owner.Owner`; this module holds the public face, the process's
registry of live channels, and what a channel does when its process exits or
forks (:mod:`rl_observers.lifecycle`).

The channel is local: what it does for other processes (handles, receivers,
the account of observers' copies) is its wing, which
:mod:`rl_observers.remote` registers (:func:`register_wing`).
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
    """Has every channel created from now on do ``make_wing(owner, channel)``'s work for other processes.

    :mod:`rl_observers.remote` registers its wing when imported (as
    ``import rl_observers`` does); a later registration replaces it.
    """
    _WING[:] = [make_wing]


class MetricsChannel:
    """A bounded, never-blocking channel from metric producers to a torchrl logger.

    :meth:`submit_metrics` only appends to an in-memory queue and returns in
    microseconds, whatever the logger does (slow, hung, raising, a dead
    logger service). The channel's own daemon thread performs the blocking
    ``logger.log_metrics(metrics, step=step)`` calls, one per pending entry.
    Under steady traffic (entries less than 50 ms apart) the thread wakes
    every 50 ms and delivers what came in that one wake-up (still one
    ``log_metrics`` per entry), rather than being woken for each: every
    wake-up takes the GIL from the submitting thread.
    :meth:`flush`, :meth:`close` and a backlog of a quarter of the capacity
    wake it at once.

    A payload is a flat mapping from metric names to numbers ("gauges") or to
    mergeable partial statistics: objects with ``merge(other)`` returning a
    new partial (exact and associative) and ``finalize()`` returning a
    ``dict[str, float]`` of metric names relative to the namespace. Partials
    are finalized on the channel's thread, when the entry is logged. Metrics
    are logged as ``"<namespace>/<name>"`` (``"<name>"`` with an empty
    namespace), and each namespace keeps its own step.

    At most ``capacity`` entries are pending. On overflow a new payload is
    coalesced into the newest pending entry of the same namespace (partials
    merge exactly, gauges keep the newest value, the step becomes the newest);
    if that namespace has no pending entry, the oldest pending entry is
    dropped. Both are counted, in payloads: every payload merged into a
    dropped entry counts as dropped. Memory stays flat under any flood.

    The channel never takes ownership of the logger: :meth:`close` stops the
    channel's thread and leaves the logger running; shutting it down remains
    the caller's responsibility. Workers in other processes use a picklable,
    non-owning :meth:`handle`. A channel that nobody references any more
    (neither the user nor a handle in its process) delivers what is pending
    and stops its threads; at interpreter exit, live channels are closed
    (close callbacks, pending entries) within 5 seconds in all.

    Health counters (see :meth:`health`) are logged under the channel's own
    namespace (``name``) only when something is wrong: entries dropped or
    coalesced, sink errors, or a backlog of half the capacity. From then on
    they are logged at most once per ``health_interval`` when one of them
    changed. ``log_health=True`` logs them in every run, at most once per
    ``health_interval`` when one changed and once more at :meth:`close`.

    Args:
        logger (Logger): the sink: any torchrl
            :class:`~torchrl.record.loggers.common.Logger` (``CSVLogger``,
            ``TensorboardLogger``, ``WandbLogger``, ``MLFlowLogger``,
            ``TrackioLogger``), a logger service (``service_backend="process"``
            or ``"ray"``) or its ``client()``, or any object with
            ``log_metrics(metrics, step=None)`` or ``log_scalar(name, value, step)``.
            MLflow keeps its active run per thread, so the channel's thread
            resumes an ``MLFlowLogger``'s run (it never ends it). A logger
            that is already shut down (``is_alive`` is ``False``) is refused
            with a ``ValueError``.

    Keyword Args:
        capacity (int, optional): the most entries waiting in the queue (the
            one being logged aside). Must be at least 1. Defaults to ``1024``.
        on_error (str, optional): what to do when the logger raises (or a
            partial fails to merge or finalize): ``"warn"`` (default) logs a
            warning through the torchrl logger at the first failure of a
            streak and again at most once a minute while it goes on (with
            the counts), and a warning when :meth:`flush` or :meth:`close`
            returns ``False``;
            ``"raise"`` stores the first error and raises it from the next
            :meth:`flush`, :meth:`step` or :meth:`close`, ``"ignore"`` only
            counts it. Logging resumes as soon as the logger recovers.
        name (str, optional): the namespace of the channel's health metrics.
            Defaults to ``"channel"``.
        background (bool, optional): if ``True`` (default), a daemon thread
            delivers entries as they come (gathered for up to 50 ms under
            steady traffic). If ``False``, nothing runs in the
            background: :meth:`step` and :meth:`flush` deliver in the calling
            thread, which keeps tests deterministic (and blocks on a blocking
            logger).
        health_interval (float, optional): the least number of seconds between
            two health reports; ``None`` turns health reports off. Defaults to
            ``1.0``.
        log_health (bool, optional): log the health counters even when all
            is well. Defaults to ``False``: ``<name>/*`` series appear only
            once something is wrong.

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
        """Returns the channel shared by everything that logs to ``logger``.

        The first call creates the channel with ``kwargs``; later calls with
        the same logger object return that channel (their ``kwargs`` are
        ignored) until it is closed or no longer referenced (by the caller or
        by one of its handles: the registry itself holds it weakly). Several
        observers writing to one logger thus share one queue and one thread.

        Args:
            logger (Logger): the sink, as for :class:`MetricsChannel`.

        Keyword Args:
            **kwargs: keyword arguments of :class:`MetricsChannel`, used when
                the shared channel is created.

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
        """Queues one payload for logging and returns at once.

        Never blocks and never calls the logger. After :meth:`close` the
        payload is dropped and counted (and a warning says so, once).

        Values are real numbers (``NaN`` and ``inf`` are logged as they
        are), one-element tensors or arrays (converted by the logger, in the
        channel's thread) or mergeable partials; anything else (a string, a
        nested mapping, a multi-element tensor, ``None``) is refused at once.
        Names are passed to the logger unchanged: a name the logger cannot
        store (too long for a file name, say) makes that entry's logger call
        fail, which is counted in ``sink_errors`` and handled by
        ``on_error``; the channel goes on. An empty mapping logs nothing and
        is ignored.

        Args:
            metrics (Mapping[str, float | int | partial]): metric names
                (relative to ``namespace``) to numbers or mergeable partials.
                The mapping is copied; partials must not be mutated afterwards.
            step (int, optional): the namespace's logical step, passed to the
                logger. Defaults to ``None`` (the logger's own step handling).

        Keyword Args:
            namespace (str, optional): prefix of the logged names
                (``"<namespace>/<name>"``); also the unit of coalescing.
                Defaults to ``""`` (no prefix).

        Raises:
            TypeError: if ``metrics`` is not a mapping from ``str`` names to
                the values above, or ``namespace`` is not a ``str``.
        """
        self._state.submit(Payload(namespace, check_metrics(metrics, namespace, "MetricsChannel"), step))

    def submit_window(self, window: Payload) -> None:
        """Queues one window of an observer's copy (:class:`~rl_observers.remote.window.Window`).

        What copies of a :class:`~rl_observers.LoggerObserver` send; the
        router registered for the window's class merges the windows of each
        observer into its rows (:mod:`~rl_observers.remote.aggregate`).
        Never blocks, like :meth:`submit_metrics`.

        Raises:
            TypeError: if the window's metrics are not loggable values.
        """
        check_metrics(window.metrics, window.namespace, "MetricsChannel")
        self._state.submit(window)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything submitted before this call was processed.

        Payloads that handles in other processes sent before the call are
        included: the flush is a barrier through every hop (the senders'
        buffers, Ray's per-node relays, the owner's ingest; see
        ``docs/distributed.rst``, "What flush guarantees"). "Processed" means
        delivered, failed (counted in ``sink_errors``) or dropped (on
        overflow, counted in ``dropped``).
        With ``background=False`` the entries are delivered in the calling
        thread, and ``timeout`` does not bound the logger calls.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None`` (wait as long as it takes).

        Returns:
            ``True`` if everything submitted before the call was processed
            and, since the previous :meth:`flush` or :meth:`close`, no
            logger call (nor partial, nor router) failed and no payload was
            lost; ``False`` if the timeout expired first (the logger is slow
            or hung), something failed (counted in ``sink_errors``, reported
            per ``on_error``) or payloads were lost (counted in ``dropped``,
            ``remote_dropped``, ``receiver_restarts``, ``copies_lost`` or
            ``windows_lost``). ``True`` thus means
            that everything submitted since the previous check reached the
            logger (coalesced payloads merged into the entry logged).

        Raises:
            Exception: with ``on_error="raise"``, the first logger error
                stored since the last raise.
        """
        return self._said(self._state.flush(timeout), "flush")

    def step(self) -> int:
        """Delivers every pending entry in the calling thread (``background=False`` only).

        Also reads what handles in other processes sent, and logs the health
        counters when due. This mirrors ``LoggerMonitor(background=False).step()``.

        Returns:
            The number of entries processed.

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
        """Runs the close callbacks, flushes, logs the health counters once more and stops.

        Idempotent. The close callbacks (the observers' last windows) run
        first, in the calling thread, so what they submit is still logged.
        Then the socket used by handles in other processes is removed; later
        submissions (local or remote) are dropped and counted. The logger is
        left running. If the logger hangs, ``close`` returns after
        ``timeout`` and leaves the daemon thread behind, to finish the
        delivery if the logger ever returns. Without a ``timeout`` it waits
        as long as the logger makes progress, but gives up (with a warning)
        once one logger call has not returned for 30 seconds, so ``close``
        never hangs on a hung logger. With ``background=False`` the
        last entries are delivered in the calling thread, and ``timeout`` does
        not bound the logger calls.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None`` (as long as the logger makes progress).

        Returns:
            ``True`` if everything was delivered and the thread stopped;
            ``False`` if the timeout expired first, if observers still had
            copies attached in other processes or actors (a collector not
            shut down yet: a warning names them), or if, since the previous
            :meth:`flush` or :meth:`close`, a logger call (or a partial, a
            router, a close callback) failed or payloads were lost: see
            ``health()`` (``sink_errors``, ``dropped``, ``remote_dropped``,
            ``receiver_restarts``).

        Raises:
            Exception: with ``on_error="raise"``, a stored logger error.
        """
        with _REGISTRY_LOCK:
            state = self._state
            if _SHARED.get(id(state.logger)) is self:
                del _SHARED[id(state.logger)]
        return self._said(state.close(timeout), "close")

    def _said(self, result: bool, what: str) -> bool:
        """``result``, with a warning when it is ``False`` (unless ``on_error="ignore"``).

        A :meth:`flush` whose timeout expired while nothing failed nor was lost
        (a slow logger, still delivering) is not warned about: only
        :meth:`close` leaving entries behind is.
        """
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
        """Returns the channel's counters.

        - ``submitted``: payloads accepted by :meth:`submit_metrics` (and
          received from handles in other processes);
        - ``logged``: entries delivered to the logger (one logger call each);
        - ``pending``: entries not yet logged (queued or being logged);
        - ``coalesced``: payloads merged into a pending entry on overflow
          (logged with it; when that entry is dropped they count in
          ``dropped`` instead);
        - ``dropped``: payloads lost here: every payload held by an entry
          dropped on overflow, payloads submitted after :meth:`close`, and
          unreadable datagrams;
        - ``sink_errors``: entries whose logger call raised (for an entry
          handed to a router: one of its rows, the others are still written);
        - ``remote_dropped`` / ``remote_coalesced``: what handles in other
          processes dropped or coalesced before sending (as far as they
          could report it), also on other nodes;
        - ``receiver_restarts``: times a receiver lost its mailbox and
          started a new one (Ray's ingest actor died; what it held is lost).
        - ``copies_lost``: copies of observers (in workers, actors, other
          nodes) that vanished without their final report (actor killed,
          node lost, worker SIGKILLed), each reported once in a warning
          naming it and what its last report held;
        - ``windows_lost``: windows that those copies numbered and that
          never reached the owner (see :mod:`~rl_observers.remote.account`).

        ``submitted == logged + pending + coalesced + dropped + sink_errors``.
        """
        return self._state.health()

    def handle(self, *, transport: str | None = None) -> Any:
        """Returns a picklable, non-owning :class:`~rl_observers.MetricsHandle` for workers and actors.

        The first call starts the channel's receivers: the socket that
        handles in other processes on this machine send to and, when this
        process is connected to Ray, the Ray ingest that handles on other
        nodes send to (started by the first handle made or pickled once Ray
        is initialized). Unpickled in this process, the handle submits to
        the channel directly; in another process on the same machine, it
        sends datagrams to the channel's socket; elsewhere, through Ray;
        never blocking.

        Keyword Args:
            transport (str, optional): the transport the handle sends
                through (``"socket"``, ``"ray"``, or another registered one), even in
                this process. Defaults to ``None``: in this process the
                channel itself, elsewhere the first reachable transport.

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
    """Gives live channels of this process a bounded chance to deliver before exit.

    Their threads are daemons, which the interpreter would otherwise stop with
    entries still pending. Close callbacks run, pending entries are delivered,
    and health is logged only if it changed, within ``_EXIT_TIMEOUT`` seconds
    in all.
    """
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
