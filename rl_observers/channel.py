"""The metrics channel: a bounded, never-blocking layer between observers and a logger.

Observers hand their payloads to :meth:`MetricsChannel.submit_metrics`, which
returns in microseconds whatever the logger is doing. The channel owns one
daemon thread that performs the blocking ``logger.log_metrics`` calls, keeps
at most ``capacity`` pending entries (coalescing or dropping on overflow, and
counting both), and reports its own health as metrics.

Workers in other processes (multiprocessing workers, Ray actors on the same
machine) get a picklable :class:`MetricsHandle` from :meth:`MetricsChannel.handle`;
it sends its payloads to the owning channel over a Unix-domain datagram
socket that never blocks the sender.

The channel knows nothing about reinforcement learning: a payload is a flat
mapping from names to numbers ("gauges") or to mergeable partial statistics,
that is objects with ``merge(other) -> partial`` (exact and associative) and
``finalize() -> dict[str, float]``.
"""

from __future__ import annotations

import atexit
import errno
import numbers
import os
import pickle
import select
import socket
import tempfile
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

from torchrl._utils import logger as torchrl_logger

from rl_observers.aggregate import Aggregate

__all__ = ["MetricsChannel", "MetricsHandle"]

OnError = Literal["warn", "raise", "ignore"]

_ON_ERROR_POLICIES = ("warn", "raise", "ignore")
# The largest payload a handle sends in one datagram (pickled), in bytes.
_MAX_DATAGRAM = 1 << 16
# How many datagrams the receiver reads in one go before releasing its lock.
_RECEIVE_BATCH = 4096
# How many namespaces a handle keeps in its send backlog while the owner's
# socket queue is full.
_BACKLOG_NAMESPACES = 64
# Errors meaning "the owner's socket queue is full right now": retry later.
_RETRY_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.ENOMEM})
# The most seconds the interpreter's exit waits for live channels to deliver.
_EXIT_TIMEOUT = 5.0
# The most seconds close() without a timeout waits for a logger call that does not return.
_CLOSE_STALL_TIMEOUT = 30.0
_MISSING = object()
_GAUGE_TYPES = (float, int)
# Value classes already known to be loggable as they are: numbers and partial classes.
_LOGGABLE_CLASSES: set[type] = {float, int, bool}

# Process-local registry of live channels, by token: an unpickled handle whose
# token is found here resolves to the channel itself (same process).
_CHANNELS: weakref.WeakValueDictionary[str, MetricsChannel] = weakref.WeakValueDictionary()
# Shared channels of MetricsChannel.for_logger, by id(logger). A channel holds
# its logger, so the id cannot be reused while the entry lives.
_SHARED: weakref.WeakValueDictionary[int, MetricsChannel] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


def _loggable(value: Any) -> bool:
    """Whether ``value`` is a real number, a one-element tensor or array, or a mergeable partial."""
    cls = value.__class__
    if isinstance(value, numbers.Real) or (
        callable(getattr(cls, "merge", None)) and callable(getattr(cls, "finalize", None))
    ):
        _LOGGABLE_CLASSES.add(cls)
        return True
    numel = getattr(value, "numel", None)  # a torch tensor: the logger reads its one element
    if callable(numel):
        return numel() == 1 and not getattr(value, "is_complex", lambda: False)()
    size = getattr(value, "size", None)  # a numpy array
    return isinstance(size, int) and size == 1 and getattr(value, "dtype", None) is not None


def _value_error(key: str, value: Any, who: str) -> TypeError:
    if isinstance(value, Mapping):
        hint = f" Flatten nested metrics into names such as '{key}/<name>'."
    elif callable(getattr(value, "numel", None)) or hasattr(value, "shape"):
        hint = " Reduce it to one number first (or submit a mergeable partial)."
    else:
        hint = ""
    return TypeError(
        f"{who}.submit_metrics expected metric values that are real numbers, one-element "
        f"tensors or mergeable partials, got {value!r} ({type(value).__name__}) for {key!r}.{hint}"
    )


def _check_metrics(metrics: Any, namespace: Any, who: str) -> dict[str, Any]:
    """Validates a payload cheaply and returns a private copy of it."""
    if metrics.__class__ is not dict and not isinstance(metrics, Mapping):
        raise TypeError(
            f"{who}.submit_metrics expected a mapping from metric names (str) to numbers "
            f"or mergeable partials, got {metrics!r}."
        )
    copy = dict(metrics)
    for key, value in copy.items():
        if key.__class__ is not str and not isinstance(key, str):
            raise TypeError(
                f"{who}.submit_metrics expected metric names of type str, got {key!r} "
                f"({type(key).__name__}) in {metrics!r}."
            )
        if value.__class__ not in _LOGGABLE_CLASSES and not _loggable(value):
            raise _value_error(key, value, who)
    if namespace.__class__ is not str and not isinstance(namespace, str):
        raise TypeError(f"{who}.submit_metrics expected a str namespace, got {namespace!r}.")
    return copy


def _merge_into(target: dict[str, Any], metrics: Mapping[str, Any]) -> Exception | None:
    """Coalesces ``metrics`` into ``target`` in place.

    Partials present on both sides are merged exactly; any other value (a
    gauge, or a partial meeting a gauge) keeps the newest. Returns the last
    error raised by a ``merge`` (that value then keeps the newest), or ``None``.
    """
    error = None
    for key, value in metrics.items():
        previous = target.get(key, _MISSING)
        if previous is not _MISSING and previous.__class__ not in _GAUGE_TYPES:
            merge = getattr(previous, "merge", None)
            if merge is not None and getattr(value, "merge", None) is not None:
                try:
                    value = merge(value)
                except Exception as err:  # the partial's own bug: keep the newest
                    error = err
        target[key] = value
    return error


def _expand(namespace: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Turns a payload into logger names and values: partials are finalized."""
    prefix = f"{namespace}/" if namespace else ""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if value.__class__ not in _GAUGE_TYPES:
            finalize = getattr(value, "finalize", None)
            if finalize is not None:
                for name, final in finalize().items():
                    out[prefix + name] = final
                continue
        out[prefix + key] = value
    return out


def _check_alive(logger: Any) -> None:
    """Refuses a torchrl logger (or logger service) that was already shut down."""
    if getattr(logger, "is_alive", True) is False:
        raise ValueError(
            f"MetricsChannel expected a running logger, got a {type(logger).__name__} that is "
            "shut down (its is_alive is False): metrics sent to it would be lost. Create the "
            "channel before shutting the logger down, or start a new logger."
        )


class _StrongRef:
    """A strong reference with the call interface of a weak one."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class _Entry:
    """One pending payload of one namespace; ``seq`` is its first submission number."""

    __slots__ = ("meta", "metrics", "namespace", "seq", "step")

    def __init__(
        self,
        namespace: str,
        metrics: dict[str, Any],
        step: int | None,
        meta: Mapping[str, Any] | None,
        seq: int,
    ) -> None:
        self.namespace = namespace
        self.metrics = metrics
        self.step = step
        self.meta = meta
        self.seq = seq


class _ChannelCore:
    """Everything a channel owns: queue, counters, threads and socket.

    The owner threads reference this object, never the public
    :class:`MetricsChannel`, so a channel nobody references any more is
    garbage-collected and its finalizer stops the threads.
    """

    def __init__(
        self,
        logger: Any,
        *,
        capacity: int,
        on_error: str,
        name: str,
        background: bool,
        health_interval: float | None,
    ) -> None:
        log_metrics = getattr(logger, "log_metrics", None)
        log_scalar = getattr(logger, "log_scalar", None)
        if not callable(log_metrics) and not callable(log_scalar):
            raise TypeError(
                "MetricsChannel expected a torchrl Logger or an object with "
                f"log_metrics(metrics, step=None) or log_scalar(name, value, step), got {logger!r}."
            )
        _check_alive(logger)
        if capacity.__class__ is bool or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}.")
        if on_error not in _ON_ERROR_POLICIES:
            raise ValueError(
                f"on_error must be one of 'warn', 'raise' or 'ignore', got {on_error!r}."
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}.")
        if health_interval is not None and not health_interval >= 0:
            raise ValueError(f"health_interval must be >= 0 or None, got {health_interval!r}.")
        self.logger = logger
        self._log_metrics = log_metrics if callable(log_metrics) else None
        self._log_scalar = log_scalar
        self.capacity = capacity
        self.on_error = on_error
        self.name = name
        self.background = background
        self._health_interval = health_interval
        self._pid = os.getpid()

        # queue and counters, all guarded by _lock
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._pending: deque[_Entry] = deque()
        self._newest: dict[str, _Entry] = {}
        self._in_flight: _Entry | None = None
        self._waiters = 0
        self._submitted = 0
        self._logged = 0
        self._coalesced = 0
        self._dropped = 0
        self._sink_errors = 0
        self._remote_dropped = 0
        self._remote_coalesced = 0
        self.closed = False
        self._closed_warned = False
        self._close_requested = False
        self._stopping = False
        self._close_callbacks: list[Callable[[], Any]] = []
        # observers' aggregates by name, touched only by whoever delivers
        self.aggregates: dict[str, Aggregate] = {}
        # health report when the thread stops: "always" (close) or "changed" (exit)
        self._final_health = "always"

        # error policy
        self._failing = False
        self._error: BaseException | None = None

        # health reports
        self._health_time = time.monotonic()
        self._health_counts = self._counts_locked()
        self._health_step = 0

        # transport (bound lazily by the first handle)
        self.path: str | None = None
        self._sock: socket.socket | None = None
        self._sock_dir: str | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._sock_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._recv_stop = False
        self._recv_thread: threading.Thread | None = None

        # delivery
        self._deliver_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name=f"MetricsChannel[{name}]", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------------ submit
    def submit_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int | None = None,
        namespace: str = "",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self._enqueue(_check_metrics(metrics, namespace, "MetricsChannel"), step, namespace, meta)

    def _enqueue(
        self,
        metrics: dict[str, Any],
        step: int | None,
        namespace: str,
        meta: Mapping[str, Any] | None,
    ) -> None:
        if not metrics and not meta:  # nothing to log: not queued, not counted
            return
        if self.closed:  # re-checked under the lock below
            self._drop_after_close()
            return
        error = None
        with self._lock:
            self._submitted += 1
            if self.closed:
                self._dropped += 1
                return
            pending = self._pending
            if len(pending) < self.capacity:
                entry = _Entry(namespace, metrics, step, meta, self._submitted)
                pending.append(entry)
                self._newest[namespace] = entry
            else:
                entry = self._newest.get(namespace)
                if entry is not None:
                    error = _merge_into(entry.metrics, metrics)
                    entry.step = step
                    if meta is not None:
                        entry.meta = meta
                    self._coalesced += 1
                else:
                    oldest = pending.popleft()
                    if self._newest.get(oldest.namespace) is oldest:
                        del self._newest[oldest.namespace]
                    self._dropped += 1
                    entry = _Entry(namespace, metrics, step, meta, self._submitted)
                    pending.append(entry)
                    self._newest[namespace] = entry
        if not self._wake.is_set():
            self._wake.set()
        if error is not None:
            self._report(error, f"could not merge a partial of namespace {namespace!r}")

    def _drop_after_close(self) -> None:
        with self._lock:
            self._submitted += 1
            self._dropped += 1
            warn = not self._closed_warned and self.on_error != "ignore"
            self._closed_warned = True
        if warn:
            torchrl_logger.warning(
                f"MetricsChannel {self.name!r} is closed: metrics submitted after close() are "
                "dropped and counted in health()['dropped']. This is reported once."
            )

    # ---------------------------------------------------------------- delivery
    def _bind_logger_to_thread(self) -> None:
        """Makes the logger's per-thread state current in the channel's thread.

        MLflow keeps its active run per thread, and ``MLFlowLogger`` logs through
        that fluent API: from another thread it would open a new run. The
        channel's thread therefore resumes the logger's run (without ever
        ending it).
        """
        experiment = getattr(self.logger, "experiment", None)
        if not type(experiment).__module__.startswith("mlflow"):
            return
        run_id = getattr(getattr(experiment, "info", None), "run_id", None)
        if run_id is None:
            return
        import mlflow

        active = mlflow.active_run()
        if active is None or active.info.run_id != run_id:
            mlflow.start_run(run_id=run_id)

    def _run(self) -> None:
        try:
            self._bind_logger_to_thread()
        except Exception as err:
            self._report(err, "could not bind its logger to the channel's thread")
        timeout = 1.0
        if self._health_interval is not None:
            timeout = min(timeout, max(self._health_interval, 0.01))
        while True:
            self._wake.wait(timeout)
            self._wake.clear()
            self._drain()
            if self._stopping:
                with self._lock:
                    if not self._pending:
                        break
                continue
            self._maybe_log_health()
        self._finish_aggregates()
        self._maybe_log_health(when=self._final_health)

    def _drain(self) -> int:
        """Delivers pending entries until none is left; returns how many."""
        count = 0
        while True:
            with self._lock:
                if not self._pending:
                    return count
                entry = self._pending.popleft()
                if self._newest.get(entry.namespace) is entry:
                    del self._newest[entry.namespace]
                self._in_flight = entry
            try:
                self._deliver(entry)
            except Exception as err:
                delivered = False
                self._report(err, f"failed to log namespace {entry.namespace!r}")
            else:
                delivered = True
            with self._lock:
                self._in_flight = None
                if delivered:
                    self._logged += 1
                    self._failing = False
                else:
                    self._sink_errors += 1
                if self._waiters:
                    self._progress.notify_all()
            count += 1

    def _deliver(self, entry: _Entry) -> None:
        """Turns one entry into logger calls.

        This is the seam where entries become logger calls: partials are
        finalized, names get their namespace and the entry's step is passed
        on. An entry whose ``meta`` names an ``"aggregate"`` is a worker's
        contribution: it is folded into that observer's
        :class:`~rl_observers.aggregate.Aggregate`, which returns the rows
        now due.
        """
        meta = entry.meta
        if meta and "aggregate" in meta:
            for namespace, metrics, step in self._contribute(meta, entry.metrics):
                payload = _expand(namespace, metrics)
                if payload:
                    self._write(payload, step)
            return
        payload = _expand(entry.namespace, entry.metrics)
        if payload:
            self._write(payload, entry.step)

    def _contribute(self, meta: Mapping[str, Any], metrics: dict[str, Any]) -> list[Any]:
        name = meta["aggregate"]
        aggregate = self.aggregates.get(name)
        if aggregate is None:
            aggregate = self.aggregates[name] = Aggregate.from_meta(name, meta)
        rows = []
        if metrics or meta.get("counters"):
            rows = aggregate.contribute(meta.get("worker"), metrics, meta.get("counters") or {})
        if meta.get("finish"):
            rows.extend(aggregate.finish())
            del self.aggregates[name]
        return rows

    def _finish_aggregates(self) -> None:
        """Logs every aggregate's last partial windows (at close)."""
        for name in list(self.aggregates):
            try:
                for namespace, metrics, step in self._contribute({"aggregate": name, "finish": True}, {}):
                    payload = _expand(namespace, metrics)
                    if payload:
                        self._write(payload, step)
            except Exception as err:
                self._report(err, f"failed to log the last window of {name!r}")

    def _write(self, payload: dict[str, Any], step: int | None) -> None:
        if self._log_metrics is not None:
            self._log_metrics(payload, step=step)
        else:
            for name, value in payload.items():
                self._log_scalar(name, value, step)

    def _report(self, err: BaseException, what: str) -> None:
        """Applies the ``on_error`` policy to a failure of the sink or of a partial."""
        if self.on_error == "raise":
            with self._lock:
                if self._error is None:
                    self._error = err
        elif self.on_error == "warn" and not self._failing:
            torchrl_logger.warning(
                f"MetricsChannel {self.name!r} {what}: {err!r}. Further errors will be "
                "silent until the logger recovers."
            )
        self._failing = True

    def _raise_stored_error(self) -> None:
        if self._error is None:
            return
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    # ------------------------------------------------------------------ health
    def _counts_locked(self) -> dict[str, int]:
        return {
            "submitted": self._submitted,
            "logged": self._logged,
            "pending": len(self._pending) + (self._in_flight is not None),
            "coalesced": self._coalesced,
            "dropped": self._dropped,
            "sink_errors": self._sink_errors,
            "remote_dropped": self._remote_dropped,
            "remote_coalesced": self._remote_coalesced,
        }

    def health(self) -> dict[str, int]:
        with self._lock:
            return self._counts_locked()

    def _maybe_log_health(self, when: str = "due") -> None:
        """Logs the health counters: ``"due"`` (changed, interval elapsed), ``"changed"``, ``"always"``."""
        if self._health_interval is None:
            return
        now = time.monotonic()
        if when == "due" and now - self._health_time < self._health_interval:
            return
        counts = self.health()
        if when != "always" and counts == self._health_counts:
            return
        self._health_time = now
        self._health_counts = counts
        payload = {f"{self.name}/{key}": value for key, value in counts.items()}
        step, self._health_step = self._health_step, self._health_step + 1
        try:
            self._write(payload, step)
        except Exception as err:
            self._report(err, "failed to log its health")

    # ------------------------------------------------------------ flush/close
    def _flushed_through_locked(self, target: int) -> bool:
        pending = self._pending
        in_flight = self._in_flight
        return (not pending or pending[0].seq > target) and (
            in_flight is None or in_flight.seq > target
        )

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._poll_socket(deadline)
        if self._thread is None:
            with self._deliver_lock:
                self._drain()
            done = True
        else:
            with self._lock:
                target = self._submitted
                self._waiters += 1
                try:
                    while not self._flushed_through_locked(target):
                        if deadline is None:
                            self._progress.wait()
                        else:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            self._progress.wait(remaining)
                    done = self._flushed_through_locked(target)
                finally:
                    self._waiters -= 1
        self._raise_stored_error()
        return done

    def step(self) -> int:
        if self._thread is not None:
            raise RuntimeError(
                "MetricsChannel.step() drives a channel created with background=False; "
                "this channel has its own thread, use flush() to wait for it."
            )
        with self._deliver_lock:
            self._poll_socket(None)
            count = self._drain()
            self._maybe_log_health()
        self._raise_stored_error()
        return count

    def _final_delivery(self) -> None:
        with self._deliver_lock:
            self._drain()
            self._finish_aggregates()
            self._maybe_log_health(when=self._final_health)

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        if getattr(callback, "__self__", None) is not None and hasattr(callback, "__func__"):
            ref: Callable[[], Any] = weakref.WeakMethod(callback)  # type: ignore[arg-type]
        else:
            ref = _StrongRef(callback)
        with self._lock:
            # Forget the callbacks of objects already gone: observers attached and
            # removed over and over do not make the list grow.
            live = [r for r in self._close_callbacks if r() is not None]
            live.append(ref)
            self._close_callbacks = live

    def _run_close_callbacks(self) -> None:
        with self._lock:
            callbacks, self._close_callbacks = self._close_callbacks, []
        for ref in callbacks:
            callback = ref()
            if callback is None:
                continue
            try:
                callback()
            except Exception as err:
                self._report(err, f"close callback {callback!r} raised")

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            first = not self._close_requested
            self._close_requested = True
        if first:
            # contributions already sent by other processes are read first, so that close
            # callbacks see which observers have copies elsewhere (MetricsChannel.has_aggregate)
            self._poll_socket(time.monotonic() + 1.0)
            self._run_close_callbacks()
            if at_exit:
                self._final_health = "changed"
            self._close_transport(deadline)
            with self._lock:
                self.closed = True
            self._stopping = True
            self._wake.set()
            if self._thread is None:
                if not at_exit:
                    self._final_delivery()
                else:  # never hang the interpreter's exit on a blocking logger
                    self._thread = threading.Thread(
                        target=self._final_delivery,
                        name=f"MetricsChannel[{self.name}].exit",
                        daemon=True,
                    )
                    self._thread.start()
        done = True
        thread = self._thread
        if thread is not None:
            if deadline is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
                done = not thread.is_alive()
            else:
                done = self._join_while_progressing(thread)
        self._raise_stored_error()
        return done

    def _join_while_progressing(self, thread: threading.Thread) -> bool:
        """Joins the delivery thread while the logger makes progress.

        Gives up, warns and returns ``False`` when one logger call has not
        returned for ``_CLOSE_STALL_TIMEOUT`` seconds: ``close()`` never hangs
        on a hung logger.
        """
        seen, since = -1, time.monotonic()
        while True:
            thread.join(0.05)
            if not thread.is_alive():
                return True
            with self._lock:
                progress = self._logged + self._sink_errors
                pending = len(self._pending) + (self._in_flight is not None)
            now = time.monotonic()
            if progress != seen:
                seen, since = progress, now
            elif now - since >= _CLOSE_STALL_TIMEOUT:
                if self.on_error != "ignore":
                    torchrl_logger.warning(
                        f"MetricsChannel {self.name!r}: its logger has not returned from a call "
                        f"for {_CLOSE_STALL_TIMEOUT:g} seconds; close() gives up with {pending} "
                        "entries not delivered. The channel's daemon thread is left behind and "
                        "delivers them if the logger ever returns."
                    )
                return False

    def release(self) -> None:
        """Stops the owner's threads without waiting: the channel was garbage-collected.

        Runs in whichever thread collected the channel, so it takes no lock.
        The delivery thread drains what is pending and exits within a second.
        """
        if os.getpid() != self._pid or self._close_requested:
            return
        self._close_requested = True
        self._stopping = True
        self._unlink_socket()
        if self._recv_thread is not None:
            self._recv_stop = True
            self._wake_receiver()
        else:
            self._close_sockets()

    # --------------------------------------------------------------- transport
    def ensure_socket(self) -> str | None:
        """Binds the owner's datagram socket on first use; returns its path."""
        with self._sock_lock:
            if self._sock is not None or self._close_requested:
                return self.path
            if not hasattr(socket, "AF_UNIX"):
                torchrl_logger.warning(
                    f"MetricsChannel {self.name!r}: Unix-domain sockets are not available on "
                    "this platform; handles used in other processes will drop their metrics."
                )
                return None
            try:
                sock, directory, path = self._bind()
            except OSError as err:
                torchrl_logger.warning(
                    f"MetricsChannel {self.name!r} could not bind its socket ({err!r}); "
                    "handles used in other processes will drop their metrics."
                )
                return None
            self._sock, self._sock_dir, self.path = sock, directory, path
            if self.background:
                self._recv_thread = threading.Thread(
                    target=self._receive_loop,
                    name=f"MetricsChannel[{self.name}].receiver",
                    daemon=True,
                )
                self._recv_thread.start()
            return path

    def _bind(self) -> tuple[socket.socket, str, str]:
        """Binds a datagram socket in a new private (0700) temporary directory."""
        directory = tempfile.mkdtemp(prefix="rl_observers-")
        path = os.path.join(directory, "channel.sock")
        if len(os.fsencode(path)) > 100:  # sun_path holds ~108 bytes
            os.rmdir(directory)
            directory = tempfile.mkdtemp(prefix="rlo-", dir="/tmp")
            path = os.path.join(directory, "channel.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
            except OSError:
                pass
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_w.setblocking(False)
        except OSError:
            sock.close()
            try:
                os.unlink(path)
            except OSError:
                pass
            os.rmdir(directory)
            raise
        return sock, directory, path

    def _receive_loop(self) -> None:
        sock, wake = self._sock, self._wake_r
        assert sock is not None and wake is not None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(wake.fileno(), select.POLLIN)
        broken = select.POLLERR | select.POLLHUP | select.POLLNVAL
        try:
            while not self._recv_stop:
                try:
                    events = poller.poll()
                except OSError:
                    break
                if any(mask & broken for _, mask in events):
                    break
                with self._recv_lock:
                    self._receive_available()
            with self._recv_lock:
                self._receive_available()
        finally:
            self._close_sockets()

    def _poll_socket(self, deadline: float | None) -> None:
        """Reads the datagrams already queued on the owner's socket (flush, step)."""
        if self._sock is None:
            return
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if self._recv_lock.acquire(timeout=wait):
            try:
                self._receive_available()
            finally:
                self._recv_lock.release()

    def _receive_available(self) -> int:
        """Enqueues the datagrams waiting on the socket. Caller holds ``_recv_lock``."""
        sock = self._sock
        if sock is None:
            return 0
        count = 0
        while count < _RECEIVE_BATCH:
            try:
                data = sock.recv(_MAX_DATAGRAM)
            except OSError:  # nothing left (EAGAIN) or socket closed
                break
            count += 1
            self._accept_datagram(data)
        return count

    def _accept_datagram(self, data: bytes) -> None:
        """Enqueues one datagram like a local submission; anything unreadable is dropped.

        Only processes of the same user can reach the socket (its directory is
        private), but the payload is still checked before use.
        """
        try:
            namespace, metrics, step, meta, (lost, coalesced) = pickle.loads(data)
            valid = (
                namespace.__class__ is str
                and metrics.__class__ is dict
                and all(key.__class__ is str for key in metrics)
                and (meta is None or isinstance(meta, Mapping))
                and lost.__class__ is int
                and coalesced.__class__ is int
            )
        except Exception:
            valid = False
        if not valid:
            with self._lock:
                self._submitted += 1
                self._dropped += 1
            return
        if lost or coalesced:
            with self._lock:
                self._remote_dropped += lost
                self._remote_coalesced += coalesced
        self._enqueue(metrics, step, namespace, meta)

    def _wake_receiver(self) -> None:
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"\0")
            except OSError:
                pass

    def _unlink_socket(self) -> None:
        if os.getpid() != self._pid:
            return
        path, directory = self.path, self._sock_dir
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
        if directory is not None:
            try:
                os.rmdir(directory)
            except OSError:
                pass

    def _close_sockets(self) -> None:
        for sock in (self._sock, self._wake_r, self._wake_w):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def _close_transport(self, deadline: float | None) -> None:
        """Removes the socket file, reads what was already sent, closes the socket."""
        with self._sock_lock:
            if self._sock is None:
                return
            self._unlink_socket()
            receiver = self._recv_thread
            if receiver is not None:
                self._recv_stop = True
                self._wake_receiver()
                wait = 2.0 if deadline is None else max(0.0, deadline - time.monotonic())
                receiver.join(min(wait, 2.0))
                if receiver.is_alive():  # never expected: it only reads and enqueues
                    self._close_sockets()
            else:
                with self._recv_lock:
                    self._receive_available()
                self._close_sockets()

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited socket copies, never the parent's file."""
        self._close_requested = True
        self._stopping = True
        self.closed = True
        self._close_sockets()


class _SocketSender:
    """Sends payloads to an owner's socket from another process; never blocks.

    When the owner's socket queue is full (``EAGAIN``), the payload joins a
    small per-namespace backlog (coalesced with the channel's rules) that is
    sent first on the next submission or by :meth:`flush`. Any other error
    (owner gone, payload too large or not picklable) drops the payload.
    """

    _sockets: tuple[int, socket.socket] | None = None

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.submitted = 0
        self.dropped = 0
        self.coalesced = 0
        self._unreported_dropped = 0
        self._unreported_coalesced = 0
        self._backlog: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def _socket(cls) -> socket.socket:
        pid = os.getpid()
        entry = cls._sockets
        if entry is None or entry[0] != pid:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            cls._sockets = entry = (pid, sock)
        return entry[1]

    def send(
        self,
        metrics: dict[str, Any],
        step: int | None,
        namespace: str,
        meta: Mapping[str, Any] | None,
    ) -> None:
        with self._lock:
            self.submitted += 1
            if self.path is None:
                self._drop(1)
                return
            if self._backlog and not self._send_backlog_locked():
                self._backlog_locked(namespace, metrics, step, meta)
                return
            status = self._send_locked(namespace, metrics, step, meta)
            if status == "retry":
                self._backlog_locked(namespace, metrics, step, meta)

    def flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while True:
            with self._lock:
                if not self._backlog or self._send_backlog_locked():
                    return True
            if deadline is not None and time.monotonic() + delay > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _drop(self, count: int) -> None:
        self.dropped += count
        self._unreported_dropped += count

    def _send_backlog_locked(self) -> bool:
        """Sends the backlog, oldest first; returns whether it is now empty."""
        backlog = self._backlog
        while backlog:
            namespace = next(iter(backlog))
            metrics, step, meta = backlog[namespace]
            if self._send_locked(namespace, metrics, step, meta) == "retry":
                return False
            del backlog[namespace]
        return True

    def _backlog_locked(
        self,
        namespace: str,
        metrics: dict[str, Any],
        step: int | None,
        meta: Mapping[str, Any] | None,
    ) -> None:
        held = self._backlog.get(namespace)
        if held is not None:
            error = _merge_into(held[0], metrics)
            if error is not None:
                self._warn_once(f"could not merge a partial of namespace {namespace!r}: {error!r}")
            held[1] = step
            if meta is not None:
                held[2] = meta
            self.coalesced += 1
            self._unreported_coalesced += 1
        elif len(self._backlog) < _BACKLOG_NAMESPACES:
            self._backlog[namespace] = [metrics, step, meta]
        else:
            self._drop(1)

    def _send_locked(
        self,
        namespace: str,
        metrics: dict[str, Any],
        step: int | None,
        meta: Mapping[str, Any] | None,
    ) -> str:
        """Sends one payload; returns ``"sent"``, ``"retry"`` or ``"dropped"``."""
        counts = (self._unreported_dropped, self._unreported_coalesced)
        try:
            data = pickle.dumps(
                (namespace, metrics, step, meta, counts), protocol=pickle.HIGHEST_PROTOCOL
            )
        except Exception as err:
            self._drop(1)
            self._warn_once(f"could not pickle a payload of namespace {namespace!r}: {err!r}")
            return "dropped"
        if len(data) > _MAX_DATAGRAM:
            self._drop(1)
            self._warn_once(
                f"dropped a payload of namespace {namespace!r}: {len(data)} bytes pickled, "
                f"more than the {_MAX_DATAGRAM} a datagram carries"
            )
            return "dropped"
        try:
            self._socket().sendto(data, self.path)
        except OSError as err:
            if err.errno in _RETRY_ERRNOS:
                return "retry"
            self._drop(1)  # the owner is gone (ENOENT, ECONNREFUSED) or worse
            return "dropped"
        self._unreported_dropped = 0
        self._unreported_coalesced = 0
        return "sent"

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            torchrl_logger.warning(f"MetricsHandle {message}. Further such errors are silent.")


class _ForwardingCore:
    """A channel's stand-in in a forked child process: it forwards to the parent's owner."""

    def __init__(self, core: _ChannelCore) -> None:
        self.logger = core.logger
        self.name = core.name
        self.capacity = core.capacity
        self.on_error = core.on_error
        self.background = core.background
        self.path = None if core.closed else core.path
        self.closed = core.closed
        self._sender = _SocketSender(self.path)
        self._close_callbacks: list[Callable[[], Any]] = []

    def submit_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int | None = None,
        namespace: str = "",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        metrics = _check_metrics(metrics, namespace, "MetricsChannel")
        if self.closed:
            self._sender.submitted += 1
            self._sender._drop(1)
            return
        self._sender.send(metrics, step, namespace, meta)

    def flush(self, timeout: float | None = None) -> bool:
        return self._sender.flush(timeout)

    def step(self) -> int:
        self._sender.flush(0)
        return 0

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        self._close_callbacks.append(callback)

    def close(self, timeout: float | None = None, *, at_exit: bool = False) -> bool:
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception as err:
                torchrl_logger.warning(
                    f"MetricsChannel close callback {callback!r} raised: {err!r}."
                )
        done = self._sender.flush(timeout)
        self.closed = True
        return done

    def ensure_socket(self) -> str | None:
        return self.path

    def health(self) -> dict[str, int]:
        sender = self._sender
        return {
            "submitted": sender.submitted,
            "logged": 0,
            "pending": len(sender._backlog),
            "coalesced": sender.coalesced,
            "dropped": sender.dropped,
            "sink_errors": 0,
            "remote_dropped": 0,
            "remote_coalesced": 0,
        }

    def release(self) -> None:
        pass


class MetricsChannel:
    """A bounded, never-blocking channel from metric producers to a torchrl logger.

    :meth:`submit_metrics` only appends to an in-memory queue and returns in
    microseconds, whatever the logger does (slow, hung, raising, a dead
    logger service). The channel's own daemon thread performs the blocking
    ``logger.log_metrics(metrics, step=step)`` calls, one per pending entry.

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
    dropped. Both are counted, so memory stays flat under any flood.

    The channel never takes ownership of the logger: :meth:`close` stops the
    channel's thread and leaves the logger running; shutting it down remains
    the caller's responsibility. Workers in other processes use a picklable,
    non-owning :meth:`handle`. A channel that nobody references any more
    (neither the user nor a handle in its process) delivers what is pending
    and stops its threads; at interpreter exit, live channels are closed
    (close callbacks, pending entries) within 5 seconds in all.

    Health counters (see :meth:`health`) are also logged under the channel's
    own namespace (``name``), at most once per ``health_interval`` when one
    of them changed, and once more at :meth:`close`.

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
            warning once per failure streak through the torchrl logger,
            ``"raise"`` stores the first error and raises it from the next
            :meth:`flush`, :meth:`step` or :meth:`close`, ``"ignore"`` only
            counts it. Logging resumes as soon as the logger recovers.
        name (str, optional): the namespace of the channel's health metrics.
            Defaults to ``"channel"``.
        background (bool, optional): if ``True`` (default), a daemon thread
            delivers entries as they come. If ``False``, nothing runs in the
            background: :meth:`step` and :meth:`flush` deliver in the calling
            thread, which keeps tests deterministic (and blocks on a blocking
            logger).
        health_interval (float, optional): the least number of seconds between
            two health reports; ``None`` turns health reports off. Defaults to
            ``1.0``.

    Examples:
        >>> import tempfile
        >>> from torchrl.record import CSVLogger
        >>> from rl_observers.channel import MetricsChannel
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

    __slots__ = ("__weakref__", "_core", "_finalizer", "_token")

    def __init__(
        self,
        logger: Any,
        *,
        capacity: int = 1024,
        on_error: OnError = "warn",
        name: str = "channel",
        background: bool = True,
        health_interval: float | None = 1.0,
    ) -> None:
        core = _ChannelCore(
            logger,
            capacity=capacity,
            on_error=on_error,
            name=name,
            background=background,
            health_interval=health_interval,
        )
        self._core: _ChannelCore | _ForwardingCore = core
        self._token = uuid.uuid4().hex
        self._finalizer = weakref.finalize(self, core.release)
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
            >>> from rl_observers.channel import MetricsChannel
            >>> logger = CSVLogger(exp_name="shared", log_dir=tempfile.mkdtemp())
            >>> channel = MetricsChannel.for_logger(logger, background=False)
            >>> MetricsChannel.for_logger(logger) is channel
            True
            >>> channel.close()
            True
            >>> MetricsChannel.for_logger(logger, background=False) is channel
            False
        """
        _check_alive(logger)
        with _REGISTRY_LOCK:
            channel = _SHARED.get(id(logger))
            if channel is not None and channel.logger is logger and not channel.closed:
                return channel
            channel = cls(logger, **kwargs)
            _SHARED[id(logger)] = channel
            return channel

    def submit_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int | None = None,
        *,
        namespace: str = "",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
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
        ``on_error``; the channel goes on. An empty mapping without ``meta``
        logs nothing and is ignored.

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
            meta (Mapping, optional): information about the payload's origin
                (for example ``{"worker": 3}``), carried along with the entry
                to the channel's thread. Defaults to ``None``.

        Raises:
            TypeError: if ``metrics`` is not a mapping from ``str`` names to
                the values above, or ``namespace`` is not a ``str``.
        """
        self._core.submit_metrics(metrics, step, namespace, meta)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything submitted before this call reached the logger.

        Payloads that handles in other processes sent before the call are
        included. "Reached" means delivered, failed (counted in
        ``sink_errors``) or dropped on overflow. With ``background=False``
        the entries are delivered in the calling thread, and ``timeout`` does
        not bound the logger calls.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None`` (wait as long as it takes).

        Returns:
            ``True`` if everything submitted before the call was processed,
            ``False`` if the timeout expired first (the logger is slow or hung).

        Raises:
            Exception: with ``on_error="raise"``, the first logger error
                stored since the last raise.
        """
        return self._core.flush(timeout)

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
        return self._core.step()

    def has_aggregate(self, name: str) -> bool:
        """Whether workers have contributed windows for the observer named ``name``.

        See :mod:`rl_observers.aggregate`. Always ``False`` in a process that
        does not own the channel.
        """
        core = self._core
        if not isinstance(core, _ChannelCore):
            return False
        if name in core.aggregates:
            return True
        with core._lock:  # contributions received but not delivered yet count too
            return any(
                entry.meta is not None and entry.meta.get("aggregate") == name
                for entry in (*core._pending, core._in_flight)
                if entry is not None
            )

    def finish_aggregate(self, name: str) -> None:
        """Logs the last windows of the aggregate ``name`` after every contribution sent so far.

        Reads what handles in other processes already sent, then queues a
        marker behind it: once a later :meth:`flush` returns, the aggregate's
        last partial windows (for ``log_on_close`` observers) have reached the
        logger. Used when an observer whose copies contribute is removed.

        Args:
            name (str): the observer's namespace.
        """
        core = self._core
        if isinstance(core, _ChannelCore):
            core._poll_socket(time.monotonic() + 5.0)
        self.submit_metrics({}, namespace=name, meta={"aggregate": name, "finish": True})

    def close(self, timeout: float | None = None) -> bool:
        """Runs the close callbacks, flushes, logs the health counters once more and stops.

        Idempotent. The close callbacks (:meth:`add_close_callback`) run
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
            ``True`` if everything was delivered and the thread stopped,
            ``False`` if the timeout expired first.

        Raises:
            Exception: with ``on_error="raise"``, a stored logger error.
        """
        with _REGISTRY_LOCK:
            core = self._core
            if _SHARED.get(id(core.logger)) is self:
                del _SHARED[id(core.logger)]
        return core.close(timeout)

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        """Registers ``callback()`` to run once when the channel closes, before its final flush.

        Producers use it to submit their last, partial window (an observer's
        ``log_on_close``). Callbacks run in the thread that calls
        :meth:`close` (or at interpreter exit), in registration order; an
        error is handled by the channel's ``on_error`` policy. A bound method
        is held weakly, so registering does not keep its object alive.

        Args:
            callback (Callable[[], Any]): called with no argument.

        Examples:
            >>> from rl_observers.channel import MetricsChannel
            >>> from torchrl.record import CSVLogger
            >>> import tempfile
            >>> logger = CSVLogger(exp_name="close_demo", log_dir=tempfile.mkdtemp())
            >>> channel = MetricsChannel(logger, background=False)
            >>> channel.add_close_callback(lambda: channel.submit_metrics({"last": 1.0}))
            >>> channel.close()
            True
            >>> logger.experiment.scalars["last"]
            [(0, 1.0)]
        """
        self._core.add_close_callback(callback)

    def health(self) -> dict[str, int]:
        """Returns the channel's counters.

        - ``submitted``: payloads accepted by :meth:`submit_metrics` (and
          received from handles in other processes);
        - ``logged``: entries delivered to the logger (one logger call each);
        - ``pending``: entries not yet logged (queued or being logged);
        - ``coalesced``: payloads merged into a pending entry on overflow;
        - ``dropped``: entries dropped on overflow, after :meth:`close`, or
          unreadable datagrams;
        - ``sink_errors``: entries whose logger call raised;
        - ``remote_dropped`` / ``remote_coalesced``: what handles in other
          processes dropped or coalesced before sending (as far as they
          could report it).

        ``submitted == logged + pending + coalesced + dropped + sink_errors``.
        """
        return self._core.health()

    def handle(self, meta: Mapping[str, Any] | None = None) -> MetricsHandle:
        """Returns a picklable, non-owning handle to this channel for workers and actors.

        The first call binds the socket that handles in other processes send
        to. Unpickled in this process, the handle submits to the channel
        directly; in another process on the same machine, it sends datagrams
        to the channel's socket, without ever blocking.

        Args:
            meta (Mapping, optional): default ``meta`` of every payload sent
                through the handle (for example ``{"worker": 3}``); a
                ``meta`` given to :meth:`MetricsHandle.submit_metrics` is
                merged over it. Defaults to ``None``.

        Raises:
            RuntimeError: if the channel is closed.

        Examples:
            >>> import pickle
            >>> import tempfile
            >>> from torchrl.record import CSVLogger
            >>> from rl_observers.channel import MetricsChannel
            >>> logger = CSVLogger(exp_name="handle_demo", log_dir=tempfile.mkdtemp())
            >>> channel = MetricsChannel(logger, background=False)
            >>> handle = pickle.loads(pickle.dumps(channel.handle(meta={"worker": 0})))
            >>> handle.submit_metrics({"frames": 100}, step=1, namespace="worker_0")
            >>> channel.step()
            1
            >>> logger.experiment.scalars["worker_0/frames"]
            [(1, 100.0)]
            >>> channel.close()
            True
        """
        if self._core.closed:
            raise RuntimeError(f"MetricsChannel {self.name!r} is closed; it gives no new handles.")
        path = self._core.ensure_socket()
        return MetricsHandle(self._token, path, meta, channel=self)

    @property
    def logger(self) -> Any:
        """The logger this channel writes to (not owned by the channel)."""
        return self._core.logger

    @property
    def name(self) -> str:
        """The namespace of the channel's health metrics."""
        return self._core.name

    @property
    def capacity(self) -> int:
        """The most entries pending at once."""
        return self._core.capacity

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._core.closed

    def __enter__(self) -> MetricsChannel:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        core = self._core
        return (
            f"{type(self).__name__}(name={core.name!r}, logger={type(core.logger).__name__}, "
            f"capacity={core.capacity}, closed={core.closed})"
        )

    def _after_fork_in_child(self) -> None:
        core = self._core
        if isinstance(core, _ChannelCore):
            self._finalizer.detach()
            self._core = _ForwardingCore(core)
            core.forget_after_fork()


class MetricsHandle:
    """A picklable, non-owning reference to a :class:`MetricsChannel`.

    Get one from :meth:`MetricsChannel.handle` and send it to workers:
    multiprocessing workers (fork or spawn), Ray actors on the same machine.
    It has the channel's :meth:`submit_metrics` signature and never blocks
    nor raises because of the transport.

    - In the channel's process, it submits to the channel directly and keeps
      the channel alive (it never closes it: a channel referenced by nobody
      but its handles is still usable, and is stopped when the last one goes).
    - In another process, it pickles ``(namespace, metrics, step, meta)``
      and sends it as one datagram to the channel's Unix-domain socket
      through a non-blocking socket. If the owner's socket queue is full,
      the payload is coalesced into a small per-namespace backlog that is
      sent first on the next submission or by :meth:`flush`; if the owner is
      gone, or the payload cannot be pickled or exceeds 64 KiB, it is
      dropped and counted in :attr:`dropped`.

    The handle never closes the channel. A forked child that inherited the
    channel itself (not a handle) may use it too: there it behaves like a
    handle. Unix-domain sockets only reach processes on the same machine.
    """

    __slots__ = ("__weakref__", "_channel", "_meta", "_path", "_sender", "_token")

    def __init__(
        self,
        token: str,
        path: str | None,
        meta: Mapping[str, Any] | None = None,
        *,
        channel: MetricsChannel | None = None,
    ) -> None:
        self._token = token
        self._path = path
        self._meta = dict(meta) if meta else None
        self._channel = channel
        self._sender = None if channel is not None else _SocketSender(path)

    def submit_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int | None = None,
        *,
        namespace: str = "",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Submits one payload to the channel; returns at once.

        Same arguments and values as :meth:`MetricsChannel.submit_metrics`.
        The handle's own ``meta`` is merged under ``meta``.

        Raises:
            TypeError: if ``metrics`` is not a mapping from ``str`` names to
                loggable values, or ``namespace`` is not a ``str``.
        """
        if self._meta is not None:
            meta = self._meta if meta is None else {**self._meta, **meta}
        channel = self._channel
        if channel is not None:
            channel.submit_metrics(metrics, step, namespace=namespace, meta=meta)
            return
        sender = self._sender
        assert sender is not None
        sender.send(_check_metrics(metrics, namespace, "MetricsHandle"), step, namespace, meta)

    def flush(self, timeout: float | None = None) -> bool:
        """Pushes what the handle holds towards the channel.

        In the channel's process, this is :meth:`MetricsChannel.flush`. In
        another process, it retries the backlog held while the owner's socket
        queue was full; it does not wait for the owner to log (a worker
        cannot see that), so call it before a worker exits.

        Args:
            timeout (float, optional): the most seconds to wait. Defaults to
                ``None`` (until the backlog is sent).

        Returns:
            ``True`` if nothing is left in the handle.
        """
        if self._channel is not None:
            return self._channel.flush(timeout)
        assert self._sender is not None
        return self._sender.flush(timeout)

    @property
    def dropped(self) -> int:
        """Payloads this handle dropped in transit (owner gone, payload unpicklable or too large).

        Always ``0`` in the channel's own process, where the channel counts its drops.
        """
        return self._sender.dropped if self._sender is not None else 0

    @property
    def coalesced(self) -> int:
        """Payloads merged into the handle's backlog while the owner's queue was full."""
        return self._sender.coalesced if self._sender is not None else 0

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_handle, (self._token, self._path, self._meta))

    def __repr__(self) -> str:
        where = "local" if self._channel is not None else f"socket={self._path!r}"
        return f"{type(self).__name__}({where})"


def _rebuild_handle(token: str, path: str | None, meta: Mapping[str, Any] | None) -> MetricsHandle:
    channel = _CHANNELS.get(token)
    # A forked child holds a forwarding copy of the channel, which may predate the
    # owner's socket: the handle's path is the one to send to.
    if channel is not None and isinstance(channel._core, _ChannelCore):
        return MetricsHandle(token, path, meta, channel=channel)
    return MetricsHandle(token, path, meta)


def _close_at_exit() -> None:
    """Gives live channels of this process a bounded chance to deliver before exit.

    Their threads are daemons, which the interpreter would otherwise stop with
    entries still pending. Close callbacks run, pending entries are delivered,
    and health is logged only if it changed, within ``_EXIT_TIMEOUT`` seconds
    in all.
    """
    deadline = time.monotonic() + _EXIT_TIMEOUT
    for channel in list(_CHANNELS.values()):
        core = channel._core
        if not isinstance(core, _ChannelCore) or core._pid != os.getpid() or core._close_requested:
            continue
        try:
            core.close(max(0.0, deadline - time.monotonic()), at_exit=True)
        except Exception:  # on_error="raise": nobody is left to catch it
            pass


def _after_fork_in_child() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    _SocketSender._sockets = None
    for channel in list(_CHANNELS.values()):
        channel._after_fork_in_child()


atexit.register(_close_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
