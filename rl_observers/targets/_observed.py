"""Observed classes: the subclass a source becomes while it has observers.

A source with no observers is an instance of its own torchrl class, so it
runs exactly torchrl's code. Attaching the first observer switches the
instance's ``__class__`` to a subclass that emits events; removing the last
one switches it back. The subclasses are made once per torchrl class and are
importable from this module under a generated name, so an observed source
pickles and unpickles (``spawn`` workers, Ray) with its observers.
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


def register_mixin(predicate: Any, mixin: type) -> None:
    """Registers the event-emitting ``mixin`` for torchrl classes where ``predicate(cls)`` holds."""
    _MIXINS.append((predicate, mixin))


def _qualname(base: type) -> str:
    # pickle splits qualified names on ".", so the generated name has none.
    return f"{_PREFIX}{base.__module__}:{base.__qualname__}".replace(".", "/")


def observed_class(base: type) -> type:
    """Returns the observed subclass of ``base`` (made once, then cached)."""
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


def base_class(cls: type) -> type:
    """Returns the torchrl class behind an observed class (``cls`` itself otherwise)."""
    return cls.__dict__.get("_rl_base") or cls


def __getattr__(name: str) -> type:
    # Called by pickle / cloudpickle to find an observed class by its generated name.
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    module_name, _, qualname = name[len(_PREFIX) :].replace("/", ".").partition(":")
    base: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        base = getattr(base, part)
    # importing rl_observers registers the mixins and the target methods
    importlib.import_module("rl_observers")
    return observed_class(base)
