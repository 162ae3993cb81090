"""Torch-free partials of one value under a merge rule, fractions, rates and histograms.

What the metric one-liners (:mod:`rl_observers.metrics.oneliners`) submit.

Examples:
    >>> from rl_observers.stats import Fraction, Scalar
    >>> Scalar("lag", "max", 3.0).merge(Scalar("lag", "max", 5.0)).finalize()
    {'lag': 5.0}
    >>> Scalar("lag", "mean", 6.0, count=2).merge(Scalar("lag", "mean", 3.0)).finalize()
    {'lag': 3.0}
    >>> Fraction("greedy", 1, 4).merge(Fraction("greedy", 0, 1)).finalize()
    {'greedy': 0.2}
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from rl_observers.stats.partials import Partial, _check_name, _max, _min, _total

__all__ = ["SCALAR_RULES", "BinCounts", "Fraction", "LastEvent", "PerSecond", "Scalar"]

#: The merge rules of a :class:`Scalar`.
SCALAR_RULES: tuple[str, ...] = ("sum", "mean", "min", "max", "latest")


class Scalar(Partial):
    """One named value merged by a declared rule.

    Args:
        name (str): the logged name.
        rule (str): ``"sum"``, ``"mean"`` (``value`` holds the sum of
            ``count`` values), ``"min"``, ``"max"`` (a NaN wins), or
            ``"latest"`` (the largest ``stamp`` wins).
        value (float, optional): see ``rule``. Defaults to ``0``.

    Keyword Args:
        count (float, optional): values folded. Defaults to ``1`` with a
            ``value``, else ``0`` (empty: finalizes to ``{}``, ``0`` for a sum).
        stamp (float, optional): when ``value`` was seen. Defaults to ``-inf``.

    Examples:
        >>> from rl_observers.stats import Scalar
        >>> a = Scalar("policy_version", "latest", 3.0, stamp=10.0)
        >>> a.merge(Scalar("policy_version", "latest", 4.0, stamp=11.0)).finalize()
        {'policy_version': 4.0}
        >>> Scalar("frames", "sum").finalize()
        {'frames': 0.0}
    """

    __slots__ = ("name", "rule", "value", "count", "stamp")

    def __init__(
        self,
        name: str,
        rule: str,
        value: float | None = None,
        *,
        count: float | None = None,
        stamp: float = -math.inf,
    ) -> None:
        self.name = _check_name(name, "name")
        if rule not in SCALAR_RULES:
            raise ValueError(f"rule must be one of {SCALAR_RULES}, got {rule!r} (for {name!r}).")
        self.rule = rule
        if count is None:
            count = 0.0 if value is None else 1.0
        self.count = float(count)
        self.value = float(value) if value is not None and count else _EMPTY[rule]
        self.stamp = float(stamp)

    def merge(self, other: Partial) -> Scalar:
        """Returns the value of both operands' data under the rule."""
        if not isinstance(other, Scalar) or other.name != self.name or other.rule != self.rule:
            raise ValueError(f"cannot merge {self!r} with {other!r}: name and rule must agree.")
        if not other.count:
            return self._with(self.value, self.count, self.stamp)
        if not self.count:
            return other._with(other.value, other.count, other.stamp)
        rule, a, b = self.rule, self.value, other.value
        count = self.count + other.count
        if rule == "latest":
            newest = other if other.stamp > self.stamp else self  # ties: the left operand's
            return self._with(newest.value, count, newest.stamp)
        # min and max: a NaN wins, in either order (as torch.minimum)
        value = _min(a, b) if rule == "min" else _max(a, b) if rule == "max" else a + b
        return self._with(value, count, max(self.stamp, other.stamp))

    def _with(self, value: float, count: float, stamp: float) -> Scalar:
        out = object.__new__(self.__class__)
        out.name, out.rule = self.name, self.rule
        out.value, out.count, out.stamp = value, count, stamp
        return out

    def finalize(self) -> dict[str, float]:
        """Returns ``{name: value}`` (``{}`` when empty, ``{name: 0.0}`` for an empty sum)."""
        if not self.count:
            return {self.name: 0.0} if self.rule == "sum" else {}
        if self.rule == "mean":
            return {self.name: self.value / self.count}
        return {self.name: self.value}


_EMPTY = {"sum": 0.0, "mean": 0.0, "min": math.inf, "max": -math.inf, "latest": 0.0}


class Fraction(Partial):
    """``numerator / denominator``, both summed on merge (``{}`` without a denominator).

    Examples:
        >>> from rl_observers.stats import Fraction
        >>> Fraction("truncated", 1, 4).merge(Fraction("truncated", 0, 1)).finalize()
        {'truncated': 0.2}
    """

    __slots__ = ("name", "numerator", "denominator")

    def __init__(self, name: str, numerator: float = 0.0, denominator: float = 0.0) -> None:
        self.name = _check_name(name, "name")
        self.numerator = float(numerator)
        self.denominator = float(denominator)

    def merge(self, other: Partial) -> Fraction:
        """Returns the fraction of both operands' counts."""
        if not isinstance(other, Fraction) or other.name != self.name:
            raise ValueError(f"cannot merge {self!r} with {other!r}: names must agree.")
        return Fraction(
            self.name, self.numerator + other.numerator, self.denominator + other.denominator
        )

    def finalize(self) -> dict[str, float]:
        """Returns ``{name: numerator / denominator}``, ``{}`` without a denominator."""
        return {self.name: self.numerator / self.denominator} if self.denominator else {}


class PerSecond(Partial):
    """An amount over the wall-clock span ``[start, end]`` (``time.time()`` seconds).

    Merging adds amounts and unites spans: concurrent workers add their rates.

    Examples:
        >>> from rl_observers.stats import PerSecond
        >>> a = PerSecond("fps", 100, start=0.0, end=1.0)
        >>> b = PerSecond("fps", 300, start=0.0, end=1.0)  # another worker, same second
        >>> a.merge(b).finalize()
        {'fps': 400.0}
        >>> a.merge(PerSecond("fps", 300, start=1.0, end=2.0)).finalize()  # the next second
        {'fps': 200.0}
    """

    __slots__ = ("name", "amount", "start", "end")

    def __init__(
        self, name: str, amount: float = 0.0, start: float = math.inf, end: float = -math.inf
    ) -> None:
        self.name = _check_name(name, "name")
        self.amount = float(amount)
        self.start = float(start)
        self.end = float(end)

    def merge(self, other: Partial) -> PerSecond:
        """Returns both amounts over the union of both spans."""
        if not isinstance(other, PerSecond) or other.name != self.name:
            raise ValueError(f"cannot merge {self!r} with {other!r}: names must agree.")
        return PerSecond(
            self.name,
            self.amount + other.amount,
            min(self.start, other.start),
            max(self.end, other.end),
        )

    def finalize(self) -> dict[str, float]:
        """Returns ``{name: amount / seconds}``, ``{}`` without a positive span."""
        seconds = self.end - self.start
        return {self.name: self.amount / seconds} if seconds > 0 else {}


class LastEvent(Partial):
    """When a window's last event happened at the source (under :attr:`KEY`); merged by max, logs nothing.

    Examples:
        >>> from rl_observers.stats import LastEvent
        >>> LastEvent(10.0).merge(LastEvent(12.5)).time, LastEvent(12.5).finalize()
        (12.5, {})
    """

    __slots__ = ("time",)
    #: The key of a window's :class:`LastEvent`.
    KEY = "last_event"

    def __init__(self, time: float = -math.inf) -> None:
        self.time = float(time)

    def merge(self, other: Partial) -> LastEvent:
        """Returns the later of both times."""
        return LastEvent(_max(self.time, other.time))  # type: ignore[attr-defined]

    def finalize(self) -> dict[str, float]:
        """Returns ``{}``: a time is not a metric."""
        return {}


def quantile_name(name: str, q: float) -> str:
    """``"<name>_p<100 q>"``: ``p50``, ``p90``, ``p99.9``."""
    return f"{name}_p{q * 100:g}"


class BinCounts(Partial):
    """Counts of values over fixed bins, merged exactly; finalized as quantiles.

    Bins as ``torch.bucketize`` gives them: ``<= edges[0]``, ``(edges[i-1],
    edges[i]]``, ``> edges[-1]``. A quantile is interpolated inside its bin
    (outer bins read as the outer edges). NaN values count apart
    (``<name>_nan_count``). The exact ``sum``, ``sum_squares``, ``min`` and
    ``max`` merge too, for histogram views (not logged as scalars).

    Args:
        name (str): outputs are ``<name>_count`` and ``<name>_p50`` etc.
        edges (sequence of float): strictly increasing.
        counts (sequence of float, optional): ``len(edges) + 1`` counts.
            Defaults to zeros.

    Keyword Args:
        quantiles (sequence of float, optional): Defaults to
            ``(0.5, 0.9, 0.99)``.
        nan, sum, sum_squares, min, max (float, optional): Defaults to ``0``,
            ``0``, ``0``, ``inf`` and ``-inf``.

    Examples:
        >>> from rl_observers.stats import BinCounts
        >>> a = BinCounts.from_values("lag", [0, 1, 2, 3], edges=range(11))
        >>> b = BinCounts.from_values("lag", [4, 5, 6, 7, 8, 9], edges=range(11))
        >>> a.merge(b).finalize()
        {'lag_count': 10.0, 'lag_p50': 4.0, 'lag_p90': 8.0, 'lag_p99': 8.9}
        >>> BinCounts.from_values("lag", [1, float("nan")], edges=range(11), quantiles=(0.5,)).finalize()
        {'lag_count': 1.0, 'lag_p50': 0.5, 'lag_nan_count': 1.0}
    """

    __slots__ = ("name", "edges", "counts", "quantiles", "nan", "sum", "sum_squares", "min", "max")

    def __init__(
        self,
        name: str,
        edges: Sequence[float],
        counts: Sequence[float] | None = None,
        *,
        quantiles: Sequence[float] = (0.5, 0.9, 0.99),
        nan: float = 0.0,
        sum: float = 0.0,
        sum_squares: float = 0.0,
        min: float = math.inf,
        max: float = -math.inf,
    ) -> None:
        self.name = _check_name(name, "name")
        self.edges = edges = tuple(map(float, edges))
        increasing = all(a < b for a, b in zip(edges, edges[1:]))
        if len(edges) < 2 or not increasing or not all(map(math.isfinite, edges)):
            raise ValueError(
                f"edges must be at least two finite, strictly increasing numbers, got {edges!r} "
                f"(for {name!r})."
            )
        self.quantiles = quantiles = tuple(map(float, quantiles))
        if not all(0.0 <= q <= 1.0 for q in quantiles):
            raise ValueError(f"quantiles must lie in [0, 1], got {quantiles!r} (for {name!r}).")
        self.nan = float(nan)
        self.sum, self.sum_squares = float(sum), float(sum_squares)
        self.min, self.max = float(min), float(max)
        self.counts = tuple(map(float, (0.0,) * (len(edges) + 1) if counts is None else counts))
        if len(self.counts) != len(self.edges) + 1:
            raise ValueError(
                f"counts must have len(edges) + 1 = {len(self.edges) + 1} entries, "
                f"got {len(self.counts)} (for {name!r})."
            )

    @classmethod
    def from_values(
        cls,
        name: str,
        values: Sequence[float],
        *,
        edges: Sequence[float],
        quantiles: Sequence[float] = (0.5, 0.9, 0.99),
    ) -> BinCounts:
        """Counts ``values`` on the host (NaN values in ``nan``)."""
        values = [float(v) for v in values]
        binned = [v for v in values if v == v]
        out = cls(name, edges, quantiles=quantiles, nan=len(values) - len(binned))
        counts = list(out.counts)
        for v in binned:
            counts[bisect.bisect_left(out.edges, v)] += 1
        out.counts = tuple(counts)
        if binned:
            out.sum, out.sum_squares = _total(binned), _total([v * v for v in binned])
            out.min, out.max = min(binned), max(binned)
        return out

    def merge(self, other: Partial) -> BinCounts:
        """Returns the counts of both operands' values."""
        self._check_merge(other, "name", "edges", "quantiles")
        out = object.__new__(BinCounts)
        out.name, out.edges, out.quantiles = self.name, self.edges, self.quantiles
        out.counts = tuple(a + b for a, b in zip(self.counts, other.counts))
        out.nan = self.nan + other.nan
        out.sum, out.sum_squares = self.sum + other.sum, self.sum_squares + other.sum_squares
        out.min, out.max = _min(self.min, other.min), _max(self.max, other.max)
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile read off the counts (``None`` when empty)."""
        total = sum(self.counts)
        if not total:
            return None
        rank, seen, edges = q * total, 0.0, self.edges
        last = len(self.counts) - 1
        for i, count in enumerate(self.counts):
            if count and seen + count >= rank:
                if i == 0:
                    return edges[0]
                if i == last:
                    return edges[-1]
                lo, hi = edges[i - 1], edges[i]
                return lo + (hi - lo) * max(rank - seen, 0.0) / count
            seen += count
        return edges[-1]

    def finalize(self) -> dict[str, float]:
        """Returns ``<name>_count``, ``<name>_p<q>`` per quantile and ``<name>_nan_count`` (when any)."""
        out = {f"{self.name}_count": float(sum(self.counts))}
        if out[f"{self.name}_count"]:
            for q in self.quantiles:
                out[quantile_name(self.name, q)] = self.quantile(q)  # type: ignore[assignment]
        if self.nan:
            out[f"{self.name}_nan_count"] = self.nan
        return out

    def __repr__(self) -> str:
        nan = f", nan={self.nan!r}" if self.nan else ""
        return f"BinCounts({self.name!r}, edges={self.edges!r}, counts={self.counts!r}{nan})"
