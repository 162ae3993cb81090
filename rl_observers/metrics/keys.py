"""Keys and indices: configuration checks, missing-key errors, replay-buffer index helpers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from tensordict import is_tensor_collection, unravel_key
from torch.utils._pytree import tree_leaves

__all__ = [
    "MissingKeyError",
    "NestedKey",
    "check_bool",
    "check_key",
    "dim0_capacity",
    "dim0_slots",
    "info_get",
    "leading_size",
    "leaf_keys",
    "missing_key",
    "storage_device",
    "storage_of",
]

NestedKey = str | tuple[str, ...]

def check_key(value: Any, what: str, owner: str) -> NestedKey | None:
    if value is None:
        return None
    if isinstance(value, str) or (
        isinstance(value, tuple) and value and all(isinstance(k, str) for k in value)
    ):
        return unravel_key(value)
    raise TypeError(
        f"{owner}: {what} must be a str, a non-empty tuple of str or None, got {value!r}."
    )


def check_bool(value: Any, what: str, owner: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {what} must be a bool, got {value!r}.")
    return value


def leaf_keys(td: Any) -> set[NestedKey]:
    return {unravel_key(k) for k in td.keys(include_nested=True, leaves_only=True)}


class MissingKeyError(KeyError):
    """A :class:`KeyError` whose message prints as written (not as a repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def missing_key(owner: str, what: str, key: NestedKey, present: Iterable[NestedKey]) -> KeyError:
    shown = ", ".join(repr(k) for k in sorted(present, key=str)) or "none"
    return MissingKeyError(f"{owner}: {what}={key!r} is not in the data; keys present: {shown}.")


def storage_of(source: Any) -> Any:
    return getattr(source, "_storage", None)


def dim0_slots(index: Any, storage: Any, *, per_item: bool = False) -> torch.Tensor | None:
    """The dim-0 storage slots of a replay-buffer index, as a 1-D int64 tensor.

    ``index`` is what ``add``/``extend`` return or ``info["index"]``: an int, a
    tensor of slots, a ``[N, ndim]`` tensor of cells (multi-dim storages), or
    a tuple of per-dim tensors. With ``per_item``, a write's cells are reduced
    to one slot per item written (their dim-0 slot, repeated consecutively).
    """
    if index is None:
        return None
    if isinstance(index, tuple):
        if not index:
            return None
        index = index[0]
    if not isinstance(index, torch.Tensor):
        index = torch.as_tensor(index)
    elif index.ndim == 1 and index.dtype is torch.int64:
        return index  # slots already (a cell index has two dimensions)
    ndim = getattr(storage, "ndim", 1) or 1
    if ndim > 1 and index.ndim >= 2 and index.shape[-1] == ndim:
        index = index[..., 0]
        if per_item:
            try:
                cells = math.prod(storage.shape[1:])
            except (AttributeError, TypeError, RuntimeError):
                cells = 1
            if cells > 1 and index.numel() % cells == 0:
                index = index.reshape(-1, cells)[:, 0]
    return index.reshape(-1).to(torch.int64)


def storage_device(storage: Any, default: torch.device) -> torch.device:
    device = getattr(storage, "device", None)
    if isinstance(device, (str, torch.device)) and device != "auto":
        return torch.device(device)
    return default


def dim0_capacity(storage: Any) -> int | None:
    try:
        capacity = storage._max_size_along_dim0()
    except Exception:
        capacity = getattr(storage, "max_size", None)
    return capacity if isinstance(capacity, int) and capacity > 0 else None


def leading_size(data: Any) -> int:
    if is_tensor_collection(data):
        return data.batch_size.numel()
    if isinstance(data, torch.Tensor):
        return data.shape[0] if data.ndim else 1
    if isinstance(data, list):
        return len(data)
    leaves = tree_leaves(data)
    first = leaves[0] if leaves else None
    if isinstance(first, torch.Tensor) and first.ndim:
        return first.shape[0]
    return 1


def info_get(info: Any, *keys: str) -> Any:
    for key in keys:
        value = info.get(key, None)
        if value is not None:
            return value
    return None
