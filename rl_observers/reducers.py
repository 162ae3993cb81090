"""Mergeable partial statistics.

A statistic lives in two places:

* **On the data's device**, while batches stream by. A :class:`ReducerBank`
  owns one preallocated ``float64`` tensor that holds the window state of all
  its reducers. A :class:`MomentsReducer` or :class:`CountReducer` folds a
  tensor into its slice of that tensor in place, with tensor operations only:
  no ``.item()``, no ``bool(tensor)``, no data-dependent shapes, so folding
  never waits for the device. :meth:`ReducerBank.pull` moves the whole state
  to the host in **one** transfer, turns it into partials and resets the
  window.
* **On the host**, as :class:`Partial` objects (:class:`Moments`,
  :class:`Count`): small, picklable, and mergeable. Any merge of partials,
  in any grouping and any order, equals the statistic over the union of the
  data (up to floating-point rounding), so partials can cross process
  boundaries and be combined by code that knows nothing about RL. The empty
  partial is the identity of :meth:`Partial.merge`.

Examples:
    >>> import torch
    >>> from rl_observers.reducers import ReducerBank
    >>> bank = ReducerBank()
    >>> reward = bank.moments("reward")
    >>> dones = bank.count("dones")
    >>> reward.fold(torch.tensor([1.0, 2.0, 3.0]))
    >>> dones.fold_true(torch.tensor([False, True, False]))
    >>> worker_a = bank.pull()  # one device->host transfer, window reset
    >>> reward.fold(torch.tensor([4.0, 5.0]))
    >>> worker_b = bank.pull()
    >>> merged = worker_a["reward"].merge(worker_b["reward"])
    >>> merged.finalize()["reward_mean"]
    3.0
    >>> worker_a["dones"].merge(worker_b["dones"]).finalize()
    {'dones': 1.0}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

__all__ = [
    "Count",
    "CountReducer",
    "MOMENT_STATS",
    "Moments",
    "MomentsReducer",
    "Partial",
    "ReducerBank",
]

_R = TypeVar("_R", bound="_Reducer")

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
        >>> from rl_observers.reducers import Count, Partial
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
        >>> from rl_observers.reducers import Moments
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
            >>> from rl_observers.reducers import Moments
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
        n = na + nb
        delta = other.mean - self.mean
        # Symmetric in (self, other), so the merge is exactly commutative.
        mean = (na * self.mean + nb * other.mean) / n
        m2 = self.m2 + other.m2 + delta * delta * (na * nb / n)
        return Moments(
            self.prefix,
            stats=self.stats,
            count=n,
            mean=mean,
            m2=m2,
            min=min(self.min, other.min),
            max=max(self.max, other.max),
        )

    def _copy(self) -> Moments:
        return Moments(
            self.prefix,
            stats=self.stats,
            count=self.count,
            mean=self.mean,
            m2=self.m2,
            min=self.min,
            max=self.max,
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
        >>> from rl_observers.reducers import Count
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


class _Reducer:
    """A reducer owns ``width`` consecutive slots of its bank's state tensor."""

    __slots__ = ("_bank", "_offset", "key")
    width = 0

    def __init__(self, bank: ReducerBank, offset: int, key: str) -> None:
        self._bank = bank
        self._offset = offset
        self.key = key

    def _partial(self, values: Sequence[float]) -> Partial:
        raise NotImplementedError

    def _empty(self) -> Partial:
        raise NotImplementedError

    def _reset(self) -> None:
        """Host-side bookkeeping of a window reset (the bank zeroes the state)."""

    def _state(self, device: torch.device) -> torch.Tensor:
        return self._bank._state_on(device).narrow(0, self._offset, self.width)


def _as_f64(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if x.dtype is torch.float64 and x.device == device:
        return x
    return x.to(device, torch.float64)


class MomentsReducer(_Reducer):
    """Folds tensors into count, mean, M2, min and max on their device.

    Created by :meth:`ReducerBank.moments`; pulled as a :class:`Moments`.
    Values are accumulated in ``float64`` whatever their dtype.

    Each fold writes the statistics of its tensor (count, mean, M2, min, max:
    a handful of reductions, no combination with the window) into the next of
    ``rows`` rows of the bank's state. When the rows are used up, they are
    combined on the device into the first row (Chan's parallel formulas,
    vectorised over the rows), so the cost of combining is paid once every
    ``rows`` folds. At pull time the used rows reach the host with the rest
    of the bank and are merged there.

    Examples:
        >>> import torch
        >>> from rl_observers.reducers import ReducerBank
        >>> bank = ReducerBank()
        >>> rewards = bank.moments("reward", stats=("count", "mean", "max"))
        >>> rewards.fold(torch.tensor([[1.0], [2.0], [9.0]]), mask=torch.tensor([[True], [True], [False]]))
        >>> bank.pull()["reward"].finalize()
        {'reward_count': 2.0, 'reward_mean': 1.5, 'reward_max': 2.0}
    """

    __slots__ = ("prefix", "stats", "rows", "_used")

    def __init__(
        self, bank: ReducerBank, offset: int, prefix: str, stats: Sequence[str], rows: int
    ) -> None:
        super().__init__(bank, offset, prefix)
        if not isinstance(rows, int) or rows < 2:
            raise ValueError(f"rows must be an int >= 2, got {rows!r} (for {prefix!r}).")
        self.prefix = prefix
        self.stats = _check_stats(stats, prefix)
        self.rows = rows
        self._used = 0

    @property
    def width(self) -> int:  # type: ignore[override]
        return 5 * self.rows  # rows of (count, mean, m2, min, max)

    def _empty(self) -> Moments:
        return Moments(self.prefix, stats=self.stats)

    def _reset(self) -> None:
        self._used = 0

    def _partial(self, values: Sequence[float]) -> Moments:
        out = self._empty()
        for i in range(0, 5 * self._used, 5):
            count, mean, m2, lo, hi = values[i : i + 5]
            if count:
                row = Moments(
                    self.prefix, stats=self.stats, count=count, mean=mean, m2=m2, min=lo, max=hi
                )
                out = out.merge(row)
        return out

    def _compact(self, table: torch.Tensor) -> None:
        """Combines every row into the first one, on the device."""
        n_i, mean_i, m2_i, lo_i, hi_i = table.unbind(1)
        n = n_i.sum()
        mean = n_i.dot(mean_i) / n.clamp(min=1.0)
        spread = mean_i - mean
        m2 = m2_i.sum() + n_i.dot(spread * spread)
        torch.stack((n, mean, m2, lo_i.amin(), hi_i.amax()), out=table[0])
        self._used = 1

    def fold(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Folds ``values`` (those where ``mask`` is true) into the window.

        Args:
            values (torch.Tensor): any shape and real dtype.
            mask (torch.Tensor, optional): boolean, broadcastable to
                ``values``; only entries where it is ``True`` count.
                Defaults to ``None`` (all entries count).

        Never reads a value on the host: the count of masked entries stays a
        tensor.
        """
        if values.numel() == 0:
            return
        table = self._state(values.device).view(self.rows, 5)
        if self._used == self.rows:
            self._compact(table)
        row = table[self._used]
        x = values.detach()
        if mask is None:
            x = _as_f64(x.reshape(-1), table.device)
            var, mean = torch.var_mean(x, correction=0)
            lo, hi = torch.aminmax(x)
            row[0].fill_(x.numel())
            torch.stack((mean, var * x.numel(), lo, hi), out=row[1:])
        else:
            mask = mask.detach()
            if mask.shape != x.shape:
                x, mask = torch.broadcast_tensors(x, mask)
            x = _as_f64(x.reshape(-1), table.device)
            mask = mask.reshape(-1)
            if mask.dtype is not torch.bool or mask.device != table.device:
                mask = mask.to(table.device, torch.bool)
            n = mask.sum(dtype=torch.float64)
            mean = torch.where(mask, x, 0.0).sum() / n.clamp(min=1.0)
            dev = torch.where(mask, x - mean, 0.0)
            lo = torch.where(mask, x, math.inf).amin()
            hi = torch.where(mask, x, -math.inf).amax()
            torch.stack((n, mean, dev.dot(dev), lo, hi), out=row)
        self._used += 1


class CountReducer(_Reducer):
    """Counts events on the device; pulled as a :class:`Count`.

    Created by :meth:`ReducerBank.count`.

    Examples:
        >>> import torch
        >>> from rl_observers.reducers import ReducerBank
        >>> bank = ReducerBank()
        >>> episodes = bank.count("episodes")
        >>> episodes.fold_true(torch.tensor([True, False, True]))
        >>> episodes.add(1)
        >>> bank.pull()["episodes"].finalize()
        {'episodes': 3.0}
    """

    __slots__ = ("name",)
    width = 1

    def __init__(self, bank: ReducerBank, offset: int, name: str) -> None:
        super().__init__(bank, offset, name)
        self.name = name

    def _empty(self) -> Count:
        return Count(self.name)

    def _partial(self, values: Sequence[float]) -> Count:
        return Count(self.name, values[0])

    def add(self, amount: torch.Tensor | float, *, device: torch.device | None = None) -> None:
        """Adds ``amount`` (a number or a one-element tensor) to the window count.

        Args:
            amount: what to add. A tensor stays on its device.

        Keyword Args:
            device (torch.device, optional): where to allocate the bank's
                state if this is its first fold and ``amount`` is a number.
                Defaults to the bank's device, or CPU.
        """
        if isinstance(amount, torch.Tensor):
            state = self._state(amount.device)
            if amount.device != state.device:
                amount = amount.to(state.device)
            state.add_(amount.detach().reshape(()))
        else:
            self._state(device or self._bank.device or torch.device("cpu")).add_(amount)

    def fold_true(self, flags: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Counts the true entries of ``flags`` (where ``mask`` is true)."""
        if flags.numel() == 0:
            return
        flags = flags.detach()
        if flags.dtype is not torch.bool:
            flags = flags.to(torch.bool)
        if mask is not None:
            flags = flags & mask.detach().to(flags.device, torch.bool)
        self.add(flags.sum())


class ReducerBank:
    """Holds the window state of several reducers in one ``float64`` tensor.

    Register reducers first (:meth:`moments`, :meth:`count`); the state tensor
    is allocated on the device of the first tensor folded, and a tensor on
    another device is moved to it. :meth:`pull` copies the whole state to the
    host in one transfer, resets the window and returns one partial per
    reducer, keyed by :attr:`~MomentsReducer.prefix` or :attr:`~CountReducer.name`.

    Examples:
        >>> import torch
        >>> from rl_observers.reducers import ReducerBank
        >>> bank = ReducerBank()
        >>> lengths = bank.moments("episode_length", stats=("mean", "max"))
        >>> lengths.fold(torch.tensor([3, 5]))
        >>> bank.pull()
        {'episode_length': Moments('episode_length', count=2.0, mean=4.0, m2=2.0, min=3.0, max=5.0)}
        >>> bank.pull()["episode_length"].finalize()  # the window was reset
        {}
    """

    __slots__ = ("_reducers", "_width", "_state")

    def __init__(self) -> None:
        self._reducers: list[_Reducer] = []
        self._width = 0
        self._state: torch.Tensor | None = None

    @property
    def device(self) -> torch.device | None:
        """The device of the state tensor, ``None`` before the first fold."""
        return None if self._state is None else self._state.device

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys :meth:`pull` returns, in registration order."""
        return tuple(r.key for r in self._reducers)

    def moments(
        self, prefix: str, *, stats: Sequence[str] = _DEFAULT_MOMENT_STATS, rows: int = 32
    ) -> MomentsReducer:
        """Registers a :class:`MomentsReducer` pulled as ``Moments(prefix, stats=stats)``.

        ``rows`` is how many folds it keeps apart before combining them on the
        device (more rows: fewer combinations, a larger state to transfer).
        """
        prefix = _check_name(prefix, "prefix")
        return self._register(MomentsReducer(self, self._width, prefix, stats, rows))

    def count(self, name: str) -> CountReducer:
        """Registers a :class:`CountReducer` pulled as ``Count(name)``."""
        return self._register(CountReducer(self, self._width, _check_name(name, "name")))

    def _register(self, reducer: _R) -> _R:
        if self._state is not None:
            raise RuntimeError("reducers must be registered before the bank's first fold.")
        if reducer.key in self.keys:
            raise ValueError(f"a reducer with key {reducer.key!r} is already registered.")
        self._reducers.append(reducer)
        self._width += reducer.width
        return reducer

    def _state_on(self, device: torch.device) -> torch.Tensor:
        state = self._state
        if state is None:
            # Zeros need no host-to-device copy (no sync).
            state = self._state = torch.zeros(self._width, dtype=torch.float64, device=device)
        return state

    def empty(self) -> dict[str, Partial]:
        """Returns the empty partial of every reducer (no transfer, no reset)."""
        return {r.key: r._empty() for r in self._reducers}

    def pull(self) -> dict[str, Partial]:
        """Closes the window: one device-to-host transfer, then a reset on the device."""
        state = self._state
        if state is None:
            return self.empty()
        values = state.tolist()  # the one transfer (and sync) of a window
        out = {r.key: r._partial(values[r._offset : r._offset + r.width]) for r in self._reducers}
        self.reset()
        return out

    def reset(self) -> None:
        """Drops the current window without reading it."""
        if self._state is not None:
            self._state.zero_()
        for reducer in self._reducers:
            reducer._reset()
