"""Merging what several workers report into one view, at the channel's owner.

Step **channel → logger**, at the owner. :class:`AggregationRouter` is the
channel's router for :class:`~rl_observers.remote.window.Window` payloads:
it keeps one :class:`Aggregate` per observer name, which merges the windows
that copies running elsewhere contribute and logs by ``scope``
(``"aggregate"``, ``"per_worker"``, ``"both"``; see ``docs/distributed.rst``,
"Scopes"). It knows nothing of RL: a window is a flat mapping of gauges and
partials, its worker, its counters and the observer's schedule.

Examples:
    >>> from rl_observers.remote.aggregate import Aggregate
    >>> from rl_observers.stats import Count
    >>> from torchrl.record.loggers.monitoring import Every
    >>> agg = Aggregate("collector", schedule=Every.counter("frames", 100), step_key="frames")
    >>> agg.contribute(0, {"frames": 60.0, "dones": Count("dones", 2)}, {"frames": 60})
    []
    >>> rows = agg.contribute(1, {"frames": 50.0, "dones": Count("dones", 1)}, {"frames": 50})
    >>> [(namespace, step, metrics["frames"], metrics["dones"].n) for namespace, metrics, step in rows]
    [('collector', 110, 110.0, 3.0)]
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rl_observers.channel import MetricsChannel, register_router
from rl_observers.channel.delivery import Row
from rl_observers.channel.payload import coalesce, is_partial
from rl_observers.remote.window import AggregateSpec, Window, worker_key
from rl_observers.schedule import ScheduleClock
from rl_observers.stats import LatestWindow

torchrl_logger = logging.getLogger("torchrl")

__all__ = [
    "Aggregate",
    "AggregateSpec",
    "AggregationRouter",
    "Row",
    "aggregate_state",
    "finish_aggregate",
    "has_aggregate",
    "load_aggregate_state",
]

#: Seconds without a contribution after which a worker no longer counts as reporting.
STALE_AFTER = 10.0


def _plus(base: Mapping[str, float], values: Mapping[str, float]) -> dict[str, float]:
    out = dict(base)
    for key, value in values.items():
        out[key] = out.get(key, 0) + value
    return out


def _rolling(window: Mapping[str, Any]) -> dict[str, Any]:
    """The partials of ``window`` that describe a state carried from row to row (the last N episodes)."""
    return {k: v for k, v in window.items() if getattr(v, "rolling", False)}


def _saved_rolling(window: Mapping[str, Any]) -> dict[str, Any]:
    """The rolling partials of ``window`` as plain values (what a torchrl ``Checkpoint`` stores)."""
    return {
        key: {
            "size": part.size,
            "names": list(part.names),
            "stats": [list(s) for s in part.stats],
            "entries": [[list(k), list(values)] for k, values in part.entries],
        }
        for key, part in _rolling(window).items()
        if isinstance(part, LatestWindow)
    }


def _restored_rolling(saved: Mapping[str, Any] | None) -> dict[str, Any]:
    """Rebuilds :func:`_saved_rolling`, moved below step 0 (a resumed run's copies stamp from 0 again)."""
    out: dict[str, Any] = {}
    for key, part in (saved or {}).items():
        entries = [(tuple(k), tuple(values)) for k, values in part["entries"]]
        shift = max((k[0] for k, _ in entries), default=-1) + 1
        entries = [((k[0] - shift, *k[1:]), values) for k, values in entries]
        out[key] = LatestWindow(part["size"], part["names"], stats=part["stats"], entries=entries)
    return out


@dataclass(slots=True, eq=False)
class _Worker:
    clock: ScheduleClock
    label: str  # its rows' namespace suffix: worker_<index>
    # where a resumed run's worker started counting, and its cumulative gauges
    base: dict[str, float] = field(default_factory=dict)
    base_gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, Any] = field(default_factory=dict)
    window: dict[str, Any] = field(default_factory=dict)
    fresh: bool = False  # contributed since its last row (gauges alone count too)
    last_seen: float = field(default_factory=time.monotonic)


class Aggregate:
    """The owner-side view of one observer's contributions from all workers.

    Args:
        name (str): the observer's namespace.

    Keyword Args:
        **how: how the windows merge, the fields of
            :class:`~rl_observers.remote.window.AggregateSpec` (``step_key``
            defaults to the schedule's counter).
    """

    def __init__(self, name: str, **how: Any) -> None:
        self.name = name
        self.spec = AggregateSpec(**how)
        schedule = self.spec.schedule
        self.clock = ScheduleClock(schedule)
        self._key = key = schedule.key if schedule and schedule.kind == "counter" else None
        self.spec.step_key = self.spec.step_key or key
        if key is not None:
            self.clock.due(0)  # counters start at zero
        self._workers: dict[tuple[Any, str | None], _Worker] = {}
        # the same workers, the one seen longest ago first: stale ones are counted from the front
        self._seen: OrderedDict[tuple[Any, str | None], _Worker] = OrderedDict()
        # gauges (the newest value for ``latest`` ones) and counters summed over workers, kept up
        # to date by each contribution: a row costs O(its metrics), not O(workers)
        self._gauges: dict[str, Any] = {}
        self._totals: dict[str, float] = {}
        self._processes_per_index: dict[Any, int] = {}
        self._window: dict[str, Any] = {}
        self._fresh = False
        # what a resumed run starts from, per worker index (see load_state_dict)
        self._worker_base: dict[Any, dict[str, Any]] = {}
        self._gauge_base: dict[str, float] = {}
        # lockstep copies (see remote/lockstep.py): their windows wait here, per worker index, until
        # every worker's window of a cut is in; the cuts due, with when each was first heard of
        self._staged: dict[Any, deque[Window]] = {}
        self._cuts_due: dict[int, float] = {}
        self._released = -1  # the last cut logged: a late window's cut goes into the next row
        # observed rows: when the first worker was heard from; whether a row fell due before all were
        self._first_heard: float | None = None
        self._held_row = False
        self._missing_warned: set[Any] = set()

    @classmethod
    def from_spec(cls, name: str, spec: AggregateSpec | None) -> Aggregate:
        """The aggregate of the observer ``name`` whose windows say ``spec``."""
        return cls(name, **{f.name: getattr(spec, f.name) for f in fields(spec)} if spec else {})

    def state_dict(self) -> dict[str, Any]:
        """The counters summed over workers, each worker index's counters and the schedules' baselines.

        With the rolling partials (the last N episodes); other windows not
        logged yet are not kept.
        """
        workers: dict[Any, dict[str, Any]] = {}
        for (index, _), state in self._workers.items():
            if index not in workers:  # the first process of each index
                workers[index] = {
                    "counters": _plus(state.base, state.counters),
                    "gauges": _plus(state.base_gauges, self._cumulative(state.gauges)),
                    "clock": state.clock.state_dict(),
                    "rolling": _saved_rolling(state.window),
                }
        for index, base in self._worker_base.items():
            workers.setdefault(index, base)
        gauges: dict[str, float] = dict(self._gauge_base)
        for state in self._workers.values():
            gauges = _plus(gauges, self._cumulative(state.gauges))
        return {
            "totals": dict(self._totals),
            "gauges": gauges,
            "clock": self.clock.state_dict(),
            "workers": workers,
            "rolling": _saved_rolling(self._window),
        }

    def _cumulative(self, gauges: Mapping[str, Any]) -> dict[str, float]:
        """The gauges that add up across workers (not the ``latest`` ones)."""
        return {k: float(v) for k, v in gauges.items() if k not in self.spec.latest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`: later contributions count on top of it."""
        self._totals = {k: float(v) for k, v in state["totals"].items()}
        self._gauge_base = {k: float(v) for k, v in state.get("gauges", {}).items()}
        self.clock.load_state_dict(state["clock"])
        self._worker_base = {index: dict(saved) for index, saved in state.get("workers", {}).items()}
        self._window = {**self._window, **_restored_rolling(state.get("rolling"))}

    @property
    def per_worker(self) -> bool:
        return self.spec.scope in ("per_worker", "both")

    @property
    def aggregate(self) -> bool:
        return self.spec.scope in ("aggregate", "both")

    def contribute(
        self,
        worker: Any,
        metrics: Mapping[str, Any],
        counters: Mapping[str, float],
        process: str | None = None,
        base: Mapping[str, float] | None = None,
    ) -> list[Row]:
        """Folds one worker's window in; returns the rows now due.

        A row is due when the summed counters cross a threshold, once every
        worker was heard from (or ``timeout`` seconds passed). A worker is its
        index *and* its process; a second process with an index logs as
        ``worker_<index>_2``. ``base``: what the worker's source had counted
        before its copy did (a restored collector); no threshold fires for it.
        """
        who = (worker, process)
        state = self._state_of(worker, process, base)
        state.last_seen = time.monotonic()
        self._seen.move_to_end(who)
        totals = self._totals
        previous = state.counters
        for key, value in previous.items():
            if key not in counters:
                totals[key] -= value
        for key, value in counters.items():
            totals[key] = totals.get(key, 0) + value - previous.get(key, 0)
        state.counters = dict(counters)
        partials = {}
        sums = self._gauges
        latest = self.spec.latest
        mine = state.gauges
        for name, value in metrics.items():
            if is_partial(value):
                partials[name] = value
                continue
            if name in latest:
                sums[name] = value
            elif name in mine:
                sums[name] = sums[name] + (value - mine[name])
            else:
                sums[name] = sums.get(name, 0) + value
            mine[name] = value
        rows: list[Row] = []
        if self.per_worker:
            if (error := coalesce(state.window, partials)) is not None:
                raise error
            state.fresh = True
            counter = counters.get(self._key) if self._key else None
            if counter is not None and state.base:
                counter += state.base.get(self._key, 0)
            if state.clock.due(counter):
                rows.append(self._worker_row(state))
        if self.aggregate:
            if (error := coalesce(self._window, partials)) is not None:
                raise error
            self._fresh = True
            if not self.spec.lockstep:
                if self._first_heard is None:
                    self._first_heard = time.monotonic()
                total = self._totals.get(self._key, 0) if self._key else None
                if self.clock.due(total) or self._held_row:
                    self._held_row = not self._everyone_heard(time.monotonic())
                    if not self._held_row:
                        rows.append(self._aggregate_row())
        return rows

    def _everyone_heard(self, now: float) -> bool:
        """Whether each of the source's workers was heard from, or the wait for them is over."""
        expected = self.spec.workers
        heard = {index for index, _ in self._workers}
        missing = [w for w in range(expected) if w not in heard]
        if not missing:
            return True
        if self._first_heard is not None and now - self._first_heard >= self.spec.timeout:
            self._warn_missing(missing, "has not been heard from")
            return True
        return False

    # -- lockstep copies: rows where the driver's fall -------------------------------------------

    def receive(self, window: Window) -> list[Row]:
        """Takes one window; returns the rows now due.

        A lockstep window (``window.cut``) waits until every worker's window
        of its cut is in, or ``timeout`` seconds; others are folded at once.
        """
        if window.cut is None or not self.spec.lockstep:
            return self._fold(window)
        # a cut is on the copy's axis; its saved state (a resumed run) went on from further
        window.cut += self._state_of(window.worker, window.process, window.base).base.get(self._key, 0)
        self._staged.setdefault(worker_key(window.worker), deque()).append(window)
        if window.due and window.cut > self._released:
            self._cuts_due.setdefault(window.cut, time.monotonic())
        return self.overdue(time.monotonic())

    def overdue(self, now: float, everything: bool = False) -> list[Row]:
        """The rows whose cuts are complete, or waited for ``timeout`` seconds (all, ``everything``)."""
        rows: list[Row] = []
        while self._cuts_due:
            cut = min(self._cuts_due)
            holding = [w for w, staged in self._staged.items() if any(x.due and x.cut == cut for x in staged)]
            missing = [w for w in range(self.spec.workers) if w not in holding]
            if missing and not everything and now - self._cuts_due[cut] < self.spec.timeout:
                break
            del self._cuts_due[cut]
            # at the end (everything), a cut some workers never reached is no row of the
            # driver's: it is logged at what was counted (a free run stopped between cuts)
            ended_short = bool(missing) and everything
            if missing and not everything:
                self._warn_missing(missing, f"sent nothing for the row at {cut}")
            rows.extend(self._fold_staged(cut))
            self._released = cut
            if self.aggregate:
                rows.append(self._aggregate_row(step=None if ended_short else cut, reporting=len(holding)))
        if self._held_row and self._everyone_heard(now):
            self._held_row = False  # an observed row held for a silent worker: its wait is over
            rows.append(self._aggregate_row())
        return rows

    def _fold_staged(self, cut: float) -> list[Row]:
        """Folds every staged window up to ``cut`` in (their per-worker rows, if any, are returned)."""
        rows: list[Row] = []
        for staged in self._staged.values():
            while staged and (staged[0].cut is None or staged[0].cut <= cut):
                rows.extend(self._fold(staged.popleft()))
        return rows

    def _fold(self, window: Window) -> list[Row]:
        if not (window.metrics or window.counters):
            return []
        worker, counters = window.worker, window.counters or {}
        return self.contribute(worker, window.metrics, counters, window.process, window.base)

    def _warn_missing(self, missing: list[Any], what: str) -> None:
        new = [w for w in missing if w not in self._missing_warned]
        self._missing_warned.update(new)
        if new:
            workers = ", ".join(f"worker {w}" for w in new)
            torchrl_logger.warning(
                f"LoggerObserver {self.name!r}: {workers} {what} within {self.spec.timeout:g} s "
                "(worker_timeout): its rows are logged without it (workers_reporting says how many "
                "workers each row holds); what it sends later goes into the next row. This is "
                "reported once per worker."
            )

    def _state_of(self, worker: Any, process: str | None, base: Mapping[str, float] | None) -> _Worker:
        """The worker's state; at its first window, where its counts go on from."""
        state = self._workers.get((worker, process))
        if state is not None:
            return state
        base = base or {}
        n = self._processes_per_index[worker] = self._processes_per_index.get(worker, 0) + 1
        label = f"worker_{worker}" if n == 1 else f"worker_{worker}_{n}"
        state = _Worker(ScheduleClock(self.spec.schedule), label)
        self._workers[(worker, process)] = self._seen[(worker, process)] = state
        saved = self._worker_base.pop(worker, None) if n == 1 else None
        if saved is not None:  # a resumed run with its saved state: this index goes on from it
            # the copy's counters hold its source's restored counts, which the saved ones hold too
            state.base = {k: v - base.get(k, 0) for k, v in saved["counters"].items()}
            state.base_gauges = {k: v - base.get(k, 0) for k, v in saved.get("gauges", {}).items()}
            for name, value in base.items():
                if name in self._totals:
                    self._totals[name] -= value
                if name in self._gauge_base:
                    self._gauge_base[name] -= value
            if saved.get("clock") is not None:
                state.clock.load_state_dict(saved["clock"])
            state.window = _restored_rolling(saved.get("rolling"))
        elif self._key is not None and base.get(self._key):
            # no saved state: the source's restored count is where this run's thresholds start
            prior = self._totals.get(self._key, 0) + base[self._key]
            if self.clock.last_counter is None or prior > self.clock.last_counter:
                self.clock.rebase(prior)
        if self._key is not None and state.clock.last_counter is None:
            state.clock.due(state.base.get(self._key, 0) + base.get(self._key, 0))
        return state

    def finish(self) -> list[Row]:
        """The last partial windows (if ``log_on_close``); the state is reset."""
        rows = self.overdue(time.monotonic(), everything=True)
        rows.extend(self._fold_staged(float("inf")))
        if self._held_row:
            self._held_row = False
            rows.append(self._aggregate_row())
        if self.spec.log_on_close:
            if self.per_worker:
                rows.extend(self._worker_row(s) for s in self._workers.values() if s.fresh)
            if self.aggregate and self._fresh:
                rows.append(self._aggregate_row())
        return rows

    # -- rows -------------------------------------------------------------------------------------

    def _step(self, counters: Mapping[str, float]) -> int | None:
        key = self.spec.step_key
        value = counters.get(key) if key else None
        return None if value is None else int(value)

    def _with_base(self, gauges: Mapping[str, Any], base: Mapping[str, float]) -> dict[str, Any]:
        """``gauges``, the cumulative ones counted on from where a resumed run started."""
        latest = self.spec.latest
        return {k: v + base[k] if k in base and k not in latest else v for k, v in gauges.items()}

    def _worker_row(self, state: _Worker) -> Row:
        metrics = {**self._with_base(state.gauges, state.base_gauges), **state.window}
        # a copy re-sends its whole rolling state: merging it again is exact
        state.window = _rolling(state.window)
        state.fresh = False
        state.clock.fired()
        counters = state.counters
        if state.base:
            counters = {k: state.base.get(k, 0) + v for k, v in counters.items()}
        return f"{self.name}/{state.label}", metrics, self._step(counters)

    def _aggregate_row(self, step: int | None = None, reporting: int | None = None) -> Row:
        """The aggregate's row; ``step`` and ``reporting`` (workers it holds) where the cut says them."""
        gauges = self._with_base(self._gauges, self._gauge_base)
        stale_before = time.monotonic() - STALE_AFTER
        stale = 0
        for state in self._seen.values():  # the one seen longest ago first
            if state.last_seen > stale_before:
                break
            stale += 1
        gauges["workers"] = max(len(self._workers), self.spec.workers)
        gauges["workers_reporting"] = len(self._workers) - stale if reporting is None else reporting
        metrics = {**gauges, **self._window}
        if self._seen:  # a worker's silence is measured here, where it shows
            silent = time.monotonic() - next(iter(self._seen.values())).last_seen
            metrics.update({k: silent for k, v in self._window.items() if getattr(v, "silence", False)})
        # A partial that describes a state (the last N episodes) carries over to the next row.
        self._window = _rolling(self._window)
        self._fresh = False
        self.clock.fired()
        return self.name, metrics, self._step(self._totals) if step is None else int(step)


class AggregationRouter:
    """The channel's router for workers' contributions: one :class:`Aggregate` per observer name."""

    def __init__(self) -> None:
        self.aggregates: dict[str, Aggregate] = {}
        # saved states waiting for their aggregate's first contribution (a resumed run)
        self.restored: dict[str, Mapping[str, Any]] = {}
        self.lock = threading.Lock()  # route (the delivery thread) vs. state reads and loads

    def route(self, window: Window) -> list[Row]:
        name = window.observer
        with self.lock:
            aggregate = self.aggregates.get(name)
            if aggregate is None:
                aggregate = self.aggregates[name] = Aggregate.from_spec(name, window.spec)
                restored = self.restored.pop(name, None)
                if restored is not None:
                    aggregate.load_state_dict(restored)
            rows = aggregate.receive(window)
            if window.finish:
                rows.extend(aggregate.finish())
                del self.aggregates[name]
            return rows

    def tick(self) -> list[Row]:
        """The rows whose wait for a silent worker is over (called by the channel's thread)."""
        with self.lock:
            now = time.monotonic()
            return [row for aggregate in self.aggregates.values() for row in aggregate.overdue(now)]

    def finish(self) -> Iterator[Row]:
        """Every aggregate's last rows; the router is emptied.

        An aggregate that raises does not stop the others: the first error is
        raised after all their rows.
        """
        error: Exception | None = None
        for name in list(self.aggregates):
            try:
                rows = self.aggregates.pop(name).finish()
            except Exception as err:
                error = error or err
                continue
            yield from rows
        if error is not None:
            raise error


register_router(Window, AggregationRouter)


def _owned_router(channel: MetricsChannel | None, what: str) -> AggregationRouter:
    router = None if channel is None else channel._logging.router(Window)
    if not isinstance(router, AggregationRouter):
        raise ValueError(
            f"LoggerObserver: {what} the aggregate of an observer whose copies run elsewhere "
            "needs the channel's owner: call it in the process that created the channel."
        )
    return router


def aggregate_state(channel: MetricsChannel | None, name: str) -> dict[str, Any] | None:
    """The state of the aggregate ``name`` after every contribution sent so far (see :meth:`Aggregate.state_dict`)."""
    router = _owned_router(channel, "saving")
    channel.flush(timeout=10.0)  # type: ignore[union-attr]
    with router.lock:
        aggregate = router.aggregates.get(name)
        if aggregate is not None:
            return aggregate.state_dict()
        restored = router.restored.get(name)
        return None if restored is None else dict(restored)


def load_aggregate_state(channel: MetricsChannel | None, name: str, state: Mapping[str, Any]) -> None:
    """Restores the aggregate ``name`` now, or at its first contribution if it has none yet."""
    router = _owned_router(channel, "loading")
    with router.lock:
        aggregate = router.aggregates.get(name)
        if aggregate is not None:
            aggregate.load_state_dict(state)
        else:
            router.restored[name] = state


def has_aggregate(channel: MetricsChannel, name: str) -> bool:
    """Whether workers contributed windows (delivered or not) for ``name``; ``False`` outside the owner."""
    router = channel._logging.router(Window)
    if isinstance(router, AggregationRouter) and name in router.aggregates:
        return True
    return channel._logging.has_pending(lambda p: p.__class__ is Window and p.observer == name)


def finish_aggregate(channel: MetricsChannel, name: str) -> None:
    """Logs the last windows of the aggregate ``name`` after every contribution sent so far.

    Queues a marker behind what was received: once a later ``channel.flush()``
    returns, the last partial windows have reached the logger.
    """
    channel._logging.receive(timeout=5.0)
    channel.submit_window(Window(name, {}, observer=name, finish=True))
