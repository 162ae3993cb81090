"""Observed classes: the subclass a source becomes while it has observers.

A source with no observers is an instance of its own torchrl class, so it
runs exactly torchrl's code. Attaching the first observer switches the
instance's ``__class__`` to a subclass that emits events; removing the last
one switches it back. The subclasses are made once per torchrl class and are
importable from this module under a generated name, so an observed source
pickles and unpickles (``spawn`` workers, Ray) with its observers.

A *context* names another way of observing the same torchrl class, for
places where the in-process mixin cannot work: inside a Ray actor, torchrl's
public methods are called through functions captured when the actor class
was made, so the ``"ray_actor"`` context intercepts private lookups instead.
Each context has its own mixins and classes; the default context (``None``)
is the in-process one.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["base_class", "observed_class"]

_PREFIX = "Observed@"
_BY_BASE: dict[type, type] = {}
# Mixins by kind, registered by the target modules: (predicate on the base, mixin).
_MIXINS: list[tuple[Any, type]] = []
_NOT_COPIED = frozenset({"__dict__", "__weakref__", "__slots__", "__module__", "__qualname__"})
# The same, for the other contexts: {context: [(predicate, mixin)]} and {(base, context): class}.
_CONTEXT_MIXINS: dict[str, list[tuple[Any, type]]] = {}
_BY_CONTEXT: dict[tuple[type, str], type] = {}


def register_mixin(predicate: Any, mixin: type, context: str | None = None) -> None:
    """Registers the event-emitting ``mixin`` for torchrl classes where ``predicate(cls)`` holds.

    Mixins of a ``context`` other than ``None`` make that context's classes
    (see :func:`observed_class`); the first registered predicate that holds wins.
    """
    if context is None:
        _MIXINS.append((predicate, mixin))
    else:
        _CONTEXT_MIXINS.setdefault(context, []).append((predicate, mixin))


def _qualname(base: type) -> str:
    # pickle splits qualified names on ".", so the generated name has none.
    return f"{_PREFIX}{base.__module__}:{base.__qualname__}".replace(".", "/")


def observed_class(base: type, context: str | None = None) -> type:
    """Returns the observed subclass of ``base`` (made once, then cached).

    With a ``context``, returns the subclass built from that context's mixins.
    """
    if context is not None:
        return _context_class(base, context)
    cls = _BY_BASE.get(base)
    if cls is not None:
        return cls
    if base.__dict__.get("_rl_base") is not None:
        return base
    mixin = next((mixin for predicate, mixin in _MIXINS if predicate(base)), None)
    if mixin is None:
        raise TypeError(f"rl_observers cannot observe instances of {base.__qualname__}.")
    # The mixin's methods are copied into a single-inheritance subclass: a second base
    # would change the instance layout and forbid the ``__class__`` switch.
    namespace = {k: v for k, v in vars(mixin).items() if k not in _NOT_COPIED}
    namespace.update(__module__=__name__, __qualname__=_qualname(base), _rl_base=base)
    cls = type(base)(base.__name__, (base,), namespace)
    _BY_BASE[base] = cls
    return cls


def _context_class(base: type, context: str) -> type:
    base = base_class(base)
    cls = _BY_CONTEXT.get((base, context))
    if cls is not None:
        return cls
    mixin = next((m for predicate, m in _CONTEXT_MIXINS.get(context, ()) if predicate(base)), None)
    if mixin is None:
        raise TypeError(f"rl_observers cannot observe instances of {base.__qualname__} in {context!r}.")
    namespace = {k: v for k, v in vars(mixin).items() if k not in _NOT_COPIED}
    qualname = f"{_PREFIX}{context}@{_qualname(base)[len(_PREFIX):]}"
    namespace.update(__module__=__name__, __qualname__=qualname, _rl_base=base)
    cls = type(base)(base.__name__, (base,), namespace)
    _BY_CONTEXT[(base, context)] = cls
    return cls


def base_class(cls: type) -> type:
    """Returns the torchrl class behind an observed class (``cls`` itself otherwise)."""
    return cls.__dict__.get("_rl_base") or cls


def __getattr__(name: str) -> type:
    # Called by pickle / cloudpickle to find an observed class by its generated name.
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    context, at, rest = name[len(_PREFIX) :].partition("@")
    if not at:
        context, rest = None, name[len(_PREFIX) :]
    module_name, _, qualname = rest.replace("/", ".").partition(":")
    base: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        base = getattr(base, part)
    # importing rl_observers registers the mixins and the target methods
    importlib.import_module("rl_observers")
    if context is not None:
        # the only contexts so far are Ray's, registered by this module
        importlib.import_module("rl_observers.sources.ray")
    return observed_class(base, context)
