"""Device reducers: fold tensors into mergeable partials without waiting for the device.

A :class:`ReducerBank` keeps its reducers' window state in one ``float64``
tensor on the data's device, folded with no host read;
:meth:`ReducerBank.pull` moves it to the host in one transfer as
:class:`Partial` objects. See :ref:`partials`.

Examples:
    >>> import torch
    >>> from rl_observers.stats import ReducerBank
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

import functools
import math
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from rl_observers.stats.partials import (
    _DEFAULT_MOMENT_STATS,
    Count,
    Moments,
    Partial,
    QuantileSketch,
    _chan,
    _check_name,
    _check_stats,
    _max,
    _min,
    sketch_key_range,
)

__all__ = [
    "CountReducer",
    "MomentsGroupReducer",
    "MomentsReducer",
    "QuantileReducer",
    "ReducerBank",
    "WindowCopy",
]

_R = TypeVar("_R", bound="_Reducer")


class Transient:
    """Pickles its attributes but the ``_transient`` ones (rebuilt on demand), which come back ``None``.

    :meth:`_flush` runs first, so folds still staged reach the pickled state.
    """

    __slots__ = ()
    _transient: tuple[str, ...] = ()

    def _flush(self) -> None:
        """Reduces folds still staged into the state (see :class:`MomentsReducer`)."""

    def __getstate__(self) -> dict[str, Any]:
        self._flush()
        state = dict(getattr(self, "__dict__", ()))
        for cls in type(self).__mro__:
            for name in cls.__dict__.get("__slots__", ()):
                if hasattr(self, name):
                    state[name] = getattr(self, name)
        state.update(dict.fromkeys(self._transient))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)


class _Reducer(Transient):
    """A reducer owns ``width`` consecutive slots of its bank's state tensor, viewed from its first fold."""

    __slots__ = ("_bank", "_offset", "key", "_view")
    _transient: tuple[str, ...] = ("_view",)
    width = 0

    def __init__(self, bank: ReducerBank, offset: int, key: str) -> None:
        self._bank = bank
        self._offset = offset
        self.key = key
        self._view: torch.Tensor | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of the partials this reducer is pulled as."""
        return (self.key,)

    def _partials(self, values: Sequence[float]) -> dict[str, Partial]:
        """The partials of this reducer's slots of ``values`` (the bank's whole state; zeros: empty)."""
        raise NotImplementedError

    def _reset(self) -> None:
        """Host-side bookkeeping of a window reset (the bank zeroes the state)."""

    def _state(self, device: torch.device) -> torch.Tensor:
        view = self._view
        if view is None:
            view = self._bank._state_on(device).narrow(0, self._offset, self.width)
            self._view = view
            self._made_view(view)
        return view

    def _made_view(self, view: torch.Tensor) -> None:
        """Derives further cached views from the state's (see :meth:`_state`)."""

    def _window_partials(self) -> Any:
        """A function of the copied state giving this window's partials (see :class:`WindowCopy`)."""
        return self._partials


_F64 = torch.float64
_BOOL = torch.bool
# Small folds are staged: copied into a buffer and reduced _STAGE_FOLDS at a time (one copy
# instead of a dozen operations); folds of more than _STAGE_ENTRIES values are reduced at once.
_STAGE_FOLDS = 16
_STAGE_ENTRIES = 2048
# Masked CPU folds skip the mask when all entries count, select them when few do (tests turn
# this off to check the device path).
_CPU_MASK_SHORTCUTS = True
# Large CPU folds convert into a per-thread float64 buffer (up to 2 MiB) reused from fold to
# fold: fresh temporaries of this size page-fault, which costs more than the reductions.
_SCRATCH_ENTRIES = 2**18
_SCRATCH = threading.local()


def _complex(owner: str, values: torch.Tensor) -> TypeError:
    return TypeError(
        f"{owner}: cannot fold complex values ({values.dtype}), which a float64 fold would cut "
        "to their real part; fold real ones, such as values.abs() or values.real."
    )


def _cpu_scratch(like: torch.Tensor) -> torch.Tensor:
    """A float64 CPU buffer shaped like ``like``, one per thread."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None:
        buffer = _SCRATCH.buffer = torch.empty(0, dtype=_F64)
    n = like.numel()
    if buffer.numel() < n:
        size = min(max(n, 2 * buffer.numel()), _SCRATCH_ENTRIES)
        buffer = _SCRATCH.buffer = torch.empty(size, dtype=_F64)
    return buffer[:n].view(like.shape)


class MomentsReducer(_Reducer):
    """Folds tensors into count, sum, M2, min and max on their device; pulled as a :class:`Moments`.

    Created by :meth:`ReducerBank.moments`. Accumulates in ``float64``; M2 is
    kept only when ``std`` or ``var`` is among ``stats``. The state is a
    ``[rows, K, 5]`` table (``K`` quantities, one here), one row per fold:
    full tables combine on the device into the first row (Chan), rows merge
    on the host at pull time. Rows hold sums, so integer sums stay exact.

    Examples:
        >>> import torch
        >>> from rl_observers.stats import ReducerBank
        >>> bank = ReducerBank()
        >>> rewards = bank.moments("reward", stats=("count", "mean", "max"))
        >>> rewards.fold(torch.tensor([[1.0], [2.0], [9.0]]), mask=torch.tensor([[True], [True], [False]]))
        >>> bank.pull()["reward"].finalize()
        {'reward_count': 2.0, 'reward_mean': 1.5, 'reward_max': 2.0}
    """

    __slots__ = (
        "prefixes",
        "stats_of",
        "rows",
        "_used",
        "_row_views",
        "_stage",
        "_stage_mask",
        "_stage_slots",
        "_mask_slots",
        "_stage_n",
        "_staged",
        "_spread",
    )
    _transient = ("_view", "_row_views", "_stage", "_stage_mask", "_stage_slots", "_mask_slots")

    def __init__(
        self,
        bank: ReducerBank,
        offset: int,
        specs: Sequence[tuple[str, Sequence[str]]],
        rows: int,
    ) -> None:
        self.prefixes = tuple(_check_name(prefix, "prefix") for prefix, _ in specs)
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 2:
            raise ValueError(f"rows must be an int >= 2, got {rows!r} (for {specs[0][0]!r}).")
        super().__init__(bank, offset, self.prefixes[0])
        self.stats_of = tuple(_check_stats(stats, prefix) for prefix, stats in specs)
        # M2 is computed only for std or var
        self._spread = any(stat in ("std", "var") for stats in self.stats_of for stat in stats)
        self.rows = rows
        self._used = 0
        self._row_views: list[tuple[torch.Tensor, ...]] | None = None
        self._stage: torch.Tensor | None = None  # [K, folds, N] float64
        self._stage_mask: torch.Tensor | None = None  # [folds, N] bool, for masked folds
        # each fold's place in the stage (and its mask): a view per fold costs more than the copy
        self._stage_slots: tuple[torch.Tensor, ...] | None = None
        self._mask_slots: tuple[torch.Tensor, ...] | None = None
        self._stage_n = 0  # N of the staged folds
        self._staged = 0

    @property
    def width(self) -> int:  # type: ignore[override]
        return 5 * self.rows * len(self.prefixes)  # rows of K x (count, sum, m2, min, max)

    @property
    def keys(self) -> tuple[str, ...]:
        return self.prefixes

    def _made_view(self, view: torch.Tensor) -> None:
        # each row and its columns, made once: an unmasked fold writes into the columns
        table = view.view(self.rows, len(self.prefixes), 5)
        self._row_views = [(row, *row.unbind(-1)) for row in table.unbind(0)]

    def _reset(self) -> None:
        self._used = 0
        self._staged = 0

    def _window_partials(self) -> Any:
        # The rows used by this window, fixed now: the window's reset zeroes ``_used``.
        return functools.partial(self._partials, used=self._used)

    def _partials(self, values: Sequence[float], used: int | None = None) -> dict[str, Partial]:
        out: dict[str, Partial] = {}
        channels = len(self.prefixes)
        spread = self._spread
        for k, (prefix, stats) in enumerate(zip(self.prefixes, self.stats_of)):
            n, total, m2, lo, hi = 0.0, 0.0, 0.0, math.inf, -math.inf
            for i in range(self._used if used is None else used):
                j = self._offset + 5 * (i * channels + k)
                count = values[j]
                if not count:
                    continue
                if n:
                    row_total = values[j + 1]
                    if spread:
                        m2 = _chan(n, total / n, m2, count, row_total / count, values[j + 2])
                    n, total = n + count, total + row_total
                    lo = _min(lo, values[j + 3])
                    hi = _max(hi, values[j + 4])
                else:
                    n, total, m2, lo, hi = values[j : j + 5]
            # With no count, these are still the empty partial's values.
            out[prefix] = Moments._trusted(prefix, stats, n, total, m2, lo, hi)
        return out

    def _compact(self) -> None:
        """Combines every row into the first one, on the device."""
        table = self._view.view(self.rows, len(self.prefixes), 5)  # type: ignore[union-attr]
        n_i, total_i, m2_i, lo_i, hi_i = table.unbind(-1)  # each [rows, K]
        n = n_i.sum(0)
        total = total_i.sum(0)
        m2 = m2_i.sum(0)
        if self._spread:
            spread = total_i / n_i.clamp(min=1.0) - (total / n.clamp(min=1.0))
            m2 = m2 + (n_i * spread * spread).sum(0)
        torch.stack((n, total, m2, lo_i.amin(0), hi_i.amax(0)), -1, out=table[0])
        self._used = 1

    def _fold_rows(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Folds each row of ``x`` (``[K, N]``, ``N > 0``) into its quantity; a small fold is staged."""
        view = self._view
        if view is None:
            view = self._state(x.device)
        slots = self._stage_slots
        n = x.shape[-1]
        if slots is not None:
            if self._stage_n == n and (mask is None) is (self._mask_slots is None):
                slot = self._staged
                slots[slot].copy_(x)
                if mask is not None:
                    self._mask_slots[slot].copy_(mask)  # type: ignore[index]
                slot += 1
                self._staged = slot
                if slot == len(slots):
                    self._flush()
                return
        if x.shape[0] * n > _STAGE_ENTRIES:  # reduced at once: a stage stays for small folds
            self._reduce(x, mask)
            return
        self._flush()  # a new stage, for folds of this size
        device, folds = view.device, _STAGE_FOLDS
        self._stage = torch.empty((x.shape[0], folds, n), dtype=_F64, device=device)
        self._stage_slots = self._stage.unbind(1)
        self._stage_n = n
        self._stage_mask = self._mask_slots = None
        if mask is not None:
            self._stage_mask = torch.empty((folds, n), dtype=_BOOL, device=device)
            self._mask_slots = self._stage_mask.unbind(0)
        self._fold_rows(x, mask)

    def _flush(self) -> None:
        staged = self._staged
        if not staged:
            return
        self._staged = 0
        stage = self._stage
        x = stage[:, :staged].reshape(stage.shape[0], -1)  # type: ignore[index]
        mask = self._stage_mask
        self._reduce(x, None if mask is None else mask[:staged].reshape(-1))

    def _reduce(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Writes the statistics of each row of ``x`` into the next row, with no host read off the CPU."""
        view = self._view
        device = (self._state(x.device) if view is None else view).device
        scratch = device.type == "cpu" and _STAGE_ENTRIES < x.numel() <= _SCRATCH_ENTRIES
        if x.dtype is not _F64 or x.device != device:
            x = _cpu_scratch(x).copy_(x) if scratch and x.is_cpu else x.to(device, _F64)
        if mask is not None and (mask.dtype is not _BOOL or mask.device != device):
            mask = mask.to(device, _BOOL)
        if mask is not None and device.type == "cpu" and _CPU_MASK_SHORTCUTS:
            # On the CPU, reading the mask waits for no device: keep only the entries that count
            # when they are few (or all), which is exact and spares passes over the others.
            kept = int(torch.count_nonzero(mask))
            if not kept:
                return
            if kept == mask.shape[-1]:
                mask = None
            elif 4 * kept <= mask.shape[-1]:
                x = x[:, mask]
                mask = None
        if self._used == self.rows:
            self._compact()
        row, *columns = self._row_views[self._used]  # type: ignore[index]
        if mask is None:
            count, total, m2, lo, hi = columns
            # ``[K, *S]`` values (unmasked folds of any layout, without a copy to ``[K, N]``),
            # each statistic written into its column (no temporaries, no stack).
            dims = -1 if x.ndim == 2 else tuple(range(1, x.ndim))
            n = x.numel() // x.shape[0]
            count.fill_(n)
            torch.sum(x, dims, out=total)
            if self._spread:  # (var: one pass, no deviations kept, fewer calls than centring)
                torch.var(x, dims, correction=0, out=m2).mul_(n)
            else:
                m2.zero_()
            torch.amin(x, dims, out=lo)
            torch.amax(x, dims, out=hi)
        else:
            n = mask.sum(-1, dtype=_F64)
            total = torch.where(mask, x, 0.0).sum(-1)
            if self._spread:
                mean = total / n.clamp(min=1.0)
                dev = torch.where(mask, x - mean.unsqueeze(-1), 0.0)
                m2 = torch.linalg.vecdot(dev, dev)
            else:
                m2 = torch.zeros_like(total)
            lo = torch.where(mask, x, math.inf).amin(-1)
            hi = torch.where(mask, x, -math.inf).amax(-1)
            torch.stack((n.expand_as(total), total, m2, lo, hi), -1, out=row)
        self._used += 1

    def fold(
        self, values: torch.Tensor, mask: torch.Tensor | None = None, *, staged: bool = True
    ) -> None:
        """Folds ``values`` (those where ``mask`` is true) into the window, with no host read.

        Args:
            values (torch.Tensor): any shape and real dtype (not complex: TypeError).
            mask (torch.Tensor, optional): boolean, broadcastable to ``values``.
                Defaults to ``None`` (all entries count).

        Keyword Args:
            staged (bool, optional): stage small folds; pass ``False`` when the
                size changes from fold to fold. Defaults to ``True``.
        """
        if values.is_complex():
            raise _complex(f"MomentsReducer({self.prefixes[0]!r})", values)
        if values.numel() == 0:
            return
        if values.requires_grad:
            values = values.detach()
        if mask is not None:
            if mask.shape != values.shape:
                values, mask = torch.broadcast_tensors(values, mask)
            mask = mask.reshape(-1)
        if staged:
            self._fold_rows(values.reshape(1, -1), mask)
            return
        # Unmasked, reduced in its own layout (a view of one row: no copy).
        flat = mask is not None or values.ndim < 2
        self._reduce(values.reshape(1, -1) if flat else values.unsqueeze(0), mask)


class MomentsGroupReducer(MomentsReducer):
    """Folds ``K`` quantities sharing a mask at once, for about the cost of one; pulled as ``K`` :class:`Moments`.

    Created by :meth:`ReducerBank.moments_group`.

    Examples:
        >>> import torch
        >>> from rl_observers.stats import ReducerBank
        >>> bank = ReducerBank()
        >>> episodes = bank.moments_group(
        ...     [("episode_return", ("mean", "max")), ("episode_length", ("mean",))]
        ... )
        >>> returns_and_lengths = torch.tensor([[1.0, 5.0, 3.0], [10.0, 20.0, 30.0]])
        >>> episodes.fold(returns_and_lengths, mask=torch.tensor([True, True, False]))
        >>> pulled = bank.pull()
        >>> pulled["episode_return"].finalize(), pulled["episode_length"].finalize()
        ({'episode_return_mean': 3.0, 'episode_return_max': 5.0}, {'episode_length_mean': 15.0})
    """

    __slots__ = ()

    def fold(
        self, values: torch.Tensor, mask: torch.Tensor | None = None, *, staged: bool = True
    ) -> None:
        """Folds ``values[k]`` into the ``k``-th quantity (entries where ``mask`` is true).

        Args:
            values (torch.Tensor): ``[K, *S]``, any real dtype.
            mask (torch.Tensor, optional): boolean, broadcastable to ``S``.

        Keyword Args:
            staged (bool, optional): as for :meth:`MomentsReducer.fold`.
        """
        if values.is_complex():
            raise _complex(f"MomentsGroupReducer({self.prefixes!r})", values)
        channels = len(self.prefixes)
        if values.ndim == 0 or values.shape[0] != channels:
            raise ValueError(
                f"{type(self).__name__} of {self.prefixes!r} expects values of shape "
                f"[{channels}, ...], got {list(values.shape)}."
            )
        if values.numel() == 0:
            return
        if values.requires_grad:
            values = values.detach()
        if mask is not None:
            shape = values.shape[1:]
            if mask.shape != shape:
                mask = mask.expand(shape)
            mask = mask.reshape(-1)
        values = values.reshape(channels, -1)
        if staged:
            self._fold_rows(values, mask)
            return
        self._reduce(values, mask)


class CountReducer(_Reducer):
    """Counts events on the device; created by :meth:`ReducerBank.count`, pulled as a :class:`Count`.

    Examples:
        >>> import torch
        >>> from rl_observers.stats import ReducerBank
        >>> bank = ReducerBank()
        >>> episodes = bank.count("episodes")
        >>> episodes.fold_true(torch.tensor([True, False, True]))
        >>> episodes.add(1)
        >>> bank.pull()["episodes"].finalize()
        {'episodes': 3.0}
    """

    __slots__ = ()
    width = 1

    def _partials(self, values: Sequence[float]) -> dict[str, Partial]:
        return {self.key: Count(self.key, values[self._offset])}

    def add(self, amount: torch.Tensor | float, *, device: torch.device | None = None) -> None:
        """Adds ``amount`` (a number or a one-element tensor, kept on its device) to the window count.

        Keyword Args:
            device (torch.device, optional): where to allocate the bank's state
                at a first fold of a number. Defaults to the bank's device, or CPU.
        """
        view = self._view
        if isinstance(amount, torch.Tensor):
            if view is None:
                view = self._state(amount.device)
            if amount.device != view.device:
                amount = amount.to(view.device)
            if amount.ndim:
                amount = amount.reshape(())
            if amount.requires_grad:
                amount = amount.detach()
            view.add_(amount)
        else:
            if view is None:
                view = self._state(device or self._bank.device or torch.device("cpu"))
            view.add_(amount)

    def fold_true(self, flags: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Counts the true entries of ``flags`` (where ``mask`` is true)."""
        if flags.numel() == 0:
            return
        if flags.dtype is not _BOOL:
            flags = flags.to(_BOOL)
        if mask is not None:
            flags = flags & mask.to(flags.device, _BOOL)
        self.add(torch.count_nonzero(flags))


class ReducerBank(Transient):
    """Holds the window state of several reducers in one ``float64`` tensor.

    The state lives on the device of the first tensor folded; a reducer
    registered later widens it. :meth:`pull` copies it to the host in one
    transfer, resets the window and returns one partial per key.

    Examples:
        >>> import torch
        >>> from rl_observers.stats import ReducerBank
        >>> bank = ReducerBank()
        >>> lengths = bank.moments("episode_length", stats=("mean", "std", "max"))
        >>> lengths.fold(torch.tensor([3, 5]))
        >>> bank.pull()
        {'episode_length': Moments(prefix='episode_length', stats=('mean', 'std', 'max'), count=2.0, sum=8.0, mean=4.0, m2=2.0, min=3.0, max=5.0)}
        >>> bank.pull()["episode_length"].finalize()  # the window was reset
        {}
    """

    __slots__ = ("_reducers", "_width", "_state", "_host_view")
    _transient = ("_host_view",)

    def __init__(self) -> None:
        self._reducers: list[_Reducer] = []
        self._width = 0
        self._state: torch.Tensor | None = None
        # (state, a view of its float64s) of a CPU state, made at its first pull (see pull)
        self._host_view: tuple[torch.Tensor, memoryview] | None = None

    @property
    def device(self) -> torch.device | None:
        """The device of the state tensor, ``None`` before the first fold."""
        return None if self._state is None else self._state.device

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys :meth:`pull` returns, in registration order."""
        return tuple(key for r in self._reducers for key in r.keys)

    def moments(
        self, prefix: str, *, stats: Sequence[str] = _DEFAULT_MOMENT_STATS, rows: int = 32
    ) -> MomentsReducer:
        """Registers a :class:`MomentsReducer` pulled as ``Moments(prefix, stats=stats)``.

        ``rows``: folds kept apart before they are combined on the device (more
        rows: fewer combinations, a larger transfer).
        """
        return self._register(MomentsReducer(self, self._width, ((prefix, stats),), rows))

    def moments_group(
        self, specs: Sequence[tuple[str, Sequence[str]]], *, rows: int = 32
    ) -> MomentsGroupReducer:
        """Registers a :class:`MomentsGroupReducer`, one ``(prefix, stats)`` of ``specs`` per quantity.

        Each is pulled as ``Moments(prefix, stats=stats)``; ``rows`` as for
        :meth:`moments`.
        """
        specs = tuple(specs)
        if not specs or not all(isinstance(s, tuple) and len(s) == 2 for s in specs):
            raise TypeError(
                f"specs must be a non-empty sequence of (prefix, stats) pairs, got {specs!r}."
            )
        return self._register(MomentsGroupReducer(self, self._width, specs, rows))

    def count(self, name: str) -> CountReducer:
        """Registers a :class:`CountReducer` pulled as ``Count(name)``."""
        return self._register(CountReducer(self, self._width, _check_name(name, "name")))

    def _register(self, reducer: _R) -> _R:
        taken = self.keys
        for key in reducer.keys:
            if key in taken or reducer.keys.count(key) > 1:
                raise ValueError(f"a reducer with key {key!r} is already registered.")
        self._reducers.append(reducer)
        self._width += reducer.width
        if self._state is not None:
            self._grow()
        return reducer

    def _grow(self) -> None:
        """Widens the state for a reducer registered after the first fold, keeping the window."""
        old = self._state
        self._flush()
        state = torch.zeros(self._width, dtype=torch.float64, device=old.device)
        state[: old.numel()].copy_(old)
        self._state = state
        for reducer in self._reducers:
            for name in reducer._transient:
                setattr(reducer, name, None)

    def _flush(self) -> None:
        for reducer in self._reducers:
            reducer._flush()

    def _state_on(self, device: torch.device) -> torch.Tensor:
        state = self._state
        if state is None:
            # Zeros need no host-to-device copy (no sync).
            state = self._state = torch.zeros(self._width, dtype=torch.float64, device=device)
        return state

    def empty(self) -> dict[str, Partial]:
        """Returns the empty partial of every reducer (no transfer, no reset)."""
        zeros = [0.0] * self._width
        return {k: v for reducer in self._reducers for k, v in reducer._partials(zeros).items()}

    def pull(self) -> dict[str, Partial]:
        """Closes the window: one device-to-host transfer, then a reset on the device."""
        state = self._state
        if state is None:
            return self.empty()
        self._flush()
        # The one transfer (and sync) of a window. On the CPU the reducers read the state in
        # place, before the reset, through a view made once (tolist: 24 us, a new view: 20 us).
        if state.is_cpu:
            host = self._host_view
            if host is None or host[0] is not state:
                host = self._host_view = (state, memoryview(state.numpy()))
            values: Sequence[float] = host[1]
        else:
            values = state.tolist()
        out: dict[str, Partial] = {}
        for reducer in self._reducers:
            out.update(reducer._partials(values))
        self.reset()
        return out

    def copy_out(self) -> WindowCopy:
        """Closes the window like :meth:`pull`, without waiting for the device.

        A non-blocking copy (to pinned memory with a CUDA event on a GPU) then a
        reset in stream order; :meth:`WindowCopy.ready` tells whether it landed.

        Examples:
            >>> import torch
            >>> from rl_observers.stats import ReducerBank
            >>> bank = ReducerBank()
            >>> loss = bank.moments("loss", stats=("count", "mean"))
            >>> loss.fold(torch.tensor(2.0))
            >>> loss.fold(torch.tensor(4.0))
            >>> window = bank.copy_out()
            >>> loss.fold(torch.tensor(10.0))  # the next window
            >>> window.ready(), window.partials()["loss"].finalize()
            (True, {'loss_count': 2.0, 'loss_mean': 3.0})
        """
        state = self._state
        if state is None:
            return WindowCopy(None, None, self.empty())
        self._flush()
        if state.device.type == "cuda":
            host = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
            host.copy_(state, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
        else:
            host, landed = state.clone(), None
        makers = [reducer._window_partials() for reducer in self._reducers]
        self.reset()
        return WindowCopy(host, landed, makers)

    def reset(self) -> None:
        """Drops the current window without reading it."""
        if self._state is not None:
            self._state.zero_()
        for reducer in self._reducers:
            reducer._reset()


class WindowCopy:
    """One window of a :class:`ReducerBank` on its way to the host (:meth:`ReducerBank.copy_out`).

    Args:
        host (torch.Tensor or None): the copied state (``None``: nothing was
            folded and ``partials`` holds the empty partials).
        landed (torch.cuda.Event or None): recorded after a GPU copy.
        partials: the reducers' functions of the copied values, or the empty partials.
    """

    __slots__ = ("_host", "_landed", "_makers")

    def __init__(self, host: torch.Tensor | None, landed: Any, makers: Any) -> None:
        self._host = host
        self._landed = landed
        self._makers = makers

    def ready(self) -> bool:
        """Whether the copy has landed (never waits: ``cudaEventQuery``)."""
        return self._landed is None or self._landed.query()

    def partials(self) -> dict[str, Partial]:
        """The window's partials; waits for the copy if it has not landed yet."""
        if self._host is None:
            return dict(self._makers)
        if self._landed is not None:
            self._landed.synchronize()
            self._landed = None
        values = self._host.tolist()
        out: dict[str, Partial] = {}
        for make in self._makers:
            out.update(make(values))
        return out


# Resolutions up to this many mantissa bits count values by their raw bit pattern
# ([sign | exponent | p mantissa bits]: 2**(9 + p) slots, 256 KiB at 1 %), mapped to buckets
# at the pull; finer ones compute each value's bucket over the sketch's exponent range.
_RAW_BITS = 10
_I32 = torch.int32


class QuantileReducer(Transient):
    """Folds tensors into a :class:`~rl_observers.stats.QuantileSketch` on their device.

    Counts live in a ``float64`` buffer on the first tensor's device, folded
    with no host read; :meth:`pull` moves it to the host in one transfer.

    Args:
        name (str): the sketch's name.

    Keyword Args:
        quantiles, accuracy, max_buckets: as for
            :class:`~rl_observers.stats.QuantileSketch`.

    Examples:
        >>> import torch
        >>> from rl_observers.stats import QuantileReducer
        >>> ages = QuantileReducer("age", quantiles=(0.5, 0.9))
        >>> ages.fold(torch.arange(1.0, 101.0))
        >>> ages.fold(torch.tensor([5.0, 1e9]), mask=torch.tensor([True, False]))
        >>> {k: round(v, 1) for k, v in ages.pull().finalize().items()}  # true: 50 and 90
        {'age_p50': 50.2, 'age_p90': 90.5}
        >>> ages.pull().finalize()  # the window was reset
        {}
    """

    __slots__ = ("_empty", "_raw", "_buffer", "_ones", "_stage", "_stage_slots", "_staged")
    _transient = ("_ones", "_stage", "_stage_slots")

    def __init__(
        self,
        name: str,
        *,
        quantiles: Sequence[float] = (0.05, 0.5, 0.95),
        accuracy: float = 0.01,
        max_buckets: int = 2048,
    ) -> None:
        self._empty = QuantileSketch(
            name, quantiles=quantiles, accuracy=accuracy, max_buckets=max_buckets
        )
        self._raw = self._empty.p <= _RAW_BITS
        self._buffer: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None
        self._stage: torch.Tensor | None = None  # [folds, N] float32
        self._stage_slots: tuple[torch.Tensor, ...] | None = None
        self._staged = 0

    def empty(self) -> QuantileSketch:
        """The empty sketch (no transfer)."""
        return self._empty

    def fold(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Counts ``values`` (where ``mask`` is true) in their buckets, on their device.

        ``values`` and ``mask`` as for :meth:`MomentsReducer.fold`.
        """
        if values.is_complex():
            raise _complex(f"QuantileReducer({self._empty.name!r})", values)
        n = values.numel()
        if n == 0:
            return
        if values.requires_grad:
            values = values.detach()
        buffer = self._buffer
        if buffer is None:
            low, high = sketch_key_range(self._empty.p)
            size = 1 << (9 + self._empty.p) if self._raw else 2 * (high - low) + 2
            buffer = self._buffer = torch.zeros(size, dtype=_F64, device=values.device)
        if mask is None:
            slots = self._stage_slots
            if slots is not None:
                if slots[0].shape[0] == n:
                    slot = self._staged
                    slots[slot].copy_(values.reshape(-1))
                    slot += 1
                    self._staged = slot
                    if slot == len(slots):
                        self._flush()
                    return
                self._flush()
                self._stage = self._stage_slots = None
            if n <= _STAGE_ENTRIES:
                self._stage = torch.empty(
                    (_STAGE_FOLDS, n), dtype=torch.float32, device=buffer.device
                )
                self._stage_slots = self._stage.unbind(0)
                self.fold(values)
                return
            self._count(values.reshape(-1), None)
            return
        if mask.shape != values.shape:
            values, mask = torch.broadcast_tensors(values, mask)
        self._count(values.reshape(-1), mask.reshape(-1))

    def _flush(self) -> None:
        """Counts the staged folds."""
        staged = self._staged
        if staged:
            self._staged = 0
            self._count(self._stage[:staged].reshape(-1), None)  # type: ignore[index]

    def _count(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the values of ``x`` (1-D, where ``mask`` is true) to their slots."""
        buffer = self._buffer
        device = buffer.device  # type: ignore[union-attr]
        if x.dtype is not torch.float32 or x.device != device:
            x = x.to(device, torch.float32)
        p = self._empty.p
        bits = x.view(_I32) >> (23 - p)  # sign, exponent and p mantissa bits (sign-extended)
        if self._raw:
            slots = bits.bitwise_and_((1 << (9 + p)) - 1)
        else:
            slots = self._slots(bits)
        if mask is None:
            ones = self._ones
            n = x.numel()
            if ones is None or ones.numel() < n or ones.device != device:
                ones = self._ones = torch.ones(max(n, 1024), dtype=_F64, device=device)
            weights = ones[:n]
        else:
            weights = mask.to(device, _F64)
        buffer.index_add_(0, slots, weights)  # type: ignore[union-attr]

    def _slots(self, bits: torch.Tensor) -> torch.Tensor:
        """Each value's bucket slot, computed on the device (fine resolutions)."""
        p = self._empty.p
        low, high = sketch_key_range(p)
        width = high - low
        magnitude = bits & ((1 << (8 + p)) - 1)
        slots = magnitude.clamp(low, high - 1) - low
        slots = torch.where(bits < 0, slots + width, slots)
        slots = torch.where(magnitude == 0, 2 * width, slots)
        return torch.where(magnitude >= 255 << p, 2 * width + 1, slots)

    def pull(self) -> QuantileSketch:
        """Closes the window: one device-to-host transfer, then a reset on the device."""
        buffer = self._buffer
        empty = self._empty
        if buffer is None:
            return empty
        self._flush()
        host = buffer.cpu()  # the one transfer (and sync) of a window; the buffer itself on CPU
        found = host.nonzero().reshape(-1)
        counts = host[found].tolist()
        slots = found.tolist()
        buffer.zero_()
        p = empty.p
        low, high = sketch_key_range(p)
        positive: dict[int, float] = {}
        negative: dict[int, float] = {}
        zero = nonfinite = 0.0
        if self._raw:
            sign_bit, magnitudes, infinite = 1 << (8 + p), (1 << (8 + p)) - 1, 255 << p
            for slot, c in zip(slots, counts):
                magnitude = slot & magnitudes
                if not magnitude:
                    zero += c
                elif magnitude >= infinite:
                    nonfinite += c
                else:
                    store = negative if slot & sign_bit else positive
                    key = low if magnitude < low else high - 1 if magnitude >= high else magnitude
                    store[key] = store.get(key, 0.0) + c
        else:
            width = high - low
            for slot, c in zip(slots, counts):
                if slot < width:
                    positive[low + slot] = c
                elif slot < 2 * width:
                    negative[low + slot - width] = c
                elif slot == 2 * width:
                    zero = c
                else:
                    nonfinite = c
        return QuantileSketch(
            empty.name,
            quantiles=empty.quantiles,
            accuracy=empty.accuracy,
            max_buckets=empty.max_buckets,
            positive=positive,
            negative=negative,
            zero=zero,
            nonfinite=nonfinite,
        )

    def reset(self) -> None:
        """Drops the current window without reading it."""
        self._staged = 0
        if self._buffer is not None:
            self._buffer.zero_()
