"""MetricSet: the base class of what a LoggerObserver folds and logs."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl_observers.signals import EVENT_PAYLOADS
from rl_observers.stats import (
    CountReducer,
    Moments,
    MomentsGroupReducer,
    MomentsReducer,
    ObservedCounters,
    Partial,
    QuantileReducer,
    ReducerBank,
)

__all__ = ["MetricSet"]

#: The events a metric set may fold: those that carry data (``post_collect``, ``post_add``,
#: ``post_extend``, ``post_sample``).
DATA_EVENTS: tuple[str, ...] = tuple(event for event, payload in EVENT_PAYLOADS.items() if payload)


def _locked(fold: Callable[..., None]) -> Callable[..., None]:
    """``fold`` run under the set's lock, so a pull from another thread never interleaves."""

    @functools.wraps(fold)
    def locked_fold(self: MetricSet, *args: Any) -> None:
        with self._lock:
            fold(self, *args)

    return locked_fold


class _FoldedEventsAlias:
    """``events``: the former name of :attr:`MetricSet.folded_events`, on classes and instances."""

    def __get__(self, obj: Any, cls: type) -> tuple[str, ...]:
        return (cls if obj is None else obj).folded_events


def _cloned(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _read_counter(lock: Any, counters: ObservedCounters, name: str) -> int:
    with lock:
        return counters.poll()[name]


class MetricSet:
    """Base class of metric sets: what a :class:`~rl_observers.LoggerObserver` folds.

    A subclass defines ``on_<event>(source, ...)`` per event it folds and
    folds into reducers (:meth:`moments`, :meth:`count`, :meth:`quantiles`)
    and counters (:meth:`add_to_counter`); the base holds the lock, the state
    and pickling. An optional ``on_empty(source)`` runs after a replay
    buffer's ``empty()``, outside the lock (take ``self._lock`` there).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rl_observers import MetricSet
        >>> class ActionMagnitude(MetricSet):
        ...     counter_names = ("action_batches",)
        ...
        ...     def on_post_collect(self, source, batch):
        ...         self.moments("action_abs", stats=("mean", "max")).fold(batch["action"].abs())
        ...         self.add_to_counter("action_batches", 1)
        >>> metrics = ActionMagnitude()
        >>> metrics.folded_events
        ('post_collect',)
        >>> batch = TensorDict({"action": torch.tensor([[-1.0], [3.0]])}, batch_size=[2])
        >>> metrics.on_post_collect(None, batch)
        >>> metrics.counters()
        {'action_batches': 1}
        >>> payload = metrics.pull()
        >>> payload["action_batches"], payload["action_abs"].finalize()
        (1.0, {'action_abs_mean': 2.0, 'action_abs_max': 3.0})
    """

    #: Events this set folds; the observer subscribes to these only. Derived from the
    #: ``on_<event>`` methods a subclass defines, unless it declares them.
    folded_events: tuple[str, ...] = ()
    #: The former name of :attr:`folded_events` (read-only alias).
    events = _FoldedEventsAlias()
    #: Cumulative host counters this set keeps (see :meth:`add_to_counter`), in the
    #: order :meth:`counters` lists them.
    counter_names: tuple[str, ...] = ()
    #: Gauges of :meth:`pull` that are not cumulative counters (across workers, the newest
    #: value is kept instead of the sum).
    latest_gauges: tuple[str, ...] = ()
    #: The arguments that turn off what this set follows across batches per environment
    #: (episodes), e.g. ``"episode_return=False"``; ``None``: it follows nothing. A source
    #: whose batches do not say which worker's steps are which refuses such a set.
    episode_arguments: str | None = None
    #: Attributes rebuilt on demand (scratch buffers), not pickled.
    _transient: tuple[str, ...] = ()
    #: Attributes ``state_dict`` holds besides the counters, each under its name without the
    #: leading underscore (a tensor is cloned both ways).
    _saved: tuple[str, ...] = ()
    #: Whether the base wraps the ``on_<event>`` methods a class defines in the lock; a class
    #: that says ``False`` (the built-in sets, which lock only when they fold) locks itself.
    _lock_folds: bool = True
    #: Whether the counters are host ints only (never a device amount): read without the lock.
    _host_counters: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "events" in own and "folded_events" not in own:
            cls.folded_events = tuple(own["events"])
            cls.events = _FoldedEventsAlias()  # type: ignore[assignment]
        elif "folded_events" not in own:
            cls.folded_events = tuple(
                e for e in DATA_EVENTS if callable(getattr(cls, "on_" + e, None))
            )
        for event in cls.folded_events:
            if event not in DATA_EVENTS:
                raise TypeError(
                    f"{cls.__name__}.folded_events must name events among {DATA_EVENTS}, "
                    f"got {event!r}."
                )
            if not callable(getattr(cls, "on_" + event, None)):
                raise TypeError(f"{cls.__name__} folds {event!r} but defines no on_{event} method.")
        if own.get("_lock_folds", True):
            for event in DATA_EVENTS:
                fold = own.get("on_" + event)
                if callable(fold):
                    setattr(cls, "on_" + event, _locked(fold))

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._bank = ReducerBank()
        self._reducers: dict[str, Any] = {}
        # Quantile sketches own their device buffers (see QuantileReducer), pulled next to the bank.
        self._sketches: dict[str, QuantileReducer] = {}
        self._counters = ObservedCounters(self.counter_names)

    # -- what a source decides -------------------------------------------------------

    def bind(self, source: Any) -> None:
        """Resolves what depends on ``source`` before its first event (also on copies in workers, and again when a set rebuilds itself). Defaults to nothing."""

    def check_keys(self, source: Any) -> None:
        """Raises a ``ValueError`` when a key this set reads is provably absent from ``source``'s data.

        Called once at attach time, after :meth:`bind` (not on copies). Defaults to nothing.
        """

    # -- reducers, created on first use ----------------------------------------------

    def moments(
        self, prefix: str, *, stats: Sequence[str] = ("mean", "std", "min", "max")
    ) -> MomentsReducer:
        """The :class:`~rl_observers.stats.MomentsReducer` pulled as ``prefix``, created on first use with ``stats``."""
        return self._reducer(prefix, self._bank.moments, prefix, stats=stats)

    def moments_group(self, specs: Sequence[tuple[str, Sequence[str]]]) -> MomentsGroupReducer:
        """A :class:`~rl_observers.stats.MomentsGroupReducer` keyed by its first prefix, created on first use."""
        return self._reducer(specs[0][0], self._bank.moments_group, specs)

    def count(self, name: str) -> CountReducer:
        """The :class:`~rl_observers.stats.CountReducer` pulled as ``name``, created on first use."""
        return self._reducer(name, self._bank.count, name)

    def _reducer(self, key: str, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        reducer = self._reducers.get(key)
        if reducer is None:
            reducer = self._reducers[key] = make(*args, **kwargs)
        return reducer

    def quantiles(
        self, name: str, *, q: Sequence[float] = (0.05, 0.5, 0.95), accuracy: float = 0.01
    ) -> QuantileReducer:
        """The :class:`~rl_observers.stats.QuantileReducer` of ``name``, created on first use; pulled as ``"<name>_quantiles"``."""
        key = f"{name}_quantiles"
        reducer = self._sketches.get(key)
        if reducer is None:
            reducer = self._sketches[key] = QuantileReducer(name, quantiles=q, accuracy=accuracy)
        return reducer

    def add_to_counter(self, name: str, amount: int | torch.Tensor) -> None:
        """Adds ``amount`` to the cumulative counter ``name``; a device tensor is added once its copy lands (no sync)."""
        if isinstance(amount, torch.Tensor):
            self._counters.add_observed((name,), amount.reshape(()))
        else:
            self._counters.values[name] += amount

    # -- the window and the cumulative state -----------------------------------------

    def counters(self) -> dict[str, float]:
        """Cumulative host counters (:attr:`counter_names`), read without a device sync."""
        with self._lock:
            return dict(self._counters.poll())

    def _counter_reader(self, name: str) -> Callable[[], int] | None:
        """A call returning counter ``name`` as :meth:`counters` would (per-event schedule checks), or ``None``."""
        values = self._counters.values
        if type(self).counters is not MetricSet.counters or name not in values:
            return None
        if self._host_counters:
            return functools.partial(values.__getitem__, name)
        return functools.partial(_read_counter, self._lock, self._counters, name)

    def gauges(self, counters: dict[str, int]) -> dict[str, float]:
        """The cumulative gauges :meth:`pull` reports; defaults to every counter, as a float."""
        return {name: float(value) for name, value in counters.items()}

    def changed_since_pull(self) -> bool:
        """Whether a gauge changed with no event since the last :meth:`pull` (a rollout dropped at shutdown). Defaults to ``False``."""
        return False

    def pull(self) -> dict[str, float | Partial]:
        """Closes the window: :meth:`gauges` and the reducers' partials, in one transfer."""
        with self._lock:
            self._fold_staged()
            partials = self._bank.pull()
            out: dict[str, float | Partial] = dict(self.gauges(self._counters.drain()))
            out.update(partials)
            for key, sketch in self._sketches.items():
                out[key] = sketch.pull()
            return out

    def metric_names(self) -> tuple[str, ...]:
        """The names this set submits and logs, as far as known before its first event (two sets may not share one)."""
        with self._lock:
            names = list(self.gauges(dict.fromkeys(self.counter_names, 0)))
            for key, partial in self._bank.empty().items():
                names.append(key)
                if isinstance(partial, Moments):
                    prefix = f"{partial.prefix}_" if partial.prefix else ""
                    names.extend(prefix + stat for stat in partial.stats)
                else:
                    names.extend(partial.finalize())
            for key, sketch in self._sketches.items():
                names.append(key)
                names.extend(sketch.empty().metric_names())
            return tuple(dict.fromkeys(names))

    def stats(self) -> dict[str, float]:
        """Entries this set contributes to its target's ``stats()``. Defaults to none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counters and what a subclass keeps across windows (``_saved``)."""
        with self._lock:
            self._fold_staged()
            state: dict[str, Any] = {"counters": dict(self._counters.drain())}
            state.update((attr[1:], _cloned(getattr(self, attr))) for attr in self._saved)
            return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned; the window starts empty."""
        with self._lock:
            self._counters.load(state_dict.get("counters", {}))
            for attr in self._saved:
                if attr[1:] in state_dict:
                    setattr(self, attr, _cloned(state_dict[attr[1:]]))
            self._bank.reset()
            for sketch in self._sketches.values():
                sketch.reset()
            self._clear_window()

    # -- internals -------------------------------------------------------------------

    def _fold_staged(self) -> None:
        """Folds what a subclass keeps staged (batches not summed yet) into its reducers."""

    def _clear_window(self) -> None:
        """Drops what a subclass keeps of the open window outside its reducers (at a load)."""

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            self._fold_staged()
            self._counters.drain()  # CUDA events do not pickle; pending amounts are applied first
            state = self.__dict__.copy()
        del state["_lock"]
        state.update(dict.fromkeys(self._transient))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
