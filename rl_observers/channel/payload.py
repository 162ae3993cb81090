"""What a payload is, and the one rule that merges two payloads.

A :class:`Payload` maps metric names to numbers ("gauges") or to mergeable
partials (``merge(other) -> partial``, exact and associative, and
``finalize() -> dict[str, float]``). Metrics are checked when submitted
(:func:`check_metrics`), merged by :func:`coalesce` and turned into logger
names and values by :func:`expand`.

Examples:
    >>> from rl_observers.channel.payload import coalesce, expand
    >>> from rl_observers.stats import Count
    >>> pending = {"dones": Count("dones", 2), "lr": 0.1}
    >>> coalesce(pending, {"dones": Count("dones", 1), "lr": 0.2}) is None
    True
    >>> expand("train", pending)
    {'train/dones': 3.0, 'train/lr': 0.2}
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, ClassVar, TypeVar

__all__ = ["Payload", "check_metrics", "coalesce", "expand", "is_partial"]

_MISSING = object()
P = TypeVar("P", bound="Payload")
GAUGE_TYPES = (float, int)
# Value classes already known to be loggable as they are: numbers and partial classes.
_LOGGABLE_CLASSES: set[type] = {float, int, bool}


def is_partial(value: Any) -> bool:
    """Whether ``value`` is a mergeable partial (it has ``merge`` and ``finalize``)."""
    return hasattr(value, "merge") and hasattr(value, "finalize")


def loggable(value: Any) -> bool:
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


def check_metrics(metrics: Any, namespace: Any, who: str) -> dict[str, Any]:
    """Validates a payload cheaply and returns a private copy of it.

    Raises:
        TypeError: naming ``who`` (``"MetricsChannel"``, ``"MetricsHandle"``)
            if ``metrics`` is not a mapping from ``str`` to loggable values or
            ``namespace`` is not a ``str``.
    """
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
        if value.__class__ not in _LOGGABLE_CLASSES and not loggable(value):
            if isinstance(value, Mapping):
                hint = f" Flatten nested metrics into names such as '{key}/<name>'."
            elif callable(getattr(value, "numel", None)) or hasattr(value, "shape"):
                hint = " Reduce it to one number first (or submit a mergeable partial)."
            else:
                hint = ""
            raise TypeError(
                f"{who}.submit_metrics expected metric values that are real numbers, one-element "
                f"tensors or mergeable partials, got {value!r} ({type(value).__name__}) for {key!r}.{hint}"
            )
    if namespace.__class__ is not str and not isinstance(namespace, str):
        raise TypeError(f"{who}.submit_metrics expected a str namespace, got {namespace!r}.")
    return copy


def coalesce(into: dict[str, Any], metrics: Mapping[str, Any]) -> Exception | None:
    """Merges ``metrics`` into ``into`` in place: the one merge rule of payloads.

    Partials present on both sides are merged exactly; any other value (a
    gauge, or a partial meeting a gauge) keeps the newest. Returns the last
    error raised by a ``merge`` (that value then keeps the newest), or ``None``.
    """
    error = None
    for key, value in metrics.items():
        previous = into.get(key, _MISSING)
        if previous is not _MISSING and previous.__class__ not in GAUGE_TYPES:
            merge = getattr(previous, "merge", None)
            if merge is not None and getattr(value, "merge", None) is not None:
                try:
                    value = merge(value)
                except Exception as err:  # the partial's own bug: keep the newest
                    error = err
        into[key] = value
    return error


def expand(namespace: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Turns a payload into logger names and values: partials are finalized."""
    prefix = f"{namespace}/" if namespace else ""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if value.__class__ not in GAUGE_TYPES:
            finalize = getattr(value, "finalize", None)
            if finalize is not None:
                for name, final in finalize().items():
                    out[prefix + name] = final
                continue
        out[prefix + key] = value
    return out


def payload_class(cls: type[P]) -> type[P]:
    """Makes ``cls`` a slotted dataclass, equal only to itself, that pickles as its fields in order."""
    cls = dataclass(slots=True, eq=False)(cls)
    cls._values = attrgetter(*(field.name for field in fields(cls)))
    return cls


@payload_class
class Payload:
    """One submission: ``metrics`` for ``namespace`` at ``step`` (a subclass goes to its registered router).

    Examples:
        >>> from rl_observers.channel.payload import Payload
        >>> from rl_observers.stats import Count
        >>> older = Payload("train", {"dones": Count("dones", 2), "lr": 0.1}, step=1)
        >>> older.absorb(Payload("train", {"dones": Count("dones", 1), "lr": 0.2}, step=2))
        >>> older.step, expand(older.namespace, older.metrics)
        (2, {'train/dones': 3.0, 'train/lr': 0.2})
    """

    namespace: str
    metrics: dict[str, Any]
    step: int | None = None
    _values: ClassVar[Callable[[Payload], tuple[Any, ...]]]
    #: Submissions it holds that the owner counts by their numbers if lost (a numbered window's).
    counted_by_number: ClassVar[int] = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # a payload that leaves its process is pickled at every hop: its fields as the
        # constructor's arguments take half the time and bytes of the default for slots
        return self.__class__, self._values(self)

    def absorb(self, newer: Payload) -> Exception | None:
        """Merges ``newer`` (submitted later, same namespace) into this one (:func:`coalesce`).

        The step becomes the newest. Returns the error of a partial that failed to merge.
        """
        error = coalesce(self.metrics, newer.metrics)
        self.step = newer.step
        return error

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.namespace!r}, {self.metrics!r}, step={self.step!r})"
