"""Observers, the ordered observer list of a source, handles and the error policy.

Step **observer** of the flow (source → observer → channel → logger). An
observer is any object with ``on_<event>`` methods (a plain callable is a
``post_collect`` receiver ``fn(batch)``); everything about it is resolved
when it is attached, so emitting an event is a walk over a tuple.
"""

from __future__ import annotations

import difflib
import inspect
import io
import os
import pickle
import threading
import weakref
from collections import ChainMap
from collections.abc import Callable, Iterable
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

import cloudpickle
from torchrl._utils import logger as torchrl_logger

from rl_observers import signals

__all__ = [
    "ON_ERROR_POLICIES",
    "FailureStreaks",
    "Observer",
    "ObserverHandle",
    "OnError",
    "check_on_error",
    "dumps",
    "refused_raise",
]

OnError = Literal["warn", "raise", "ignore"]
#: The accepted values of ``on_error``.
ON_ERROR_POLICIES: tuple[str, ...] = ("warn", "raise", "ignore")


def check_on_error(on_error: Any) -> str:
    """``on_error`` if it is one of :data:`ON_ERROR_POLICIES`, else a ``ValueError``."""
    if on_error not in ON_ERROR_POLICIES:
        raise ValueError(f"on_error must be one of 'warn', 'raise' or 'ignore', got {on_error!r}.")
    return on_error

_SIGNALS = {event: signals.signal_for(event) for event in signals.EVENT_PAYLOADS}
_EVENT_METHODS = {f"on_{event}" for event in signals.EVENT_PAYLOADS}
#: The optional names an observer may define besides its ``on_<event>`` methods.
OPTIONAL_HOOKS: tuple[str, ...] = (
    "attached",
    "copies_removed",
    "detached",
    "observed_events",
    "on_error",
    "prepare_copies",
    "stats",
)


class Observer:
    """Optional base class for observers: documents the protocol, gives no-op lifecycle callbacks.

    Any object with ``on_<event>`` methods is an observer: ``on_pre_collect(source)``,
    ``on_post_collect(source, batch)``, ``on_shutdown(source)``, ``on_post_add(source,
    data, index)``, ``on_post_extend(source, data, index)``, ``on_post_sample(source,
    batch, info)``, ``on_empty(source)`` (the table is in :ref:`events`). Only the
    methods a class defines are called (an ``observed_events`` tuple narrows them);
    defining none of a target's events fails at attach time. Observers must be
    picklable to reach workers and Ray actors (:ref:`observed-objects`).

    Examples:
        >>> import torch
        >>> import rl_observers
        >>> from rl_observers import Observer
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> class CountWrites(Observer):
        ...     def __init__(self):
        ...         self.items = 0
        ...     def on_post_extend(self, source, data, index):
        ...         self.items += len(index)
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100))
        >>> counter = CountWrites()
        >>> with rb.add_observer(counter):
        ...     _ = rb.extend(torch.arange(10))
        >>> counter.items
        10
    """

    def attached(self, source: Any) -> None:
        """Called once when the observer is attached to ``source``, in the process where it runs."""

    def detached(self, source: Any) -> None:
        """Called once when the observer is removed from ``source``."""

    def prepare_copies(self, target: Any) -> None:
        """Called on the original, in the driver, before copies are shipped where ``target`` runs."""

    def copies_removed(self, target: Any) -> None:
        """Called once on the original when its copies are gone (all detached, or ``target`` shut down)."""


def _check_optional_hooks(observer: Any) -> None:
    """Refuses a public name that looks like a misspelled optional hook (``attach`` for ``attached``)."""
    public = {attr for attr in dir(observer) if not attr.startswith("_")}
    for attr in sorted(public - set(OPTIONAL_HOOKS) - _EVENT_METHODS):
        close = difflib.get_close_matches(attr, OPTIONAL_HOOKS, n=1, cutoff=0.84)
        if close:
            raise ValueError(
                f"{type(observer).__name__}.{attr} looks like a misspelled {close[0]!r}, which "
                f"rl_observers would then never call; the optional hooks are "
                f"{', '.join(OPTIONAL_HOOKS)}. Did you mean {close[0]!r}? (Rename it if it is "
                "meant to be something else.)"
            )


def _event_methods(observer: Any) -> dict[str, Callable[..., Any]]:
    """Returns every bound event method of ``observer``, checking names and signatures."""
    known = signals.EVENT_PAYLOADS
    methods: dict[str, Callable[..., Any]] = {}
    for attr in dir(type(observer)):
        if not attr.startswith("on_") or attr == "on_error":
            continue
        method = getattr(observer, attr, None)
        if not callable(method):
            continue
        event = attr[3:]
        if event not in known:
            names = sorted(_EVENT_METHODS)
            close = difflib.get_close_matches(attr, [*names, "on_error"], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{type(observer).__name__}.{attr} is not an event method: events are "
                f"{', '.join(names)}.{hint}"
            )
        _check_signature(observer, attr, method, 1 + len(known[event]))
        methods[event] = method
    return methods


def _check_signature(owner: Any, attr: str, fn: Callable[..., Any], nargs: int) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return
    try:
        signature.bind(*range(nargs))
    except TypeError:
        names = ", ".join(["source", *signals.EVENT_PAYLOADS.get(attr[3:], ("batch",))][:nargs])
        raise TypeError(
            f"{type(owner).__name__}.{attr} must accept ({names}), "
            f"got a method with signature {signature}."
        ) from None


class FailureStreaks:
    """Which parts of an observer are in a failure streak: the one tracker of ``on_error``'s rule.

    Examples:
        >>> from rl_observers.observer import FailureStreaks
        >>> streaks = FailureStreaks()
        >>> streaks.fail("post_collect", ValueError("no key"), "ignore", str)
        >>> streaks.failing
        {'post_collect'}
        >>> streaks.recover(["post_collect"])  # it failed since the last call: still failing
        >>> streaks.recover(["post_collect"])
        >>> streaks.failing
        set()
    """

    __slots__ = ("failed_now", "failing")

    def __init__(self) -> None:
        self.failing: set[Any] = set()
        self.failed_now: set[Any] = set()

    def fail(self, key: Any, error: Exception, policy: str, warning: Callable[[], str]) -> None:
        """``key`` raised ``error``: raises, warns (once per streak of ``key``) or records it."""
        if policy == "raise":
            raise error
        if policy == "warn" and key not in self.failing:
            torchrl_logger.warning(warning())
        self.failing.add(key)
        self.failed_now.add(key)

    def recover(self, keys: Iterable[Any]) -> None:
        """Ends the streaks of ``keys`` that did not fail since the previous call."""
        failed_now = self.failed_now
        for key in keys:
            if key not in failed_now:
                self.failing.discard(key)
        failed_now.clear()


class _Entry(FailureStreaks):
    """One attached observer: its resolved event calls and its error state (one streak for all its events)."""

    __slots__ = ("calls", "observer", "on_error", "stats")

    def __init__(self, observer: Any, calls: dict[str, Callable[..., Any]], on_error: str):
        super().__init__()
        self.observer = observer
        self.calls = calls
        self.on_error = on_error
        stats = getattr(observer, "stats", None)
        self.stats: Callable[[], Any] | None = stats if callable(stats) else None

    #: What the warning calls the failing thing and its call.
    label, call = "observer", "on_{}"

    def failed(self, error: Exception, event: str) -> None:
        def warning() -> str:
            call = self.call.format(event)
            return (
                f"rl_observers: {self.label} {self.observer!r} raised in {call} "
                f"({type(error).__name__}: {error}); the source goes on, and this is "
                f"reported once until {call} succeeds again."
            )

        # one streak for all its events: warned about when the first of them fails
        policy = "ignore" if self.failing and self.on_error == "warn" else self.on_error
        self.fail(event, error, policy, warning)


class _ReceiverEntry(_Entry):
    """The error state of a blinker receiver of a source's signals."""

    __slots__ = ()
    label, call = "signal receiver", "the {} signal"


def _receiver_key(receiver: Any) -> Any:
    # blinker hands out a new bound method each time; key it by its object and function
    owner = getattr(receiver, "__self__", None)
    if owner is not None and hasattr(receiver, "__func__"):
        return id(owner), receiver.__func__
    return id(receiver)


def resolve_observer(
    observer: Any, emits: tuple[str, ...], target_name: str, on_error: str | None
) -> _Entry:
    """Validates ``observer`` for a target emitting ``emits`` and resolves its calls, at attach time."""
    if on_error is None:
        own = getattr(observer, "on_error", None)
        on_error = own if isinstance(own, str) else "warn"
    check_on_error(on_error)
    every = _event_methods(observer)
    if every:  # a plain callable has no hooks to misspell
        _check_optional_hooks(observer)
    wanted = getattr(observer, "observed_events", None)
    if wanted is not None:  # an observer may narrow the events it defines methods for
        unknown = set(wanted) - set(every)
        if unknown:
            raise ValueError(
                f"{type(observer).__name__}.observed_events names {sorted(unknown)}, for which it has no "
                f"on_<event> method; it defines {sorted(every)}."
            )
        every = {event: fn for event, fn in every.items() if event in wanted}
    methods = {event: fn for event, fn in every.items() if event in emits}
    if not every:
        if not callable(observer):
            raise TypeError(
                "an observer must define on_<event> methods or be a callable receiving "
                f"the post_collect batch, got {observer!r} of type {type(observer).__name__}."
            )
        if isinstance(observer, type):
            raise TypeError(
                f"add_observer expects an observer instance, got the class {observer.__name__}; "
                f"did you mean {observer.__name__}()?"
            )
        _check_signature(observer, "on_post_collect", observer, 1)
        if "post_collect" not in emits:
            raise TypeError(
                f"a plain callable is a post_collect receiver, which a {target_name} does not "
                f"emit ({', '.join(emits)}), got {observer!r}. To log a number from sampled or "
                "written data, use a one-liner in a LoggerObserver, e.g. "
                "metrics=[Mean('name', fn, on='post_sample')] or Gauge('name', fn, merge='latest', "
                "on='post_extend'); for other work, define on_<event> methods."
            )
        methods = {"post_collect": lambda source, batch: observer(batch)}  # fn(batch) as an event
    elif not methods:
        raise TypeError(
            f"{type(observer).__name__} observes {', '.join(sorted(every))}, none of which a "
            f"{target_name} emits ({', '.join(emits)})."
        )
    return _Entry(observer, methods, on_error)


#: One event's observer calls, in order: ``(call(source, *payload), entry)`` pairs.
Calls = tuple[tuple[Callable[..., Any], _Entry], ...]
#: Rewrites an event's :data:`Calls` at registration time (see :meth:`ObserverList.set_call_transform`).
CallTransform = Callable[[str, Calls], Iterable[tuple[Callable[..., Any], _Entry]]]


class ObserverList:
    """The ordered observers of one source (``source._rl_observers``) and the emitters it calls.

    Emitting walks a tuple rebuilt at each registration. Pickled for a new process,
    each observer is pickled apart: one that fails to unpickle there is left behind
    (:class:`ObserverLeftBehind`).
    """

    def __init__(self, source: Any, emits: tuple[str, ...], target_name: str) -> None:
        self.source, self.emits, self.target_name = source, emits, target_name
        self.entries: tuple[_Entry, ...] = ()
        self._calls: dict[str, Calls] = dict.fromkeys(emits, ())
        self._lock = threading.RLock()
        self._shut_down = False
        self._call_transform: CallTransform | None = None
        self._receivers: dict[Any, _Entry] = {}  # the error state of the receivers that raised

    def add(self, observer: Any, on_error: str | None = None) -> _Entry:
        entry = resolve_observer(observer, self.emits, self.target_name, on_error)
        with self._lock:
            if any(e.observer is observer for e in self.entries):
                raise ValueError(
                    f"{observer!r} is already attached to this {self.target_name}; "
                    "an observer is attached at most once per source."
                )
            self.entries = (*self.entries, entry)
            self._rebuild()
        return entry

    def remove(self, observer: Any) -> _Entry | None:
        with self._lock:
            removed = next((e for e in self.entries if e.observer is observer), None)
            if removed is not None:
                self.entries = tuple(e for e in self.entries if e is not removed)
                self._rebuild()
        return removed

    def set_call_transform(self, transform: CallTransform | None) -> CallTransform | None:
        """Installs ``transform(event, calls) -> calls``, applied at registration (``None`` removes it); returns the previous one."""
        with self._lock:
            previous, self._call_transform = self._call_transform, transform
            self._rebuild()
        return previous

    @property
    def call_transform(self) -> CallTransform | None:
        """The installed call transform, or ``None``."""
        return self._call_transform

    def _rebuild(self) -> None:
        calls = {
            event: tuple((e.calls[event], e) for e in self.entries if event in e.calls)
            for event in self.emits
        }
        transform = self._call_transform
        if transform is not None:
            calls = {event: tuple(transform(event, c)) for event, c in calls.items()}
        self._calls = calls

    @property
    def observers(self) -> tuple[Any, ...]:
        return tuple(e.observer for e in self.entries)

    def copy_for(self, source: Any) -> ObserverList:
        """A new list for ``source`` (a shallow copy of this list's source) with the same observers, streaks afresh."""
        new = type(self)(source, self.emits, self.target_name)
        with self._lock:
            new.entries = tuple(_Entry(e.observer, e.calls, e.on_error) for e in self.entries)
            new._shut_down = self._shut_down
        new._rebuild()
        return new

    def emit(self, event: str, *payload: Any) -> None:
        """Calls the observers of ``event`` in order, then the signal's receivers."""
        source = self.source
        for fn, entry in self._calls[event]:
            try:
                fn(source, *payload)
            except Exception as error:
                entry.failed(error, event)
            else:
                if entry.failing:
                    entry.failing.discard(event)
        signal = _SIGNALS[event]
        if signal.receivers:
            self._send(signal, event, dict(zip(signals.EVENT_PAYLOADS[event], payload)))

    def _send(self, signal: Any, event: str, kwargs: dict[str, Any]) -> None:
        """Calls the signal's receivers for this source, each under its own ``on_error`` (default ``"warn"``)."""
        source = self.source
        for receiver in signal.receivers_for(source):
            try:
                receiver(source, **kwargs)
            except Exception as error:
                own = getattr(receiver, "on_error", None)
                new = _ReceiverEntry(receiver, {}, own if own in ON_ERROR_POLICIES else "warn")
                self._receivers.setdefault(_receiver_key(receiver), new).failed(error, event)
            else:
                entry = self._receivers.get(_receiver_key(receiver)) if self._receivers else None
                if entry is not None:
                    entry.failing.discard(event)

    def contribute_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Adds the entries observers contribute to the source's ``stats()``."""
        for entry in self.entries:
            if entry.stats is not None:
                try:
                    stats.update(entry.stats())
                except Exception as error:
                    entry.failed(error, "stats")
                else:
                    entry.failing.discard("stats")
        return stats

    def shutdown(self) -> None:
        """Emits ``shutdown`` once to every observer, even after one raised; the first error is raised after all ran."""
        if self._shut_down:
            return
        self._shut_down = True
        source, first_error = self.source, None
        for fn, entry in self._calls.get("shutdown", ()):
            try:
                fn(source)
            except Exception as error:
                try:
                    entry.failed(error, "shutdown")
                except Exception as raised:
                    first_error = first_error or raised
            else:
                entry.failing.discard("shutdown")
        signal = _SIGNALS["shutdown"]
        if signal.receivers:
            try:
                self._send(signal, "shutdown", {})
            except Exception as raised:
                first_error = first_error or raised
        if first_error is not None:
            raise first_error

    def __getstate__(self) -> dict[str, Any]:
        attached = [(e.observer, e.on_error) for e in self.entries]
        state = {
            "source": self.source,
            "emits": self.emits,
            "target_name": self.target_name,
            "attached": attached,
            "shut_down": self._shut_down,
        }
        if attached and get_spawning_popen() is not None:
            apart = _pickle_apart(self, attached)
            if apart is not None:
                state["attached"], state["attached_apart"] = [], apart
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], state["emits"], state["target_name"])  # type: ignore[misc]
        self._shut_down = state["shut_down"]
        entries = [
            resolve_observer(observer, self.emits, self.target_name, on_error)
            for observer, on_error in state["attached"]
        ]
        for payload, on_error, description in state.get("attached_apart", ()):
            try:
                observer = pickle.loads(payload)
            except Exception as error:
                torchrl_logger.warning(
                    f"rl_observers: observer {description} of a {self.target_name} could not be "
                    f"unpickled in process {os.getpid()} ({type(error).__name__}: {error}); it is left "
                    f"behind: the {self.target_name} and its other observers go on without it here."
                )
                entries.append(_Entry(ObserverLeftBehind(description, error), {}, on_error))
            else:
                entries.append(resolve_observer(observer, self.emits, self.target_name, on_error))
        self.entries = tuple(entries)
        self._rebuild()


# The observer lists being pickled apart, per thread: an observer that pickles its own source
# reaches its list again, which is then pickled inline instead.
_APART = threading.local()


def _pickle_apart(observers: ObserverList, attached: list[tuple[Any, str]]) -> list[tuple[bytes, str, str]] | None:
    """Each ``(observer, on_error)`` pickled on its own, or ``None`` to pickle them inline.

    Inline when one cannot be pickled alone, or reaches its own list again.
    """
    busy: set[int] = _APART.__dict__.setdefault("busy", set())
    if id(observers) in busy:
        raise ValueError("an observer reaches its own list: pickled inline")
    busy.add(id(observers))
    try:
        return [(dumps(o, spawn=True), on_error, _describe(o)) for o, on_error in attached]
    except Exception:
        return None
    finally:
        busy.discard(id(observers))


def dumps(obj: Any, *, by_value: bool = False, spawn: bool = False) -> bytes:
    """``obj`` pickled to travel to another process: the one pickling helper of the package.

    By reference first (``spawn=True``: as a ``spawn`` worker receives its
    arguments), then by value with cloudpickle; ``by_value=True``: cloudpickle at once.

    Examples:
        >>> import pickle
        >>> from rl_observers.observer import dumps
        >>> pickle.loads(dumps(lambda x: x + 1))(1)
        2
    """
    if not by_value:
        try:
            return bytes(ForkingPickler.dumps(obj)) if spawn else pickle.dumps(obj)
        except Exception:
            pass
    buffer = io.BytesIO()
    pickler = cloudpickle.Pickler(buffer)
    if spawn:
        pickler.dispatch_table = ChainMap(ForkingPickler._extra_reducers, pickler.dispatch_table)
    pickler.dump(obj)
    return buffer.getvalue()


def _describe(observer: Any) -> str:
    """``repr(observer)`` and its class, to name an observer where it could not be unpickled."""
    cls = type(observer)
    try:
        text = repr(observer)
    except Exception:
        text = f"<{cls.__qualname__}>"
    return f"{text} ({cls.__module__}.{cls.__qualname__})"


class ObserverLeftBehind:
    """Stands for an observer that could not be unpickled here: keeps its place, receives no event."""

    __slots__ = ("description", "error")

    def __init__(self, description: str, error: BaseException) -> None:
        self.description = description
        self.error = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"<observer {self.description}, left behind: {self.error}>"


class ObserverHandle:
    """What ``add_observer`` returns: removes the observer, also as a context manager.

    Holds its target weakly; removing twice is harmless.

    Examples:
        >>> import torch
        >>> import rl_observers
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10))
        >>> seen = []
        >>> class Seen:
        ...     def on_post_sample(self, source, batch, info):
        ...         seen.append(len(batch))
        >>> _ = rb.extend(torch.arange(10))
        >>> with rb.add_observer(Seen()) as handle:
        ...     _ = rb.sample(4)
        >>> _ = rb.sample(4)  # removed at the end of the block
        >>> seen, rb.observers
        ([4], ())
    """

    __slots__ = ("__weakref__", "_target", "observer")

    def __init__(self, target: Any, observer: Any) -> None:
        self._target = weakref.ref(target)
        self.observer = observer

    @property
    def target(self) -> Any | None:
        """The observed source, or ``None`` once it has been garbage-collected."""
        return self._target()

    def remove(self) -> None:
        """Detaches the observer from its target (no-op if already detached)."""
        target = self._target()
        if target is not None and any(o is self.observer for o in target.observers):
            target.remove_observer(self.observer)

    def __enter__(self) -> ObserverHandle:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(observer={self.observer!r}, target={self.target!r})"


def refused_raise(observer: Any, target_name: str, where: str) -> str:
    """Why ``on_error="raise"`` is refused for an observer whose copies run ``where``."""
    return (
        f"on_error='raise' cannot be honoured for an observer of a {target_name}: its copies "
        f"run {where}, where an error cannot reach the caller (it would kill the worker, and the "
        "driver would only learn that a worker failed). Use on_error='warn' (the default) or "
        f"'ignore' for {observer!r}."
    )
