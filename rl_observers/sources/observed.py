"""Observed classes: the subclass a source becomes while it has observers.

A source without observers runs exactly torchrl's code; the first observer
switches its ``__class__`` to a subclass that emits events and keeps the
:class:`~rl_observers.observer.ObserverList` as ``_rl_observers``; the last
one's removal switches it back. The mixin comes from one table
(:mod:`rl_observers.targets`), matched by the nearest class of the MRO, per
*context* (``None`` in process; ``"ray_actor"`` and others where the
in-process mixin cannot work). Under ``type``, ``copy`` and ``pickle``:
:ref:`observed-objects`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from blinker import ANY

from rl_observers import signals
from rl_observers.observer import ObserverList

__all__ = [
    "ATTACH_LOCK",
    "How",
    "attach",
    "detach",
    "how_observed",
    "is_observable",
    "observe",
    "observed_class",
    "observers_of",
    "refusal",
    "release",
    "switch_back",
    "switch_class",
    "torchrl_class",
    "use_table",
]

_PREFIX = "Observed@"
_CLASSES: dict[tuple[type, str | None], type] = {}
_NOT_COPIED = {"__dict__", "__weakref__", "__slots__", "__module__", "__qualname__", "__doc__"}
#: Held while a source switches between observed and plain.
ATTACH_LOCK = threading.RLock()


class How(NamedTuple):
    """How one torchrl class is observed: a row of :data:`rl_observers.targets.TABLE`.

    Attributes:
        mixin: the class whose methods the observed class gets.
        observer_list: the :class:`~rl_observers.observer.ObserverList`
            subclass of an in-process source.
        kind: the :class:`~rl_observers.remote.shipping.RemoteKind` when the
            observers run as copies elsewhere, else ``None``.
        loop: the methods that emit the events; a subclass replacing one is
            refused.
        variant: ``variant(source)``, the context whose row observes this
            instance instead (a prefetching buffer), or ``None``.
    """

    mixin: type
    observer_list: type[ObserverList]
    kind: Any = None
    loop: tuple[str, ...] = ()
    variant: Callable[[Any], str | None] | None = None


# The table, by context: {context: {"module:qualname" of a torchrl class: How}}; see use_table.
_TABLE: dict[str | None, dict[str, How]] = {}
# Each class's answer, per context: its How, or why it is refused.
_ANSWERS: dict[tuple[type, str | None], How | str] = {}
_TABLE_LOCK = threading.Lock()


def use_table(table: dict[str | None, dict[str, How]]) -> None:
    """Makes ``table`` the one answer to "how is this torchrl class observed?"; called once by :mod:`rl_observers.sources`."""
    with _TABLE_LOCK:
        contexts: dict[str | None, dict[str, How]] = {c: dict(rows) for c, rows in table.items()}
        for name, how in table.get(None, {}).items():
            if how.kind is not None:
                contexts.setdefault(how.kind.context, {})[name] = how
        _TABLE.clear()
        _TABLE.update(contexts)
        _ANSWERS.clear()


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _answer(cls: type, context: str | None) -> How | str:
    """The row for ``cls`` in ``context`` (the nearest class of its MRO the table names), or why not."""
    answer = _ANSWERS.get((cls, context))
    if answer is not None:
        return answer
    rows = _TABLE.get(context, {})
    mro = cls.__mro__
    answer = f"{cls.__qualname__} is not a torchrl collector or replay buffer."
    for position, klass in enumerate(mro):
        how = rows.get(_name(klass))
        if how is not None:
            replaced = sorted({n for k in mro[:position] for n in how.loop if n in vars(k)})
            answer = how
            if replaced:
                answer = (
                    f"{cls.__qualname__} replaces {', '.join(replaced)} of torchrl's "
                    f"{klass.__qualname__}, through which the events observers receive are "
                    "emitted: attached, they would hear nothing."
                )
            break
        if klass.__module__.split(".")[0] == "torchrl":
            answer = (
                f"{cls.__qualname__} is a torchrl class this version of rl_observers does not know "
                "how to observe"
                if klass is cls
                else f"{cls.__qualname__} derives from torchrl's {klass.__qualname__}, which "
                "rl_observers does not know how to observe (only the classes its table names)"
            ) + ": attached, its observers could hear nothing."
            break
    _ANSWERS[(cls, context)] = answer
    return answer


def how_observed(cls: type, context: str | None = None) -> How | None:
    """The table's row for the torchrl class behind ``cls`` in ``context``, or ``None`` if it is refused."""
    answer = _answer(torchrl_class(cls), context)
    return answer if isinstance(answer, How) else None


def refusal(cls: type, context: str | None = None) -> str:
    """Why ``cls`` cannot be observed in ``context``, and what to use instead."""
    answer = _answer(torchrl_class(cls), context)
    if isinstance(answer, How):
        return ""
    where = "" if context is None else f" (in {context!r})"
    return (
        f"rl_observers cannot observe a {cls.__qualname__}{where}: {answer} Attach observers to a "
        "torchrl class that rl_observers.targets names (Collector, AsyncBatchedCollector, "
        "MultiSyncCollector, MultiAsyncCollector, AsyncCollector, RayCollector, "
        "DistributedCollector, DistributedSyncCollector, RPCCollector, ReplayBuffer and its torchrl "
        "subclasses, RayReplayBuffer), or to a subclass of one that keeps those methods; a loop "
        "of your own can call its observers itself (observer.on_post_collect(collector, batch))."
    )


def torchrl_class(cls: type) -> type:
    """Returns the torchrl class behind an observed class (``cls`` itself otherwise)."""
    return cls.__dict__.get("_rl_base", cls)


def observers_of(source: Any) -> ObserverList | None:
    """The observer list of an in-process ``source``, or ``None`` when it is not observed.

    Read from the instance's ``__dict__``: a method bound while observed may
    run after the last observer left.
    """
    return getattr(source, "__dict__", {}).get("_rl_observers")


# -- the observed classes --------------------------------------------------------------------------


class _Observed:
    """What every observed class has, besides its kind's mixin (see the module docstring)."""

    _rl_observers: ObserverList

    def __copy__(self) -> Any:
        new = copy._reconstruct(self, None, *self.__reduce_ex__(4))  # what copy.copy does
        observers = observers_of(new)
        if observers is not None:  # its own list, with the same observers, naming the copy
            new._rl_observers = observers.copy_for(new)
        return new


class ObservedSource:
    """The base of the kinds' mixins: ``shutdown`` tells the observers, ``stats`` adds theirs."""

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        # The source shuts down even if an observer raises (on_error="raise"): the error is
        # raised once torchrl's shutdown has run.
        observers = observers_of(self)
        try:
            if observers is not None:
                observers.shutdown()
        finally:
            result = torchrl_class(type(self)).shutdown(self, *args, **kwargs)
        return result

    def stats(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        stats = torchrl_class(type(self)).stats(self, *args, **kwargs)
        observers = observers_of(self)
        return stats if observers is None else observers.contribute_stats(stats)


@functools.cache
def _observed_metaclass(meta: type) -> type:
    """The metaclass of observed classes whose torchrl class has metaclass ``meta``: calling one builds a plain torchrl object."""

    def __call__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return torchrl_class(cls)(*args, **kwargs)

    def __repr__(cls: type) -> str:
        return repr(torchrl_class(cls))

    return type(meta)(
        f"Observed{meta.__name__}", (meta,), {"__call__": __call__, "__repr__": __repr__}
    )


def observed_class(base: type, context: str | None = None) -> type:
    """Returns the observed subclass of torchrl's class ``base`` in ``context`` (made once)."""
    base = torchrl_class(base)
    cls = _CLASSES.get((base, context))
    if cls is not None:
        return cls
    found = _find(base, context)
    if found is None:
        raise TypeError(refusal(base, context))
    mixin = found[0]
    # The mixins' methods are copied into a single-inheritance subclass: a second base
    # would change the instance layout and forbid the ``__class__`` switch. A mixin's own
    # bases are copied first (a variant mixin derives from its row's).
    namespace = {k: v for k, v in vars(_Observed).items() if k not in _NOT_COPIED}
    for klass in reversed(mixin.__mro__[:-1]):
        namespace.update({k: v for k, v in vars(klass).items() if k not in _NOT_COPIED})
    # A generated, importable name: pickle finds the class through this module's __getattr__.
    at = "" if context is None else f"{context}@"
    qualname = f"{_PREFIX}{at}{base.__module__}:{base.__qualname__}".replace(".", "/")
    namespace.update(__module__=__name__, __qualname__=qualname, __doc__=base.__doc__)
    namespace["_rl_base"] = base
    cls = _observed_metaclass(type(base))(base.__name__, (base,), namespace)
    _CLASSES[(base, context)] = cls
    return cls


def _find(base: type, context: str | None) -> tuple[type, type[ObserverList]] | None:
    how = how_observed(base, context)
    if how is None or (context is None and how.kind is not None):
        return None  # a remote kind's driver-side object is switched in its kind's context
    return how.mixin, how.observer_list


def __getattr__(name: str) -> type:
    # Called by pickle / cloudpickle to find an observed class by its generated name; importing
    # this module imported rl_observers.sources, which handed it the table.
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    context, at, rest = name[len(_PREFIX) :].partition("@")
    if not at:
        context, rest = None, name[len(_PREFIX) :]
    module_name, _, qualname = rest.replace("/", ".").partition(":")
    base: Any = importlib.import_module(module_name)  # torchrl's module
    for part in qualname.split("."):
        base = getattr(base, part)
    return observed_class(base, context)


# -- attaching in this process ---------------------------------------------------------------------


def observe(source: Any, context: str | None = None) -> ObserverList:
    """Makes ``source`` observed (if it is not yet) and returns its observer list."""
    observers = observers_of(source)
    if observers is None:
        with ATTACH_LOCK:
            observers = observers_of(source)
            if observers is None:
                base = torchrl_class(type(source))
                how = how_observed(base, context)  # a variant's row observes some instances
                variant = None if how is None or how.variant is None else how.variant(source)
                context = context if variant is None else variant
                found = _find(base, context)
                if found is None:
                    raise TypeError(refusal(base, context))
                observers = found[1](source)
                cls = observed_class(base, context)
                source._rl_observers = observers
                source.__class__ = cls
    return observers


def release(source: Any) -> None:
    """Makes ``source`` a plain torchrl object again once nothing observes it."""
    with ATTACH_LOCK:
        observers = observers_of(source)
        # receivers connected for this source (blinker indexes them by sender id)
        heard = any(signal._by_sender.get(id(source)) for signal in _SIGNALS)
        if observers is None or observers.entries or heard:
            return
        source.__class__ = torchrl_class(type(source))
        del source._rl_observers


def switch_class(source: Any, context: str) -> None:
    """Makes the driver-side object of a remote kind an instance of its observed class in ``context``."""
    with ATTACH_LOCK:
        source.__class__ = observed_class(type(source), context)


def switch_back(source: Any) -> None:
    """Makes ``source`` an instance of its torchrl class again (see :func:`switch_class`)."""
    with ATTACH_LOCK:
        source.__class__ = torchrl_class(type(source))


def attach(source: Any, observer: Any, on_error: str | None, context: str | None = None) -> None:
    """Attaches ``observer`` to the in-process ``source``, then calls its ``attached(source)``; not left attached if that raises."""
    with ATTACH_LOCK:
        observers = observe(source, context)
        try:
            observers.add(observer, on_error)
        except BaseException:
            release(source)
            raise
    attached = getattr(observer, "attached", None)
    if callable(attached):
        try:
            attached(source)
        except BaseException:
            with ATTACH_LOCK:
                observers.remove(observer)
                release(source)
            raise


def detach(source: Any, observer: Any) -> None:
    """Detaches ``observer`` from the in-process ``source``, then calls its ``detached(source)``."""
    observers = observers_of(source)
    removed = observers.remove(observer) if observers is not None else None
    if removed is None:
        raise ValueError(f"{observer!r} is not attached to this {type(source).__name__}.")
    release(source)
    detached = getattr(observer, "detached", None)
    if callable(detached):
        detached(source)


_SIGNALS = tuple(signals.signal_for(event) for event in signals.EVENT_PAYLOADS)


def is_observable(obj: Any) -> bool:
    """Whether ``obj`` is of a torchrl class this process can observe in place."""
    return obj is not ANY and _find(torchrl_class(type(obj)), None) is not None
