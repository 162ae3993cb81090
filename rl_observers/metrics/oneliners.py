"""Metric one-liners: a name, a function of an event's payload and a merge rule (see :doc:`custom`).

The function returns a tensor (folded on its device, no sync), a real
number, or ``None``; one that calls ``.item()`` synchronises the device at every event.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rl_observers.metrics.base import DATA_EVENTS, MetricSet
from rl_observers.signals import COLLECTOR_EVENTS, EVENT_PAYLOADS, REPLAY_BUFFER_EVENTS
from rl_observers.sources.placement import source_kind
from rl_observers.stats import (
    MOMENT_STATS,
    Fraction,
    Moments,
    Partial,
    PerSecond,
    Scalar,
)
from rl_observers.stats.partials import Count

__all__ = [
    "CountTrue",
    "Gauge",
    "Max",
    "Mean",
    "Metric",
    "Min",
    "Rate",
    "Ratio",
    "Sum",
    "Summary",
]


_EVENTS_OF_KIND = {"collector": COLLECTOR_EVENTS, "replay_buffer": REPLAY_BUFFER_EVENTS}


def _arity(fn: Callable[..., Any], event: str, owner: str) -> int:
    """How many payload arguments ``fn`` takes (``len(payload) + 1``: the source too, never to a default)."""
    payload = EVENT_PAYLOADS[event]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return 1
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p for p in signature.parameters.values()
        if p.kind in positional and p.default is inspect.Parameter.empty
    ]
    if len(required) == len(payload) + 1:
        return len(payload) + 1
    for n in range(len(payload), 0, -1):
        try:
            signature.bind(*range(n))
        except TypeError:
            continue
        return n
    raise TypeError(
        f"{owner}: the function must accept the {event} payload "
        f"({' or '.join(', '.join(payload[:n]) for n in range(1, len(payload) + 1))}), "
        f"got {fn!r} with signature {signature}."
    )


class Metric(MetricSet):
    """Base of the one-liners: a name, a function of the payload, an event.

    Subclasses implement :meth:`fold` and :meth:`partials`, both under the lock.

    Args:
        name (str): the logged name (or prefix).
        fn (callable): a function of the event's payload, run where the data is.

    Keyword Args:
        on (str, optional): ``"post_collect"`` (default), ``"post_sample"``,
            ``"post_extend"`` or ``"post_add"``; a target that does not emit
            it is refused at attach time.
    """

    _lock_folds = False  # the function runs outside the lock; only folding takes it

    def __init__(self, name: str, fn: Callable[..., Any] | None, *, on: str = "post_collect") -> None:
        super().__init__()
        owner = f"{type(self).__name__}({name!r})"
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}: name must be a non-empty str, got {name!r}.")
        if on not in DATA_EVENTS:
            raise ValueError(f"{owner}: on must be one of {DATA_EVENTS}, got {on!r}.")
        if fn is not None and not callable(fn):
            raise TypeError(f"{owner}: fn must be callable, got {fn!r}.")
        self.name = name
        self.fn = fn
        self.on = on
        self.folded_events = (on,)
        arity = 1 if fn is None else _arity(fn, on, owner)
        self._full = arity >= 2
        # the source too, last (see the module's docs): fn(*payload, source)
        self._with_source = arity == len(EVENT_PAYLOADS[on]) + 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, on={self.on!r})"

    def bind(self, source: Any) -> None:
        """Refuses a source that does not emit ``on``."""
        emits = _EVENTS_OF_KIND.get(source_kind(source))  # type: ignore[arg-type]
        if emits is not None and self.on not in emits:
            others = [e for e in DATA_EVENTS if e in emits]
            raise ValueError(
                f"{self!r} folds {self.on!r}, which a {type(source).__name__} does not emit; "
                f"pass on= one of {others}."
            )

    # -- events: the function runs outside the lock --------------------------------------

    def on_post_collect(self, source: Any, batch: Any) -> None:
        value = self.fn(batch, source) if self._with_source else self.fn(batch)  # type: ignore[misc]
        if value is not None:
            with self._lock:
                self.fold(value)

    def on_post_sample(self, source: Any, data: Any, extra: Any) -> None:
        # (also on_post_extend and on_post_add: their payloads are pairs too)
        if self._with_source:
            value = self.fn(data, extra, source)  # type: ignore[misc]
        else:
            value = self.fn(data, extra) if self._full else self.fn(data)  # type: ignore[misc]
        if value is not None:
            with self._lock:
                self.fold(value)

    on_post_extend = on_post_add = on_post_sample

    # -- what subclasses define ------------------------------------------------------------

    def fold(self, value: Any) -> None:
        """Folds one event's value (called under the lock)."""
        raise NotImplementedError

    def partials(self) -> dict[str, Partial]:
        """Closes the window: ``{name: partial}`` (called under the lock)."""
        raise NotImplementedError

    def metric_names(self) -> tuple[str, ...]:
        return (self.name,)

    def pull(self) -> dict[str, float | Partial]:
        with self._lock:
            out = MetricSet.pull(self)
            self._close(out)
            return out

    def _close(self, out: dict[str, Any]) -> None:
        """Merges :meth:`partials` into the bank's window ``out``, by name."""
        for name, partial in self.partials().items():
            folded = out.get(name)
            out[name] = partial if folded is None else folded.merge(partial)

    def _clear_window(self) -> None:
        self.partials()


def _host_number(value: Any, owner: Metric) -> float:
    """``value`` (not a tensor) as a float: a Python or numpy real number, else a TypeError."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":  # np.float32(2.5), np.int64(3)
        return float(value)
    if isinstance(value, (complex, np.complexfloating)):
        raise TypeError(
            f"{owner!r}: the function returned a complex number ({value!r}); return a real "
            "one, such as abs(value) or value.real."
        )
    raise TypeError(
        f"{owner!r}: the function must return a tensor, a real number (Python's or a numpy "
        f"scalar) or None, got {type(value).__name__}."
    )


def _complex_tensor(value: torch.Tensor, owner: Metric) -> TypeError:
    """The error of a complex tensor, which a float64 fold would cut to its real part."""
    return TypeError(
        f"{owner!r}: the function returned a complex tensor ({value.dtype}); return a "
        "real one, such as value.abs() or value.real."
    )


def _fold_tensor(reducer: Any, value: torch.Tensor, owner: Metric) -> None:
    try:
        reducer.fold(value)
    except TypeError:  # the reducer refuses complex values: name the function's
        if value.is_complex():
            raise _complex_tensor(value, owner) from None
        raise


class _Reduced(Metric):
    """Values merged by a :class:`~rl_observers.stats.Scalar` rule."""

    rule = "mean"

    def __init__(self, name: str, fn: Callable[..., Any], *, on: str = "post_collect") -> None:
        super().__init__(name, fn, on=on)
        rule = self.rule
        self._moments = self.moments(name, stats=("count", "mean", "min", "max")) if rule != "latest" else None
        self._host = Scalar(name, rule)
        self._last: torch.Tensor | None = None
        self._last_stamp = -math.inf

    def fold(self, value: Any) -> None:
        rule = self.rule
        if isinstance(value, torch.Tensor):
            if rule == "latest":
                if value.is_complex():
                    raise _complex_tensor(value, self)
                if value.numel() != 1:
                    raise ValueError(
                        f"{self!r} with merge='latest' needs one number per event, got a tensor "
                        f"of shape {list(value.shape)}."
                    )
                self._last = value.detach().reshape(()).clone()  # the batch's memory may be reused
                self._last_stamp = time.time()
                self._host = Scalar(self.name, rule)
                return
            _fold_tensor(self._moments, value, self)
            return
        value = _host_number(value, self)
        stamp = time.time()
        if rule == "latest":
            self._last = None
        self._host = self._host.merge(Scalar(self.name, rule, value, stamp=stamp))

    def partials(self) -> dict[str, Partial]:
        rule, name = self.rule, self.name
        out = self._host
        self._host = Scalar(name, rule)
        if self._last is not None:
            out = out.merge(Scalar(name, rule, float(self._last), stamp=self._last_stamp))
            self._last = None
        return {name: out}

    def _close(self, out: dict[str, Any]) -> None:
        moments = out.pop(self.name, None)
        host = self.partials()[self.name]
        if isinstance(moments, Moments) and moments.count:
            # The folded sum itself (float64, exact for integers up to 2**53), not mean * n.
            value = getattr(moments, "sum" if self.rule == "mean" else self.rule)
            host = host.merge(Scalar(self.name, self.rule, value, count=moments.count, stamp=time.time()))
        out[self.name] = host


class Mean(_Reduced):
    """The mean of every value the function returns over the window (all workers); a tensor contributes each entry.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rl_observers import Mean
        >>> metric = Mean("action_abs", lambda batch: batch["action"].abs())
        >>> metric.on_post_collect(None, TensorDict({"action": torch.tensor([-1.0, 3.0])}, [2]))
        >>> metric.on_post_collect(None, TensorDict({"action": torch.tensor([2.0])}, [1]))
        >>> metric.pull()["action_abs"].finalize()
        {'action_abs': 2.0}
    """

    rule = "mean"


class Sum(_Reduced):
    """The sum of every value over the window, summed across workers.

    Examples:
        >>> import torch
        >>> from rl_observers import Sum
        >>> metric = Sum("reward_total", lambda batch: batch, on="post_sample")
        >>> metric.on_post_sample(None, torch.tensor([1.0, 2.0]), {})
        >>> metric.pull()["reward_total"].finalize()
        {'reward_total': 3.0}
    """

    rule = "sum"


class Min(_Reduced):
    """The smallest value over the window and the workers."""

    rule = "min"


class Max(_Reduced):
    """The largest value over the window and the workers.

    Examples:
        >>> import torch
        >>> from rl_observers import Max
        >>> metric = Max("reward_max", lambda batch: batch)
        >>> metric.on_post_collect(None, torch.tensor([1.0, 5.0]))
        >>> metric.pull()["reward_max"].finalize()
        {'reward_max': 5.0}
    """

    rule = "max"


class Gauge(_Reduced):
    """A number per event, merged by the declared rule.

    Args:
        name (str): the logged name.
        fn (callable): returns a number or a tensor (one element with
            ``merge="latest"``).

    Keyword Args:
        merge (str): ``"latest"`` (newest by wall-clock time, of all
            workers), ``"mean"``, ``"max"``, ``"min"`` or ``"sum"``; required.
        on (str, optional): see :class:`Metric`.

    Examples:
        >>> from rl_observers import Gauge
        >>> versions = iter([3, 4])
        >>> metric = Gauge("policy_version", lambda batch: next(versions), merge="latest")
        >>> metric.on_post_collect(None, None)
        >>> metric.on_post_collect(None, None)
        >>> metric.pull()["policy_version"].finalize()
        {'policy_version': 4.0}
    """

    def __init__(
        self, name: str, fn: Callable[..., Any], *, merge: str, on: str = "post_collect"
    ) -> None:
        if merge not in ("latest", "mean", "max", "min", "sum"):
            raise ValueError(
                f"Gauge({name!r}): merge must be 'latest', 'mean', 'max', 'min' or 'sum', got {merge!r}."
            )
        self.rule = merge
        super().__init__(name, fn, on=on)

    def __repr__(self) -> str:
        return f"Gauge({self.name!r}, merge={self.rule!r}, on={self.on!r})"


class Summary(Metric):
    """``<name>_mean``, ``_std``, ``_min``, ``_max`` (or the ``stats`` chosen) of the values: exact moments.

    Examples:
        >>> import torch
        >>> from rl_observers import Summary
        >>> metric = Summary("q", lambda batch: batch, stats=("mean", "max"))
        >>> metric.on_post_collect(None, torch.tensor([1.0, 3.0]))
        >>> metric.on_post_collect(None, 8.0)
        >>> metric.pull()["q"].finalize()
        {'q_mean': 4.0, 'q_max': 8.0}
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        stats: Sequence[str] = ("mean", "std", "min", "max"),
        on: str = "post_collect",
    ) -> None:
        super().__init__(name, fn, on=on)
        self.stats = tuple(stats)
        self._moments = self.moments(name, stats=self.stats)
        self._host: list[float] = []

    def fold(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            _fold_tensor(self._moments, value, self)
        else:
            self._host.append(_host_number(value, self))

    def partials(self) -> dict[str, Partial]:
        host, self._host = self._host, []
        return {self.name: Moments.from_values(self.name, host, stats=self.stats)}

    def metric_names(self) -> tuple[str, ...]:
        return (self.name, *(f"{self.name}_{s}" for s in self.stats if s in MOMENT_STATS))


class CountTrue(Metric):
    """How many entries are true (non-zero) over the window, summed across workers.

    A number counts one if non-zero; neither tensor nor number is refused.

    Examples:
        >>> import torch
        >>> from rl_observers import CountTrue
        >>> metric = CountTrue("truncated", lambda batch: batch)
        >>> metric.on_post_collect(None, torch.tensor([True, False, True]))
        >>> metric.pull()["truncated"].finalize()
        {'truncated': 2.0}
    """

    def __init__(self, name: str, fn: Callable[..., Any], *, on: str = "post_collect") -> None:
        super().__init__(name, fn, on=on)
        self._count = self.count(name)
        self._host = 0

    def fold(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._count.fold_true(value)
        else:
            self._host += 1 if _host_number(value, self) else 0

    def partials(self) -> dict[str, Partial]:
        host, self._host = self._host, 0
        return {self.name: Count(self.name, host)}


class Ratio(Metric):
    """Summed numerators over summed denominators: never a mean of fractions.

    The function returns a boolean tensor (the fraction of true entries) or a
    pair ``(numerator, denominator)`` of numbers or tensors.

    Examples:
        >>> import torch
        >>> from rl_observers import Ratio
        >>> metric = Ratio("greedy", lambda batch: batch)
        >>> metric.on_post_collect(None, torch.tensor([True, False, False, False]))
        >>> metric.on_post_collect(None, torch.tensor([True]))
        >>> metric.pull()["greedy"].finalize()
        {'greedy': 0.4}
    """

    def __init__(self, name: str, fn: Callable[..., Any], *, on: str = "post_collect") -> None:
        super().__init__(name, fn, on=on)
        self._num = self.count(f"{name}/numerator")
        self._den = self.count(f"{name}/denominator")
        self._host = [0.0, 0.0]

    def fold(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._num.fold_true(value)
            self._den.add(value.numel(), device=value.device)
            return
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(
                f"{self!r}: the function must return a boolean tensor or a pair "
                f"(numerator, denominator), got {type(value).__name__}."
            )
        for i, (part, reducer) in enumerate(zip(value, (self._num, self._den))):
            if isinstance(part, torch.Tensor):
                if part.is_complex():
                    raise _complex_tensor(part, self)
                reducer.add(part.sum() if part.ndim else part)
            else:
                self._host[i] += _host_number(part, self)

    def partials(self) -> dict[str, Partial]:
        num, den = self._host
        self._host = [0.0, 0.0]
        return {self.name: Fraction(self.name, num, den)}

    def _close(self, out: dict[str, Any]) -> None:
        num, den = out.pop(f"{self.name}/numerator"), out.pop(f"{self.name}/denominator")
        out[self.name] = self.partials()[self.name].merge(Fraction(self.name, num.n, den.n))

    def metric_names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}/numerator", f"{self.name}/denominator")


def _one(*payload: Any) -> int:
    return 1


class Rate(Metric):
    """An amount per second of wall-clock time over the window; workers' rates add.

    The function returns one event's amount (without one, each event counts
    one). A window spans from the previous pull (or the bind) to this pull.

    Examples:
        >>> import torch
        >>> from rl_observers import Rate
        >>> metric = Rate("frames_per_second", lambda batch: batch.numel())
        >>> metric.on_post_collect(None, torch.zeros(100))
        >>> metric.pull()["frames_per_second"].finalize()["frames_per_second"] > 0
        True
    """

    def __init__(
        self, name: str, fn: Callable[..., Any] | None = None, *, on: str = "post_collect"
    ) -> None:
        super().__init__(name, fn if fn is not None else _one, on=on)
        self._amount = self.count(name)
        self._host = 0.0
        self._start = time.time()

    def bind(self, source: Any) -> None:
        super().bind(source)
        self._start = time.time()

    def fold(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_complex():
                raise _complex_tensor(value, self)
            self._amount.add(value.sum() if value.ndim else value)
        else:
            self._host += _host_number(value, self)

    def partials(self) -> dict[str, Partial]:
        now = time.time()
        out = PerSecond(self.name, self._host, self._start, now)
        self._host, self._start = 0.0, now
        return {self.name: out}

    def _close(self, out: dict[str, Any]) -> None:
        host = self.partials()[self.name]
        amount = host.amount + out.pop(self.name).n  # type: ignore[attr-defined]
        out[self.name] = PerSecond(self.name, amount, host.start, host.end)  # type: ignore[attr-defined]
