"""Mergeable partial statistics, torch-free: what crosses a process boundary.

A :class:`Partial` (:class:`Moments`, :class:`Count`) is a small, picklable,
mergeable statistic. Any merge of partials, in any grouping and any order,
equals the statistic over the union of the data (up to floating-point
rounding), so partials can cross process boundaries and be combined by code
that knows nothing about RL. The empty partial is the identity of
:meth:`Partial.merge`. Device-side folding lives in
:mod:`rl_observers.stats.reducers`; the dict-level rule that merges whole
payloads lives in the channel.

Examples:
    >>> from rl_observers.stats import Count, Moments
    >>> a = Moments.from_values("reward", [1.0, 2.0, 3.0])
    >>> b = Moments.from_values("reward", [4.0, 5.0])
    >>> a.merge(b).finalize()["reward_mean"]
    3.0
    >>> Count("dones", 1).merge(Count("dones", 0)).finalize()
    {'dones': 1.0}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["MOMENT_STATS", "Count", "Moments", "Partial"]

#: Statistics a :class:`Moments` partial can emit, in output order.
MOMENT_STATS: tuple[str, ...] = ("count", "mean", "std", "var", "min", "max")
_DEFAULT_MOMENT_STATS: tuple[str, ...] = ("mean", "std", "min", "max")


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {value!r}.")
    return value


def _check_stats(stats: Iterable[str], prefix: str) -> tuple[str, ...]:
    if isinstance(stats, str):
        raise TypeError(f"stats must be a sequence of str, got {stats!r} (for {prefix!r}).")
    stats = tuple(stats)
    unknown = [s for s in stats if s not in MOMENT_STATS]
    if unknown or not stats or len(set(stats)) != len(stats):
        raise ValueError(
            f"stats must be a non-empty sequence of distinct names among {MOMENT_STATS}, "
            f"got {stats!r} (for {prefix!r})."
        )
    return stats


class Partial:
    """A mergeable partial statistic: what crosses a process boundary.

    Subclasses are small, picklable objects with ``__slots__``. The contract:

    * :meth:`merge` is exact (up to floating-point rounding), associative and
      commutative, returns a new object and leaves both operands untouched;
      merging with an empty partial returns an equal partial.
    * :meth:`finalize` maps metric names (relative to a namespace, such as
      ``"reward_mean"``) to floats. An empty partial reports its counts as
      ``0`` and omits means, deviations, minima and maxima.

    Examples:
        >>> from rl_observers.stats import Count, Partial
        >>> isinstance(Count("episodes", 2), Partial)
        True
    """

    __slots__ = ()

    def merge(self, other: Partial) -> Partial:
        """Returns the partial of the union of both operands' data."""
        raise NotImplementedError

    def finalize(self) -> dict[str, float]:
        """Returns ``{metric name: value}`` for this partial."""
        raise NotImplementedError


def _chan(
    na: float, mean_a: float, m2_a: float, nb: float, mean_b: float, m2_b: float
) -> tuple[float, float, float]:
    """Count, mean and M2 of the union of two non-empty parts (Chan et al.)."""
    n = na + nb
    delta = mean_b - mean_a
    # Symmetric in (a, b), so a merge is exactly commutative.
    mean = (na * mean_a + nb * mean_b) / n
    m2 = m2_a + m2_b + delta * delta * (na * nb / n)
    return n, mean, m2


class Moments(Partial):
    """Count, mean, sum of squared deviations, minimum and maximum of some values.

    Merging uses Chan et al.'s parallel update, so the mean and standard
    deviation of merged partials are those of the union of the data; the
    standard deviation is the **population** one (``sqrt(M2 / count)``, what
    ``torch.std(x, correction=0)`` and ``statistics.pstdev`` compute), which is
    defined for a single value and does not depend on how data was split.

    Args:
        prefix (str): output names are ``f"{prefix}_{stat}"`` (or ``stat`` when
            the prefix is empty), e.g. ``"reward"`` gives ``reward_mean``. Two
            partials merge only when their prefix and ``stats`` agree.

    Keyword Args:
        stats (sequence of str, optional): which statistics :meth:`finalize`
            emits, among ``"count"``, ``"mean"``, ``"std"``, ``"var"``,
            ``"min"``, ``"max"``. Defaults to ``("mean", "std", "min", "max")``.
        count (float, optional): number of values. Defaults to ``0``.
        mean (float, optional): their mean. Defaults to ``0``.
        m2 (float, optional): sum of squared deviations from the mean.
            Defaults to ``0``.
        min (float, optional): their minimum. Defaults to ``inf``.
        max (float, optional): their maximum. Defaults to ``-inf``.

    Examples:
        >>> from rl_observers.stats import Moments
        >>> a = Moments.from_values("episode_return", [1.0, 3.0])
        >>> b = Moments.from_values("episode_return", [5.0])
        >>> a.merge(b).finalize()
        {'episode_return_mean': 3.0, 'episode_return_std': 1.632993161855452, 'episode_return_min': 1.0, 'episode_return_max': 5.0}
        >>> Moments("episode_return", stats=("count", "mean")).finalize()  # empty
        {'episode_return_count': 0.0}
    """

    __slots__ = ("prefix", "stats", "count", "mean", "m2", "min", "max")

    def __init__(
        self,
        prefix: str,
        *,
        stats: Sequence[str] = _DEFAULT_MOMENT_STATS,
        count: float = 0.0,
        mean: float = 0.0,
        m2: float = 0.0,
        min: float = math.inf,
        max: float = -math.inf,
    ) -> None:
        self.prefix = _check_name(prefix, "prefix")
        self.stats = _check_stats(stats, prefix)
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count!r} (for {prefix!r}).")
        self.count = float(count)
        self.mean = float(mean) if count else 0.0
        self.m2 = float(m2) if count else 0.0
        self.min = float(min) if count else math.inf
        self.max = float(max) if count else -math.inf

    @classmethod
    def from_values(
        cls, prefix: str, values: Iterable[float], *, stats: Sequence[str] = _DEFAULT_MOMENT_STATS
    ) -> Moments:
        """Builds the partial of ``values`` on the host (two-pass, ``math.fsum``).

        Examples:
            >>> from rl_observers.stats import Moments
            >>> Moments.from_values("x", [2.0, 4.0], stats=("count", "mean")).finalize()
            {'x_count': 2.0, 'x_mean': 3.0}
        """
        values = [float(v) for v in values]
        if not values:
            return cls(prefix, stats=stats)
        mean = math.fsum(values) / len(values)
        m2 = math.fsum((v - mean) ** 2 for v in values)
        return cls(
            prefix,
            stats=stats,
            count=len(values),
            mean=mean,
            m2=m2,
            min=min(values),
            max=max(values),
        )

    def merge(self, other: Partial) -> Moments:
        """Returns the moments of the union of both operands' values."""
        if (
            not isinstance(other, Moments)
            or other.prefix != self.prefix
            or other.stats != self.stats
        ):
            raise ValueError(f"cannot merge {self!r} with {other!r}: prefix and stats must agree.")
        na, nb = self.count, other.count
        if not nb:
            return self._copy()
        if not na:
            return other._copy()
        n, mean, m2 = _chan(na, self.mean, self.m2, nb, other.mean, other.m2)
        return Moments._trusted(
            self.prefix,
            self.stats,
            n,
            mean,
            m2,
            min(self.min, other.min),
            max(self.max, other.max),
        )

    @classmethod
    def _trusted(
        cls,
        prefix: str,
        stats: tuple[str, ...],
        count: float,
        mean: float,
        m2: float,
        min: float,
        max: float,
    ) -> Moments:
        """Builds a partial from validated ``prefix``/``stats`` and a positive ``count``."""
        self = object.__new__(cls)
        self.prefix = prefix
        self.stats = stats
        self.count = float(count)
        self.mean = float(mean)
        self.m2 = float(m2)
        self.min = float(min)
        self.max = float(max)
        return self

    def _copy(self) -> Moments:
        return Moments._trusted(
            self.prefix, self.stats, self.count, self.mean, self.m2, self.min, self.max
        )

    def finalize(self) -> dict[str, float]:
        """Returns the chosen statistics; an empty partial reports only its count."""
        out: dict[str, float] = {}
        prefix = f"{self.prefix}_" if self.prefix else ""
        n = self.count
        for stat in self.stats:
            if stat == "count":
                out[prefix + "count"] = n
            elif not n:
                continue
            elif stat == "mean":
                out[prefix + "mean"] = self.mean
            elif stat == "var":
                out[prefix + "var"] = max(self.m2, 0.0) / n
            elif stat == "std":
                out[prefix + "std"] = math.sqrt(max(self.m2, 0.0) / n)
            elif stat == "min":
                out[prefix + "min"] = self.min
            else:
                out[prefix + "max"] = self.max
        return out

    def __repr__(self) -> str:
        return (
            f"Moments({self.prefix!r}, count={self.count!r}, mean={self.mean!r}, "
            f"m2={self.m2!r}, min={self.min!r}, max={self.max!r})"
        )


class Count(Partial):
    """A count over a window: merges by addition, finalizes to ``{name: n}``.

    Args:
        name (str): the metric name, e.g. ``"episodes"``.
        n (float, optional): the count. Defaults to ``0``.

    Examples:
        >>> from rl_observers.stats import Count
        >>> Count("dones", 2).merge(Count("dones", 3)).finalize()
        {'dones': 5.0}
    """

    __slots__ = ("name", "n")

    def __init__(self, name: str, n: float = 0) -> None:
        self.name = _check_name(name, "name")
        self.n = float(n)

    def merge(self, other: Partial) -> Count:
        """Returns a count of both operands' events."""
        if not isinstance(other, Count) or other.name != self.name:
            raise ValueError(f"cannot merge {self!r} with {other!r}: names must agree.")
        return Count(self.name, self.n + other.n)

    def finalize(self) -> dict[str, float]:
        """Returns ``{name: n}`` (``0`` when empty)."""
        return {self.name: self.n}

    def __repr__(self) -> str:
        return f"Count({self.name!r}, {self.n!r})"
