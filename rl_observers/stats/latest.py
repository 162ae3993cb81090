"""A device reducer of the latest entries of a stream, pulled as a :class:`LatestWindow`.

A fold is a ``topk`` over the held entries and the new ones: fixed shapes,
no host read. The entries reach the host in the bank's one transfer.

Examples:
    >>> import torch
    >>> from rl_observers.stats import ReducerBank
    >>> from rl_observers.stats.latest import latest_reducer
    >>> bank = ReducerBank()
    >>> last = latest_reducer(bank, "returns", 2, ("episode_return",), stats=[("mean",)])
    >>> values = torch.tensor([[[1.0, 2.0, 3.0]]])  # [K=1, rows=1, steps=3]
    >>> ended = torch.tensor([[True, False, True]])
    >>> last.fold(values, ended, step_base=0, cell_base=0)
    >>> window = bank.pull()["returns"]
    >>> [key for key, _ in window.entries], window.finalize()
    ([(1, 0, 0), (3, 0, 0)], {'episode_return_mean_last_2': 2.0})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_observers.stats.partials import LatestWindow, Partial
from rl_observers.stats.reducers import ReducerBank, _Reducer

__all__ = ["LatestReducer"]

_F64 = torch.float64
# Columns of an entry before its values: order key (0: empty slot), stamp, index.
_HEAD = 3


class LatestReducer(_Reducer):
    """Keeps the ``size`` latest entries folded in the window, on their device.

    Slots are a ``[3 + K, size]`` table: order (``0``: empty), stamp, index
    and ``K`` values per entry. Pulled with keys ``(stamp, source, index)``,
    :attr:`source` set by the reducer's owner (a worker index).
    """

    __slots__ = ("size", "names", "stats", "source", "_cells")
    _transient = ("_view", "_cells")

    def __init__(
        self,
        bank: ReducerBank,
        offset: int,
        key: str,
        size: int,
        names: Sequence[str],
        stats: Sequence[Sequence[str]] | None,
    ) -> None:
        super().__init__(bank, offset, key)
        empty = LatestWindow(size, names, stats=stats)  # validates
        self.size, self.names, self.stats = empty.size, empty.names, empty.stats
        self.source = 0
        self._cells: tuple[Any, ...] | None = None

    @property
    def width(self) -> int:  # type: ignore[override]
        return self.size * (_HEAD + len(self.names))

    def _window(self, values: Sequence[float]) -> LatestWindow:
        size, start = self.size, self._offset
        columns = [
            values[start + c * size : start + (c + 1) * size]
            for c in range(_HEAD + len(self.names))
        ]
        entries = [
            ((int(columns[1][i]), self.source, int(columns[2][i])), [c[i] for c in columns[_HEAD:]])
            for i, key in enumerate(columns[0])
            if key > 0
        ]
        return LatestWindow(self.size, self.names, stats=self.stats, entries=entries)

    def _partials(self, values: Sequence[float]) -> dict[str, Partial]:
        return {self.key: self._window(values)}

    def peek(self) -> LatestWindow:
        """The window's entries so far, without a reset (reads the slice on the host)."""
        view = self._view
        if view is None:
            return LatestWindow(self.size, self.names, stats=self.stats)
        values = [0.0] * self._offset + view.tolist()
        return self._window(values)

    def _templates(self, rows: int, steps: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per batch layout: the cells' order, step and row, and a pool to select from (cached)."""
        cells = self._cells
        if cells is None or cells[0] != (rows, steps, device):
            t = torch.arange(steps, dtype=_F64, device=device).expand(rows, steps)
            r = torch.arange(rows, dtype=_F64, device=device).unsqueeze(-1).expand(rows, steps)
            order = (t * rows + r).reshape(-1)  # later steps are later; then by row
            width = _HEAD + len(self.names)
            pool = torch.empty((width, self.size + rows * steps), dtype=_F64, device=device)
            cells = (rows, steps, device), order, t.reshape(-1), r.reshape(-1), pool
            self._cells = cells
        return cells[1:]

    def fold(
        self, values: torch.Tensor, ended: torch.Tensor, *, step_base: int, cell_base: int
    ) -> None:
        """Folds the entries where ``ended`` is true, keeping the ``size`` latest; no host read.

        Args:
            values (torch.Tensor): ``[K, rows, steps]``, one value per name.
            ended (torch.Tensor): ``[rows, steps]`` booleans: where entries end.

        Keyword Args:
            step_base (int): an entry ending at step ``t`` is stamped
                ``step_base + t + 1``; its row is its index.
            cell_base (int): cell ``(t, row)`` has order ``cell_base + t * rows +
                row``; orders must grow from fold to fold.
        """
        rows, steps = ended.shape
        view = self._view
        if view is None:
            view = self._state(ended.device)
        device = view.device
        if ended.device != device:
            ended, values = ended.to(device), values.to(device)
        order, t, r, pool = self._templates(rows, steps, device)
        k = len(self.names)
        cells = rows * steps
        # Column-major: one contiguous row per column, entries along the last dimension; the
        # entries kept so far, then the batch's cells.
        table = view.view(_HEAD + k, self.size)
        pool[:, : self.size].copy_(table)
        candidates = pool[:, self.size :]
        torch.add(order, float(cell_base + 1), out=candidates[0])
        candidates[0].mul_(ended.reshape(-1))  # 0 where no entry ends
        torch.add(t, float(step_base + 1), out=candidates[1])
        candidates[2].copy_(r)
        candidates[_HEAD:].copy_(values.reshape(k, cells))
        kept = torch.topk(pool[0], min(self.size, pool.shape[1]), sorted=False).indices
        torch.index_select(pool, 1, kept, out=table)


def latest_reducer(
    bank: ReducerBank,
    key: str,
    size: int,
    names: Sequence[str],
    *,
    stats: Sequence[Sequence[str]] | None = None,
) -> LatestReducer:
    """Registers a :class:`LatestReducer` in ``bank``, pulled as ``key``."""
    return bank._register(LatestReducer(bank, bank._width, key, size, names, stats))
