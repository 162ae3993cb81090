"""Mergeable partial statistics, torch-free: what crosses a process boundary.

Any merge of partials, in any grouping and order, equals the statistic of
the union of the data (up to rounding); the empty partial is the identity.
See :ref:`partials`.

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

__all__ = [
    "MOMENT_STATS",
    "WINDOW_STATS",
    "Count",
    "LatestWindow",
    "Moments",
    "Partial",
    "QuantileSketch",
]

#: Statistics a :class:`Moments` partial can emit, in output order.
MOMENT_STATS: tuple[str, ...] = ("count", "mean", "std", "var", "min", "max")
_MOMENT_AT = {stat: i for i, stat in enumerate(MOMENT_STATS)}
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
    """A mergeable partial statistic: small and picklable.

    :meth:`merge` is exact, associative and commutative, and returns a new
    object; :meth:`finalize` maps metric names to floats, an empty partial
    giving its counts as ``0`` and no means, deviations, minima or maxima.

    Examples:
        >>> from rl_observers.stats import Count, Partial
        >>> isinstance(Count("episodes", 2), Partial)
        True
    """

    __slots__ = ()
    #: Whether the partial is a state carried from window to window (the last ``N``
    #: episodes): an owner keeps it from row to row and merges contributions into it.
    rolling = False
    #: Whether the partial stands for how long a worker was silent: an owner's row reports
    #: instead the seconds since it last heard from the worker heard from longest ago.
    silence = False

    def merge(self, other: Partial) -> Partial:
        """Returns the partial of the union of both operands' data."""
        raise NotImplementedError

    def _check_merge(self, other: Partial, *agree: str) -> None:
        """Refuses ``other`` unless it is of this class and equals this partial on ``agree``."""
        if not isinstance(other, type(self)) or any(
            getattr(other, name) != getattr(self, name) for name in agree
        ):
            raise ValueError(
                f"cannot merge {self!r} with {other!r}: {', '.join(agree)} must agree."
            )

    def __repr__(self) -> str:
        slots = (cls.__dict__.get("__slots__", ()) for cls in reversed(type(self).__mro__))
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for names in slots for name in names)
        return f"{type(self).__name__}({shown})"

    def finalize(self) -> dict[str, float]:
        """Returns ``{metric name: value}`` for this partial."""
        raise NotImplementedError


def _chan(na: float, mean_a: float, m2_a: float, nb: float, mean_b: float, m2_b: float) -> float:
    """M2 of the union of two non-empty parts (Chan et al.)."""
    delta = mean_b - mean_a
    # Symmetric in (a, b), so a merge is exactly commutative.
    return m2_a + m2_b + delta * delta * (na * nb / (na + nb))


def _min(a: float, b: float) -> float:
    """The smaller of ``a`` and ``b``; NaN when either is NaN (order-independent, unlike ``min``)."""
    return a if a <= b or a != a else b


def _max(a: float, b: float) -> float:
    """The larger of ``a`` and ``b``; NaN when either is NaN, as ``torch.maximum``."""
    return a if a >= b or a != a else b


def _total(values: Sequence[float]) -> float:
    """The correctly rounded sum of ``values``; ``inf - inf`` is NaN, overflow is ``inf``."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # fsum refuses what float addition gives a value for
        return sum(values, 0.0)


class Moments(Partial):
    """Count, sum, mean, sum of squared deviations, minimum and maximum of some values.

    Merging adds counts and sums (integer sums exact up to ``2**53``) and
    combines M2 with Chan et al.'s update. The deviation is the population
    one (``correction=0``). A NaN makes mean, deviation, min and max NaN.

    Args:
        prefix (str): output names are ``f"{prefix}_{stat}"`` (``stat`` when
            empty). Partials merge only when prefix and ``stats`` agree.

    Keyword Args:
        stats (sequence of str, optional): among ``"count"``, ``"mean"``,
            ``"std"``, ``"var"``, ``"min"``, ``"max"``. Defaults to
            ``("mean", "std", "min", "max")``.
        count, mean, sum, m2, min, max (float, optional): the state; ``mean``
            defaults to ``sum / count`` and ``sum`` to ``mean * count``, the
            others to ``0``, ``inf`` and ``-inf`` (empty).

    Examples:
        >>> from rl_observers.stats import Moments
        >>> a = Moments.from_values("episode_return", [1.0, 3.0])
        >>> b = Moments.from_values("episode_return", [5.0])
        >>> a.merge(b).finalize()
        {'episode_return_mean': 3.0, 'episode_return_std': 1.632993161855452, 'episode_return_min': 1.0, 'episode_return_max': 5.0}
        >>> Moments("episode_return", stats=("count", "mean")).finalize()  # empty
        {'episode_return_count': 0.0}
    """

    __slots__ = ("prefix", "stats", "count", "sum", "mean", "m2", "min", "max")

    def __init__(
        self,
        prefix: str,
        *,
        stats: Sequence[str] = _DEFAULT_MOMENT_STATS,
        count: float = 0.0,
        mean: float | None = None,
        sum: float | None = None,
        m2: float = 0.0,
        min: float = math.inf,
        max: float = -math.inf,
    ) -> None:
        self.prefix = _check_name(prefix, "prefix")
        self.stats = _check_stats(stats, prefix)
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count!r} (for {prefix!r}).")
        self.count = float(count)
        if not count:
            mean = sum = 0.0
        elif mean is None:
            sum = 0.0 if sum is None else float(sum)
            mean = sum / self.count
        elif sum is None:
            mean = float(mean)
            sum = mean * self.count
        self.mean = float(mean)
        self.sum = float(sum)
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
        total = _total(values)
        mean = total / len(values)
        m2 = _total([(v - mean) * (v - mean) for v in values])
        if total != total and any(v != v for v in values):
            low = high = math.nan  # Python's min and max would depend on where the NaN is
        else:
            low, high = min(values), max(values)
        return cls(prefix, stats=stats, count=len(values), sum=total, m2=m2, min=low, max=high)

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
        return Moments._trusted(
            self.prefix,
            self.stats,
            na + nb,
            self.sum + other.sum,
            _chan(na, self.mean, self.m2, nb, other.mean, other.m2),
            _min(self.min, other.min),
            _max(self.max, other.max),
        )

    @classmethod
    def _trusted(
        cls,
        prefix: str,
        stats: tuple[str, ...],
        count: float,
        total: float,
        m2: float,
        min: float,
        max: float,
    ) -> Moments:
        """Builds a partial from validated ``prefix``/``stats``, a count and the values' sum."""
        self = object.__new__(cls)
        self.prefix = prefix
        self.stats = stats
        self.count = count = float(count)
        self.sum = total = float(total)
        self.mean = total / count if count else 0.0
        self.m2 = float(m2)
        self.min = float(min)
        self.max = float(max)
        return self

    def __reduce__(self) -> tuple:
        # every window that crosses a process boundary is pickled (twice on the Ray path):
        # the fields as one tuple pickle in half the time of the default for ``__slots__``
        return _moments, (
            self.__class__,
            self.prefix,
            self.stats,
            self.count,
            self.sum,
            self.mean,
            self.m2,
            self.min,
            self.max,
        )

    def _copy(self) -> Moments:
        out = object.__new__(Moments)
        out.prefix, out.stats, out.count, out.sum = self.prefix, self.stats, self.count, self.sum
        out.mean, out.m2, out.min, out.max = self.mean, self.m2, self.min, self.max
        return out

    def finalize(self) -> dict[str, float]:
        """Returns the chosen statistics; an empty partial reports only its count."""
        prefix = f"{self.prefix}_" if self.prefix else ""
        n = self.count
        if not n:
            return {prefix + "count": n} if "count" in self.stats else {}
        var = max(self.m2, 0.0) / n
        known = (n, self.mean, math.sqrt(var), var, self.min, self.max)  # as MOMENT_STATS
        return {prefix + stat: known[_MOMENT_AT[stat]] for stat in self.stats}


class Count(Partial):
    """A count over a window: merges by addition, finalizes to ``{name: n}``.

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

    def __reduce__(self) -> tuple:
        return _count, (self.__class__, self.name, self.n)


def _moments(cls: type, prefix: str, stats: tuple, *fields: float) -> Moments:
    """Unpickles a :class:`Moments` (see its ``__reduce__``): every field as it was."""
    out = object.__new__(cls)
    out.prefix, out.stats = prefix, stats
    out.count, out.sum, out.mean, out.m2, out.min, out.max = fields
    return out


def _count(cls: type, name: str, n: float) -> Count:
    """Unpickles a :class:`Count` (see its ``__reduce__``)."""
    out = object.__new__(cls)
    out.name, out.n = name, n
    return out


#: Statistics a :class:`LatestWindow` partial can emit, in output order. ``pNN`` are
#: quantiles (``p50`` is ``median``), interpolated linearly between the closest values; any
#: other ``p<100 q>`` (``p5``, ``p99.9``) is accepted too.
WINDOW_STATS: tuple[str, ...] = (
    "count",
    "mean",
    "std",
    "min",
    "max",
    "p10",
    "p25",
    "median",
    "p75",
    "p90",
)


def _is_quantile_stat(stat: object) -> bool:
    """Whether ``stat`` names a quantile ``p<100 q>`` with ``q`` in (0, 1), such as ``p5``."""
    if not isinstance(stat, str) or not stat.startswith("p"):
        return False
    try:
        q = float(stat[1:]) / 100
    except ValueError:
        return False
    return 0.0 < q < 1.0 and stat == f"p{q * 100:g}"


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear interpolation (numpy's and torch's default)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


class LatestWindow(Partial):
    """The ``size`` latest entries of a stream (the last ``N`` episodes), merged by end order.

    Each entry is a unique order key (``(stamp, source, index)``: when it
    ended, on which worker, which env row) and one value per name. A merge
    keeps the ``size`` greatest keys of the union, an entry on both sides
    counting once, so a source may re-send its window. A state
    (:attr:`rolling`), kept by an owner from one row to the next.

    Args:
        size (int): how many entries to keep; names end with ``_last_<N>``.
        names (sequence of str): the name of each value of an entry.

    Keyword Args:
        stats (sequence of sequences of str, optional): per name, statistics
            among :data:`WINDOW_STATS`. Defaults to ``("mean",)`` for each.
        entries (iterable of (key, values), optional): initial entries.

    Examples:
        >>> from rl_observers.stats import LatestWindow
        >>> a = LatestWindow(3, ("episode_return",), stats=[("mean", "median")],
        ...                  entries=[((1, 0, 0), (1.0,)), ((4, 0, 0), (4.0,))])
        >>> b = LatestWindow(3, ("episode_return",), stats=[("mean", "median")],
        ...                  entries=[((2, 1, 0), (2.0,)), ((5, 1, 0), (6.0,))])
        >>> a.merge(b).finalize()  # the episodes ended at steps 2, 4 and 5
        {'episode_return_mean_last_3': 4.0, 'episode_return_median_last_3': 4.0}
        >>> a.merge(b).merge(a).finalize() == a.merge(b).finalize()  # re-sent windows count once
        True
    """

    __slots__ = ("size", "names", "stats", "entries")
    rolling = True

    def __init__(
        self,
        size: int,
        names: Sequence[str],
        *,
        stats: Sequence[Sequence[str]] | None = None,
        entries: Iterable[tuple[tuple, Sequence[float]]] = (),
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}.")
        if isinstance(names, str):
            raise TypeError(f"names must be a sequence of str, got {names!r}.")
        names = tuple(_check_name(name, "name") for name in names)
        if not names:
            raise ValueError("names must not be empty.")
        stats = (("mean",),) * len(names) if stats is None else tuple(tuple(s) for s in stats)
        if len(stats) != len(names):
            raise ValueError(f"stats must have one sequence per name, got {stats!r} for {names!r}.")
        for name, chosen in zip(names, stats):
            unknown = [s for s in chosen if s not in WINDOW_STATS and not _is_quantile_stat(s)]
            if unknown or not chosen or len(set(chosen)) != len(chosen):
                raise ValueError(
                    f"stats must be non-empty sequences of distinct names among {WINDOW_STATS} "
                    f"or 'p<100 q>' quantiles such as 'p5', got {chosen!r} (for {name!r})."
                )
        self.size = size
        self.names = names
        self.stats = stats
        kept: dict[tuple, tuple[float, ...]] = {}
        for key, values in entries:
            values = tuple(float(v) for v in values)
            if len(values) != len(names):
                raise ValueError(f"each entry needs one value per name {names!r}, got {values!r}.")
            kept[tuple(key)] = max(values, kept.get(tuple(key), values))
        self.entries = self._latest(kept)

    def _latest(self, kept: dict[tuple, tuple[float, ...]]) -> tuple:
        keys = sorted(kept)[-self.size :]
        return tuple((key, kept[key]) for key in keys)

    def merge(self, other: Partial) -> LatestWindow:
        """The ``size`` latest entries of the union of both operands' entries."""
        self._check_merge(other, "size", "names", "stats")
        kept = dict(self.entries)
        for key, values in other.entries:
            # (the same key with other values cannot come from one stream; the max keeps
            # the merge commutative anyway)
            kept[key] = max(values, kept.get(key, values))
        out = object.__new__(LatestWindow)
        out.size, out.names, out.stats = self.size, self.names, self.stats
        out.entries = self._latest(kept)
        return out

    def values(self, name: str) -> list[float]:
        """The values of ``name`` of the entries held, oldest first."""
        column = self.names.index(name)
        return [values[column] for _, values in self.entries]

    def finalize(self) -> dict[str, float]:
        """``<name>_<stat>_last_<size>`` per name and statistic; an empty window gives counts only."""
        out: dict[str, float] = {}
        n = len(self.entries)
        suffix = f"_last_{self.size}"
        for column, (name, chosen) in enumerate(zip(self.names, self.stats)):
            values = [entry[1][column] for entry in self.entries]
            mean = _total(values) / n if n else 0.0
            if mean != mean and any(v != v for v in values):
                ordered = [math.nan] * n  # NaN has no rank: min, max and quantiles are NaN
            else:
                ordered = sorted(values)
            for stat in chosen:
                label = f"{name}_{stat}{suffix}"
                if stat == "count":
                    out[label] = float(n)
                elif stat == "mean" and n:
                    out[label] = mean
                elif stat == "std" and n:
                    out[label] = math.sqrt(_total([(v - mean) * (v - mean) for v in values]) / n)
                elif stat in ("min", "max") and n:
                    out[label] = ordered[0] if stat == "min" else ordered[-1]
                elif n:
                    q = 0.5 if stat == "median" else float(stat[1:]) / 100
                    out[label] = _quantile(ordered, q)
        return out

    def __repr__(self) -> str:
        return f"LatestWindow({self.size!r}, {self.names!r}, entries={len(self.entries)})"


# -- quantile sketch --------------------------------------------------------------------

#: Magnitudes a :class:`QuantileSketch` buckets apart: ``[2**-64, 2**64)``. Smaller non-zero
#: magnitudes share the lowest bucket, larger finite ones the highest.
SKETCH_EXPONENTS: tuple[int, int] = (-64, 64)
_F32_BIAS = 127
_F32_MANTISSA = 23


def sketch_resolution(accuracy: object, owner: str = "QuantileSketch") -> int:
    """The fewest mantissa bits ``p`` whose buckets (relative width ``2**-p``) stay within ``accuracy``."""
    if (
        isinstance(accuracy, bool)
        or not isinstance(accuracy, (int, float))
        or not 0.0 < float(accuracy) < 0.5
    ):
        raise ValueError(f"{owner}: accuracy must be a number in (0, 0.5), got {accuracy!r}.")
    margin = 2.0**-_F32_MANTISSA  # the float32 rounding of a value, relative
    for p in range(_F32_MANTISSA - 4):
        width = 2.0**-p
        if width / (2.0 + width) * (1.0 + margin) + margin <= accuracy:
            return p
    raise ValueError(
        f"{owner}: accuracy must be at least {2.0 ** -(_F32_MANTISSA - 5):g} (float32 buckets), "
        f"got {accuracy!r}."
    )


def sketch_key_range(p: int) -> tuple[int, int]:
    """The lowest and one past the highest magnitude key of resolution ``p``."""
    low, high = SKETCH_EXPONENTS
    return (_F32_BIAS + low) << p, (_F32_BIAS + high) << p


def sketch_bucket_value(key: int, p: int) -> float:
    """The point reported for the magnitude bucket ``key``: ``2 L U / (L + U)``, as far (relatively) from either bound."""
    exponent, mantissa = divmod(key, 1 << p)
    low = math.ldexp(1.0 + mantissa * 2.0**-p, exponent - _F32_BIAS)
    high = math.ldexp(1.0 + (mantissa + 1) * 2.0**-p, exponent - _F32_BIAS)
    return 2.0 * low * high / (low + high)


def _collapse(store: dict[int, float], limit: int) -> dict[int, float]:
    """Keeps the ``limit`` highest keys; the counts of the others add to the lowest kept."""
    if len(store) <= limit:
        return store
    keys = sorted(store)
    cut = len(keys) - limit
    lowest = keys[cut]
    kept = {key: store[key] for key in keys[cut:]}
    kept[lowest] += math.fsum(store[key] for key in keys[:cut])
    return kept


class QuantileSketch(Partial):
    """Quantiles within a declared relative accuracy, from bucket counts that add (DDSketch).

    Values are counted in logarithmic buckets (float32 exponent and leading
    mantissa bits) per sign; a merge adds the counts. The quantile ``q`` is
    ``numpy.quantile(..., method="lower")``, within ``accuracy`` relatively.
    Past ``max_buckets`` per sign the smallest magnitudes collapse into the
    lowest bucket kept. Non-finite values count apart (``<name>_nonfinite``).
    See :doc:`custom`.

    Args:
        name (str): output names are ``<name>_p5``, ``<name>_p50``, ...

    Keyword Args:
        quantiles (sequence of float, optional): each in (0, 1). Defaults to
            ``(0.05, 0.5, 0.95)``.
        accuracy (float, optional): relative, in (0, 0.5). Defaults to ``0.01``.
        max_buckets (int, optional): the most buckets per sign. Defaults to
            ``2048``.
        positive, negative (dict of int to float, optional): counts per
            magnitude key. Defaults to none.
        zero, nonfinite (float, optional): counts of zeros and of NaN or
            infinite values. Defaults to ``0``.

    Raises:
        ValueError: a quantile outside (0, 1), an accuracy outside (0, 0.5).

    Examples:
        >>> from rl_observers.stats import QuantileSketch
        >>> a = QuantileSketch.from_values("ret", [1.0, 2.0, 3.0, 4.0], quantiles=(0.5,))
        >>> b = QuantileSketch.from_values("ret", [5.0, 6.0, 7.0, float("nan")], quantiles=(0.5,))
        >>> merged = a.merge(b)  # the lower median of 1..7 is 4: reported within 1 %
        >>> round(merged.quantile(0.5), 3), merged.nonfinite
        (4.031, 1.0)
        >>> sorted(merged.finalize())
        ['ret_nonfinite', 'ret_p50']
        >>> a.merge(b).finalize() == b.merge(a).finalize()
        True
    """

    __slots__ = (
        "name",
        "quantiles",
        "accuracy",
        "max_buckets",
        "p",
        "positive",
        "negative",
        "zero",
        "nonfinite",
    )

    def __init__(
        self,
        name: str,
        *,
        quantiles: Sequence[float] = (0.05, 0.5, 0.95),
        accuracy: float = 0.01,
        max_buckets: int = 2048,
        positive: dict[int, float] | None = None,
        negative: dict[int, float] | None = None,
        zero: float = 0.0,
        nonfinite: float = 0.0,
    ) -> None:
        self.name = _check_name(name, "name")
        owner = f"QuantileSketch({name!r})"
        if isinstance(quantiles, (str, float, int)):
            raise TypeError(f"{owner}: quantiles must be a sequence of numbers, got {quantiles!r}.")
        for q in (quantiles := tuple(quantiles)):  # (an iterator is read once)
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < float(q) < 1.0:
                raise ValueError(f"{owner}: each quantile must be a number in (0, 1), got {q!r}.")
        self.quantiles = tuple(map(float, quantiles))
        if not self.quantiles:
            raise ValueError(f"{owner}: quantiles must not be empty.")
        self.p = sketch_resolution(accuracy, owner)
        self.accuracy = float(accuracy)
        if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
            raise ValueError(f"{owner}: max_buckets must be a positive int, got {max_buckets!r}.")
        self.max_buckets = max_buckets
        self.positive, self.negative = (
            _collapse({int(k): float(c) for k, c in (side or {}).items() if c}, max_buckets)
            for side in (positive, negative)
        )
        self.zero = float(zero)
        self.nonfinite = float(nonfinite)

    @classmethod
    def from_values(
        cls,
        name: str,
        values: Iterable[float],
        *,
        quantiles: Sequence[float] = (0.05, 0.5, 0.95),
        accuracy: float = 0.01,
        max_buckets: int = 2048,
    ) -> QuantileSketch:
        """The sketch of ``values``, built on the host (the buckets the device fold uses)."""
        import numpy as np  # (numpy comes with torch; imported here to keep this module light)

        out = cls(name, quantiles=quantiles, accuracy=accuracy, max_buckets=max_buckets)
        values = values if hasattr(values, "__array__") else list(values)
        x = np.asarray(values, dtype=np.float64)
        if not x.size:
            return out
        with np.errstate(over="ignore", invalid="ignore"):
            bits = x.reshape(-1).astype(np.float32).view(np.int32)
        p = out.p
        magnitude = (bits & 0x7FFFFFFF) >> (_F32_MANTISSA - p)
        low, high = sketch_key_range(p)
        finite = magnitude < (255 << p)
        zero = magnitude == 0
        keys = np.clip(magnitude, low, high - 1)
        positive = finite & ~zero & (bits > 0)
        negative = finite & ~zero & (bits < 0)
        for store, chosen in ((out.positive, positive), (out.negative, negative)):
            found, counts = np.unique(keys[chosen], return_counts=True)
            store.update(zip(found.tolist(), map(float, counts.tolist())))
        out.positive = _collapse(out.positive, max_buckets)
        out.negative = _collapse(out.negative, max_buckets)
        out.zero = float(np.count_nonzero(zero))
        out.nonfinite = float(np.count_nonzero(~finite))
        return out

    @property
    def count(self) -> float:
        """How many finite values the sketch holds."""
        return math.fsum(self.positive.values()) + math.fsum(self.negative.values()) + self.zero

    def merge(self, other: Partial) -> QuantileSketch:
        """The sketch of the union of both operands' values: counts add, bucket by bucket."""
        self._check_merge(other, "name", "quantiles", "accuracy", "max_buckets")
        out = object.__new__(QuantileSketch)
        out.name, out.quantiles, out.accuracy = self.name, self.quantiles, self.accuracy
        out.max_buckets, out.p = self.max_buckets, self.p
        for side in ("positive", "negative"):
            mine, theirs = getattr(self, side), getattr(other, side)
            if len(theirs) > len(mine):
                mine, theirs = theirs, mine
            union = dict(mine)
            for key, c in theirs.items():
                union[key] = union.get(key, 0.0) + c
            setattr(out, side, _collapse(union, self.max_buckets))
        out.zero = self.zero + other.zero
        out.nonfinite = self.nonfinite + other.nonfinite
        return out

    def quantile(self, q: float) -> float:
        """The reported lower ``q`` quantile (NaN when the sketch holds no finite value)."""
        n = self.count
        if not n:
            return math.nan
        rank = math.floor(q * (n - 1))  # 0-based, what numpy's method="lower" takes
        seen = 0.0
        for key in sorted(self.negative, reverse=True):  # the most negative first
            seen += self.negative[key]
            if seen > rank:
                return -sketch_bucket_value(key, self.p)
        seen += self.zero
        if seen > rank:
            return 0.0
        for key in sorted(self.positive):
            seen += self.positive[key]
            if seen > rank:
                return sketch_bucket_value(key, self.p)
        return sketch_bucket_value(max(self.positive), self.p) if self.positive else 0.0

    def finalize(self) -> dict[str, float]:
        """``<name>_p<100 q>`` per quantile (none when empty), ``<name>_nonfinite`` when any."""
        out: dict[str, float] = {}
        if self.count:
            for q in self.quantiles:
                out[f"{self.name}_p{q * 100:g}"] = self.quantile(q)
        if self.nonfinite:
            out[f"{self.name}_nonfinite"] = self.nonfinite
        return out

    def metric_names(self) -> tuple[str, ...]:
        """Every name :meth:`finalize` may report."""
        return (*(f"{self.name}_p{q * 100:g}" for q in self.quantiles), f"{self.name}_nonfinite")

    def __repr__(self) -> str:
        return (
            f"QuantileSketch({self.name!r}, quantiles={self.quantiles!r}, accuracy={self.accuracy!r}, "
            f"count={self.count!r}, buckets={len(self.positive) + len(self.negative)})"
        )
