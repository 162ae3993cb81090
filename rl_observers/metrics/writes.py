"""WriteMetrics: what is written to a replay buffer (calls, items, rewards)."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import is_tensor_collection

from rl_observers.metrics.base import MetricSet
from rl_observers.metrics.keys import NestedKey, absent_key, check_key, leaf_keys, missing_key
from rl_observers.metrics.storage import (
    leading_size,
    round_robin,
    storage_of,
    stored_slots,
    writer_cursor,
    writer_may_skip,
)

__all__ = ["WriteMetrics"]

# WriteMetrics folds the rows a round-robin writer stored from the storage itself, at the
# latest when this many are pending (or a quarter of the storage: a later write of up to
# three quarters cannot overwrite them).
_RANGE_FOLD_AT = 2**17


class WriteMetrics(MetricSet):
    """What is written to a replay buffer: calls, items, rewards.

    Items count like torchrl's ``write_count`` (items the writer did not
    store count nowhere); a round-robin writer's rewards are folded from the
    storage once per window. Details: :ref:`metric-names`.

    Keyword Args:
        reward_key (NestedKey, optional): reward entry of the written data,
            required there when given. Defaults to ``None`` (no reward metrics).
        mask_key (NestedKey, optional): valid-step mask, used when present.
            Defaults to ``("collector", "mask")``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> from rl_observers.metrics import WriteMetrics
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
        >>> metrics = WriteMetrics(reward_key=("next", "reward"))
        >>> data = TensorDict({"next": {"reward": torch.tensor([[1.0], [3.0]])}}, batch_size=[2])
        >>> metrics.on_post_extend(rb, data, rb.extend(data))
        >>> metrics.counters()
        {'write_count': 2, 'writes': 1, 'items_written': 2}
        >>> metrics.pull()["reward"].finalize()
        {'reward_mean': 2.0, 'reward_std': 1.0, 'reward_min': 1.0, 'reward_max': 3.0}
    """

    counter_names = ("writes", "items_written")
    _lock_folds = False  # each write takes the lock itself
    _transient = ("_ring", "_cursor_shared", "_cursor_cell")

    def __init__(
        self,
        *,
        reward_key: NestedKey | None = None,
        mask_key: NestedKey | None = ("collector", "mask"),
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.reward_key = check_key(reward_key, "reward_key", owner)
        self.mask_key = check_key(mask_key, "mask_key", owner)
        self._reward = self.moments("reward") if self.reward_key is not None else None
        self._last_write: float | None = None
        self._skips: bool | None = None  # whether the source's writer may skip items
        # Round-robin writer on a TensorStorage: (writer, storage, capacity); False: fold each
        # write's data; None: undecided.
        self._ring: tuple[Any, Any, int] | bool | None = None
        self._range_start = 0  # first slot of the rows written and not folded yet
        self._range_len = 0
        self._cursor_shared: Any = None
        self._cursor_cell: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reward_key={self.reward_key!r})"

    def bind(self, source: Any) -> None:
        """Notes whether the source's writer may skip items (any but torchrl's round-robin)."""
        self._skips = writer_may_skip(source)
        with self._lock:
            self._fold_range()
            self._ring = None

    def check_keys(self, source: Any) -> None:
        """Refuses a ``reward_key`` that the buffer's storage, once it holds data, does not have (else the first write checks).

        Raises:
            ValueError: naming the key, the keys present and the closest match.
        """
        key, storage, owner = self.reward_key, storage_of(source), type(self).__name__
        try:  # a storage that cannot be read here (remote, lazy): the first write checks
            item = storage.get(0) if key is not None and storage is not None and len(storage) else None
        except Exception:
            return
        present = leaf_keys(item) if is_tensor_collection(item) else (key,)
        if key not in present:
            raise absent_key(owner, "reward_key", key, present, "the buffer's storage")

    def on_post_add(self, source: Any, data: Any, index: Any) -> None:
        """Counts the item, unless the writer skipped it (``index`` is ``None`` or ``-1``)."""
        with self._lock:
            skipped = index is None or (type(index) is int and index < 0)
            self._write(data, 0 if skipped else 1, None)

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        """Counts the items written and folds their rewards (skipped items are left out)."""
        with self._lock:
            if (
                self._reward is None
                and self._skips is False
                and type(index) is torch.Tensor
                and index.ndim == 1
                and index.dtype is torch.int64
            ):  # the usual count-only write: one slot per item, every item stored
                values = self._counters.values
                values["writes"] += 1
                values["items_written"] += index.shape[0]
                self._last_write = time.monotonic()
                return
            ring = self._ring
            if ring and source.__dict__.get("shared"):  # other processes write too: see the class
                self._fold_range()
                ring = self._ring = False
            if ring and type(index) is torch.Tensor and index.ndim == 1:
                n = index.shape[0]
                capacity = ring[2]
                if 4 * n <= capacity:
                    # writer_cursor(), inlined: the shared value's cell read lock-free, or an int
                    value = getattr(ring[0], "_cursor_value", None)
                    if value is self._cursor_shared and value is not None:
                        cursor = self._cursor_cell.value
                    elif type(value) is int:
                        cursor = value
                    else:
                        cursor = self._cursor_from(value)
                    self._extend_range(n, cursor, capacity)
                    return
            if ring:
                tensor = isinstance(index, torch.Tensor)
                written = (index.shape[0] if index.ndim else 1) if tensor else leading_size(data)
                capacity, pending, unseen = ring[2], self._range_len, 0
                if pending and written < capacity:  # rows the cursor moved past with no event
                    start = (writer_cursor(ring[0]) - written) % capacity
                    unseen = (start - self._range_start - pending) % capacity
                lost = self._fold_range(overwritten=unseen + written)
                if lost:
                    self._retire_ring(lost, unseen, written)
            if self._skips is None:
                self._skips = writer_may_skip(source)
            slots, stored = stored_slots(index, storage_of(source), may_skip=self._skips)
            self._write(data, leading_size(data) if slots is None else slots.numel(), stored)
            if ring is None:
                self._ring = self._ring_of(source, data)

    def _cursor_from(self, value: Any) -> int:
        """The cursor held in a writer's shared ``_cursor_value``; its cell is kept for the next read."""
        get_obj = getattr(value, "get_obj", None)
        if value is None or get_obj is None:
            return 0 if value is None else value.value
        self._cursor_shared, self._cursor_cell = value, get_obj()
        return self._cursor_cell.value

    def on_empty(self, source: Any) -> None:
        """Folds the pending rows (the storage keeps them until they are written again)."""
        with self._lock:
            self._fold_range()

    def _ring_of(self, source: Any, data: Any) -> tuple[Any, Any, int] | bool:
        """Whether the rows a write stored can be read back from the storage (see the class)."""
        if self._reward is None or not is_tensor_collection(data) or getattr(source, "shared", False):
            return False
        ring = round_robin(source)
        if ring is None or not is_tensor_collection(getattr(ring[1], "_storage", None)):
            return False
        transform = getattr(source, "_transform", None)
        if transform is not None and len(getattr(transform, "transforms", (transform,))):
            return False
        return ring

    def _extend_range(self, n: int, cursor: int, capacity: int) -> None:
        """Counts a write of ``n`` rows that end at ``cursor``; their rewards wait in the storage."""
        start = cursor - n
        if start < 0:
            start += capacity
        pending = self._range_len
        values = self._counters.values
        values["writes"] += 1
        values["items_written"] += n
        self._last_write = time.monotonic()
        if pending and start != (self._range_start + pending) % capacity:
            if not self._after_unobserved(start, n, pending, capacity):
                return  # this write was folded; later ones are folded from their data
            pending = 0
        if not pending:
            self._range_start = start
        self._range_len = pending + n
        if 4 * self._range_len > capacity or self._range_len >= _RANGE_FOLD_AT:
            self._fold_range()

    def _after_unobserved(self, start: int, n: int, pending: int, capacity: int) -> bool:
        """The cursor moved between two observed writes; whether the range path goes on.

        Taken as an unobserved writer's rows; a loss is reported and ends the path.
        """
        unseen = (start - self._range_start - pending) % capacity
        lost = self._fold_range(overwritten=unseen + n)
        if not lost:
            return True
        self._range_start, self._range_len = start, n
        self._fold_range()
        self._retire_ring(lost, unseen)
        return False

    def _retire_ring(self, lost: int, unseen: int, written: int = 0) -> None:
        """Reports ``lost`` pending rewards gone; every later write is folded from its own data."""
        why = f"the writer's cursor moved by {unseen} rows without an observed write"
        if not unseen:
            why = f"by a write of {written} rows into {self._ring[2]} slots"  # type: ignore[index]
        self._ring = False
        warnings.warn(
            f"{type(self).__name__}: the rewards of {lost} rows written to the replay buffer "
            f"could not be read back from the storage ({why}); they are left out of reward_*. "
            "From now on every write is folded from its own data, so it cannot happen again.",
            stacklevel=3,
        )

    def _fold_range(self, overwritten: int = 0) -> int:
        """Folds the pending rows' rewards from the storage; returns how many were overwritten (``overwritten``: rows written since)."""
        n, self._range_len = self._range_len, 0
        ring = self._ring
        if not n or not ring:
            return 0
        capacity = ring[2]
        lost = max(0, min(n, n + overwritten - capacity))
        if lost:
            self._range_start = (self._range_start + lost) % capacity
            n -= lost
            if n <= 0:
                return lost
        reward, mask = self._reward_and_mask(ring[1]._storage)
        start = self._range_start
        first = min(n, capacity - start)
        for a, b in ((start, start + first), (0, n - first)):
            if b > a:
                self._reward.fold(reward[a:b], None if mask is None else mask[a:b])  # type: ignore[union-attr]
        return lost

    def _reward_and_mask(self, data: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rewards of ``data`` and the valid-step mask broadcast to them (``None``: no mask)."""
        reward = data.get(self.reward_key, None)
        if reward is None:
            raise missing_key(type(self).__name__, "reward_key", self.reward_key, leaf_keys(data))
        mask = data.get(self.mask_key, None) if self.mask_key is not None else None
        if mask is not None:
            mask = mask.reshape(*mask.shape, *(1,) * (reward.ndim - mask.ndim))
        return reward, mask

    def _fold_staged(self) -> None:
        self._fold_range()

    def _write(self, data: Any, items: int, stored: torch.Tensor | None) -> None:
        """Counts a write of ``items`` items; ``stored``: which items of ``data`` were kept."""
        counters = self._counters
        counters.add("writes", 1)
        counters.add("items_written", items)
        self._last_write = time.monotonic()
        if self._reward is None or not items:
            return
        if not is_tensor_collection(data):
            raise TypeError(
                f"{type(self).__name__}: reward_key={self.reward_key!r} needs TensorDict data, "
                f"got {type(data).__name__}."
            )
        reward, mask = self._reward_and_mask(data)
        if stored is not None and reward.ndim and reward.shape[0] == stored.numel():
            stored = stored.reshape(-1, *(1,) * (reward.ndim - 1))
            mask = stored if mask is None else mask & stored
        self._reward.fold(reward, mask)

    def _clear_window(self) -> None:
        self._range_len = 0

    def counters(self) -> dict[str, float]:
        """``write_count``, ``writes``, ``items_written`` (cumulative)."""
        values = self._counters.values
        return {"write_count": values["items_written"], **values}

    def _counter_reader(self, name: str) -> Callable[[], int] | None:
        values = self._counters.values
        name = "items_written" if name == "write_count" else name
        return functools.partial(values.__getitem__, name) if name in values else None

    def stats(self) -> dict[str, float]:
        """``writes``, ``items_written`` and, after a write, ``seconds_since_last_write``."""
        values = self._counters.values
        out = {"writes": values["writes"], "items_written": values["items_written"]}
        if self._last_write is not None:
            out["seconds_since_last_write"] = time.monotonic() - self._last_write
        return out
