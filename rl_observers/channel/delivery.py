"""The owner's delivery: the one place where pending payloads become logger calls (or a :class:`Router`'s rows)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from torchrl._utils import logger as torchrl_logger

from rl_observers.channel.payload import Payload, expand

__all__ = ["Delivery", "Router", "Row", "counts_line", "health_problem", "register_router"]

#: One logger call: ``(namespace, metrics, step)``.
Row = tuple[str, dict[str, Any], "int | None"]
# The most seconds close() without a timeout waits for a logger call that does not return.
CLOSE_STALL_TIMEOUT = 30.0
# Seconds the thread gathers entries once they come closer than that: each wake-up takes the
# GIL from the source thread, so under steady traffic it wakes once per burst, not per entry.
GATHER_SECONDS = 0.05
#: The least seconds between two warnings of a sink that keeps failing (the first warns at once).
REPEAT_WARNING_SECONDS = 60.0


class Router(Protocol):
    """Owner-side handling of the payloads of one class, on the channel's thread.

    Each row returned is its own logger call: a refused row does not stop the next.
    """

    def route(self, payload: Any) -> Iterable[Row]:
        """Takes one payload; returns the rows now due."""

    # Optional: ``tick() -> Iterable[Row]``, rows due with time alone, asked for at least once a second.

    def finish(self) -> Iterable[Row]:
        """The last rows, when the channel closes (an error here goes through ``on_error``)."""


def counts_line(counts: Mapping[str, int]) -> str:
    """The channel's counts a warning shows.

    Examples:
        >>> counts_line({"submitted": 5, "logged": 2, "pending": 0, "dropped": 1, "sink_errors": 2})
        'submitted 5, logged 2, pending 0, dropped 1, failed (sink_errors) 2'
    """
    labels = {"sink_errors": "failed (sink_errors)", "copies_lost": "copies lost"}
    keys = ("submitted", "logged", "pending", "coalesced", "dropped", "sink_errors", "copies_lost")
    return ", ".join(
        f"{labels.get(key, key)} {counts[key]}"
        for key in keys  # coalesced and copies_lost only when some
        if counts.get(key) or (key in counts and key not in ("coalesced", "copies_lost"))
    )


def health_problem(counts: Mapping[str, int], capacity: int) -> bool:
    """Whether the counters show something wrong: losses, coalescing, sink errors, or a half-full queue.

    Examples:
        >>> from rl_observers.channel.delivery import health_problem
        >>> health_problem({"pending": 0, "dropped": 0, "sink_errors": 0}, capacity=8)
        False
        >>> health_problem({"pending": 4, "dropped": 0, "sink_errors": 0}, capacity=8)
        True
    """
    if counts.get("pending", 0) >= max(1, capacity // 2):
        return True
    return any(counts.get(key, 0) for key in ("dropped", "coalesced", "sink_errors", "copies_lost"))


_ROUTER_FACTORIES: dict[type, Callable[[], Router]] = {}


def register_router(kind: type[Payload], factory: Callable[[], Router]) -> None:
    """Gives every channel a router for class ``kind``: ``factory()``, called once per channel when first needed."""
    _ROUTER_FACTORIES[kind] = factory


class Delivery:
    """Writes the owner's queue's entries to its logger, with the channel's error policy and health.

    Args:
        owner (Owner): the channel's state here: its logger, queue, policy, wing and health.
        health_interval, log_health: as for :class:`~rl_observers.MetricsChannel`.
    """

    watchers: tuple[Callable[[str, Any, dict[str, Any], int | None], None], ...] = ()

    def __init__(self, owner: Any, health_interval: float | None, log_health: bool) -> None:
        self.logger = logger = owner.logger
        log_metrics = getattr(logger, "log_metrics", None)
        self._log_metrics = log_metrics if callable(log_metrics) else None
        self._log_scalar = getattr(logger, "log_scalar", None)
        self.queue = queue = owner.queue
        self.on_error, self.name = owner.on_error, owner.name
        self._poll = owner.wing.poll
        self._health_interval = health_interval
        self._log_health_always = log_health
        # failures (sink, partials, routers, health) and the queue's losses: new ones since flush/close?
        self.failures = 0
        self._failures_seen = 0
        self._lost_seen = queue.losses()[0]
        self._routers: dict[type, Router] = {}
        self._failing = False  # in a streak of failures (counted by _warn_failure)
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._counts = owner.health
        self._health_time = time.monotonic()
        self._health_counts = self._counts()
        self._health_step = 0
        # health report when the thread stops: "always" (close) or "changed" (exit)
        self.final_health = "always"
        self._stopping = False
        self._lock = threading.Lock()  # one deliverer at a time without a thread
        self._wake = threading.Event()
        # True while the thread waits with nothing to do: only then does a submission wake it
        self._asleep = False
        # a backlog this long wakes a gathering thread (below health_problem's half capacity)
        self._backlog = max(1, queue.capacity // 4)
        self.thread: threading.Thread | None = None
        if owner.background:
            name = f"MetricsChannel[{self.name}]"
            self.thread = threading.Thread(target=self._run, name=name, daemon=True)
            self.thread.start()

    def add_router(self, kind: type[Payload], router: Router) -> None:
        self._routers[kind] = router

    def router(self, kind: type[Payload]) -> Router | None:
        """The router of the payloads of class ``kind`` (created from a registered factory if needed)."""
        router = self._routers.get(kind)
        if router is None and kind in _ROUTER_FACTORIES:
            router = self._routers.setdefault(kind, _ROUTER_FACTORIES[kind]())
        return router

    def wake(self) -> None:
        """Called after each put: wakes the thread only if it sleeps or the backlog grows."""
        if (self._asleep or self.queue.backlog() >= self._backlog) and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        try:  # MLflow keeps its active run per thread: resume the logger's run in this one
            experiment = getattr(self.logger, "experiment", None)
            run_id = getattr(getattr(experiment, "info", None), "run_id", None)
            if type(experiment).__module__.startswith("mlflow") and run_id is not None:
                import mlflow

                active = mlflow.active_run()
                if active is None or active.info.run_id != run_id:
                    mlflow.start_run(run_id=run_id)
        except Exception as err:
            self.report(err, "could not bind its logger to the channel's thread")
        timeout = 1.0
        if self._health_interval is not None:
            timeout = min(timeout, max(self._health_interval, 0.01))
        gather = min(GATHER_SECONDS, timeout)
        gathering = False
        last = -gather
        queue = self.queue
        while True:
            if gathering:
                self._wake.wait(gather)  # submissions do not wake it; flush, close, a backlog do
            else:
                self._asleep = True
                if queue.empty():  # checked after _asleep is set: a put before it is seen here
                    self._wake.wait(timeout)
                self._asleep = False
            self._wake.clear()
            count = self.drain()
            if count:
                now = time.monotonic()
                gathering = gathering or now - last < gather  # entries keep coming: gather
                last = now
            else:
                gathering = False
            if self._stopping:
                if queue.empty():
                    break
                continue
            self._router_rows("tick")
            self._log_health()
        self._final_delivery()

    def drain(self) -> int:
        """Delivers pending entries until none is left; returns how many."""
        count = 0
        queue = self.queue
        while True:
            entry = queue.take()
            if entry is None:
                return count
            payload = entry.payload
            try:  # a router's factory may raise too
                router = None if payload.__class__ is Payload else self.router(payload.__class__)
                rows = router.route(payload) if router is not None else ((payload.namespace, payload.metrics, payload.step),)
                delivered = self._write_rows(rows, "failed to log namespace")
            except Exception as err:
                delivered = False
                self.report(err, f"failed to log namespace {entry.namespace!r}")
            if delivered:
                self._failing = False
            queue.done(entry, delivered)
            count += 1

    def _write_rows(self, rows: Iterable[Row], what: str) -> bool:
        """Writes each row in its own try (one refused row loses no other); whether all went."""
        written = True
        for namespace, metrics, step in rows:
            try:
                payload = expand(namespace, metrics)
                if payload:
                    self.write(payload, step)
                for watch in self.watchers:
                    watch(namespace, metrics, payload, step)
            except Exception as err:
                written = False
                self.report(err, f"{what} {namespace!r}")
        return written

    def _router_rows(self, method: str) -> None:
        """Writes the rows of each router's ``tick`` or ``finish`` (at close); a failure stops no other."""
        last = "the last rows of " if method == "finish" else ""
        what = f"failed to log {last}namespace"
        for kind, router in list(self._routers.items()):
            call = getattr(router, method, None)
            try:
                if call is not None:
                    self._write_rows(call(), what)
            except Exception as err:
                self.report(err, f"failed to {method} the router of {kind.__name__}")

    def write(self, payload: dict[str, Any], step: int | None) -> None:
        """One logger call."""
        if self._log_metrics is not None:
            self._log_metrics(payload, step=step)
        else:
            for name, value in payload.items():
                self._log_scalar(name, value, step)

    def report(self, err: BaseException, what: str) -> None:
        """Applies the ``on_error`` policy to a failure of the sink or of a partial."""
        self.failures += 1
        if self.on_error == "raise":
            with self._error_lock:
                if self._error is None:
                    self._error = err
        elif self.on_error == "warn":
            self._warn_failure(err, what)
        self._failing = True

    def _warn_failure(self, err: BaseException, what: str) -> None:
        # at a streak's first failure, then once per REPEAT_WARNING_SECONDS with the counts so far
        now = time.monotonic()
        if not self._failing:  # the streak's first failure
            self._streak_failures, self._unwarned_failures, self._warned_at = 1, 0, now
            torchrl_logger.warning(
                f"MetricsChannel {self.name!r} {what}: {err!r}. While failures go on "
                f"this is repeated at most once every {REPEAT_WARNING_SECONDS:g} seconds, with "
                "the counts; see channel.health()."
            )
            return
        self._streak_failures += 1
        self._unwarned_failures += 1
        if now - self._warned_at < REPEAT_WARNING_SECONDS:
            return
        since, self._unwarned_failures, self._warned_at = self._unwarned_failures, 0, now
        torchrl_logger.warning(
            f"MetricsChannel {self.name!r}: the logger is still failing: {since} more "
            f"failure(s) since the previous warning, {self._streak_failures} in this streak; "
            f"the latest {what}: {err!r}. {counts_line(self._counts())}."
        )

    def clean_since_last_check(self) -> bool:
        """Whether nothing failed nor was lost since the previous call (what flush/close return)."""
        seen = self._failures_seen, self._lost_seen
        self._failures_seen, self._lost_seen = self.failures, self.queue.losses()[0]
        return seen == (self._failures_seen, self._lost_seen)

    def raise_stored_error(self) -> None:
        with self._error_lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _log_health(self, when: str = "due") -> None:
        """Logs the health counters: ``"due"`` (changed, interval elapsed), ``"changed"``, ``"always"``."""
        if self._health_interval is None:
            return
        now = time.monotonic()
        if when == "due" and now - self._health_time < self._health_interval:
            return
        counts = self._counts()
        if when != "always" and counts == self._health_counts:
            return
        if not self._log_health_always and not health_problem(counts, self.queue.capacity):
            return  # quiet while all is well
        self._health_time = now
        self._health_counts = counts
        payload = {f"{self.name}/{key}": value for key, value in counts.items()}
        step, self._health_step = self._health_step, self._health_step + 1
        try:
            self.write(payload, step)
        except Exception as err:
            self.report(err, "failed to log its health")

    def flush(self, deadline: float | None) -> bool:
        self._poll(deadline)
        if self.thread is None:
            with self._lock:
                self.drain()
            done = True
        else:
            self._wake.set()  # cuts a gathering wait short
            done = self.queue.wait_processed(deadline)
        clean = self.clean_since_last_check()
        self.raise_stored_error()
        return done and clean

    def step(self) -> int:
        if self.thread is not None:
            raise RuntimeError(
                "MetricsChannel.step() drives a channel created with background=False; "
                "this channel has its own thread, use flush() to wait for it."
            )
        with self._lock:
            self._poll(None)
            count = self.drain()
            self._router_rows("tick")
            self._log_health()
        self.raise_stored_error()
        return count

    def _final_delivery(self) -> None:
        with self._lock:
            self.drain()
            self._router_rows("finish")
            self._log_health(self.final_health)

    def stop(self, at_exit: bool) -> None:
        """Asks the thread to deliver what is left and stop (or delivers it here)."""
        if at_exit:
            self.final_health = "changed"
        self._stopping = True
        self._wake.set()
        if self.thread is None and not at_exit:
            self._final_delivery()
        elif self.thread is None:  # never hang the interpreter's exit on a blocking logger
            name = f"MetricsChannel[{self.name}].exit"
            self.thread = threading.Thread(target=self._final_delivery, name=name, daemon=True)
            self.thread.start()

    def release(self) -> None:
        """Lets the thread stop once it has drained (no lock: runs in a finalizer)."""
        self._stopping = True

    def join(self, deadline: float | None) -> bool:
        """Waits for the thread to stop (see :meth:`MetricsChannel.close`)."""
        thread = self.thread
        if thread is None:
            return True
        if deadline is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            return not thread.is_alive()
        # no deadline: wait while the logger makes progress, give up once a call hung CLOSE_STALL_TIMEOUT
        seen, since = -1, time.monotonic()
        while True:
            thread.join(0.05)
            if not thread.is_alive():
                return True
            counts = self.queue.counts()
            progress = counts["logged"] + counts["sink_errors"]
            now = time.monotonic()
            if progress != seen:
                seen, since = progress, now
            elif now - since >= CLOSE_STALL_TIMEOUT:
                if self.on_error != "ignore":
                    torchrl_logger.warning(
                        f"MetricsChannel {self.name!r}: its logger has not returned from a call "
                        f"for {CLOSE_STALL_TIMEOUT:g} seconds; close() gives up with "
                        f"{counts['pending']} entries not delivered. The channel's daemon thread "
                        "is left behind and delivers them if the logger ever returns."
                    )
                return False
