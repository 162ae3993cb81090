"""Replay-buffer storage, writer and index helpers: where a write landed, who writes next."""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import is_tensor_collection
from torch.utils._pytree import tree_leaves
from torchrl.data import RandomSampler, RoundRobinWriter, SamplerWithoutReplacement

# Helpers of the replay-buffer sets: nothing public here (see docs/api.rst).
__all__: list[str] = []


def storage_of(source: Any) -> Any:
    return getattr(source, "_storage", None)


def dim0_slots(index: Any, storage: Any, *, per_item: bool = False) -> torch.Tensor | None:
    """The dim-0 storage slots of a replay-buffer index (int, tensor, ``[N, ndim]`` cells or per-dim tuple), as 1-D int64.

    ``per_item``: one slot per item written.
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


def writer_may_skip(source: Any) -> bool:
    """Whether a buffer's writer may leave items unstored (index ``-1``): any but torchrl's round-robin ones."""
    return not isinstance(getattr(source, "_writer", None), RoundRobinWriter)


def stored_slots(
    index: Any, storage: Any, *, may_skip: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(slots, stored)``: one slot per item a write stored, and the mask of stored items (``None``: all).

    Dropping ``-1`` indices reads the index on the host.
    """
    slots = dim0_slots(index, storage, per_item=True)
    if slots is None or not may_skip or not slots.numel():
        return slots, None
    stored = slots >= 0
    if bool(stored.all()):
        return slots, None
    return slots[stored], stored


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


def round_robin(source: Any) -> tuple[Any, Any, int] | None:
    """``(writer, storage, capacity)`` when item ``k`` lands in slot ``k % capacity`` of a 1-D storage, else ``None``.

    Not with a consuming sampler, whose buffer writes without moving the cursor.
    """
    writer = getattr(source, "_writer", None)
    storage = storage_of(source)
    if not isinstance(writer, RoundRobinWriter) or storage is None:
        return None
    is_consuming = getattr(source, "_is_consuming", None)
    if callable(is_consuming) and is_consuming():
        return None
    if (getattr(storage, "ndim", 1) or 1) != 1:
        return None
    capacity = dim0_capacity(storage)
    if capacity is None or capacity >= 2**62:
        return None
    return writer, storage, capacity


# torchrl's samplers whose ``sample`` hands over an index no later call writes into: a new
# tensor (``RandomSampler``), or a slice of a permutation that is replaced, never rewritten
# (``SamplerWithoutReplacement``). Exact types: a subclass may reuse a buffer.
_FRESH_INDEX_SAMPLERS = (RandomSampler, SamplerWithoutReplacement)


def fresh_index(source: Any) -> bool:
    """Whether the source's sampler hands over an index tensor nothing rewrites later (else it is copied)."""
    return type(getattr(source, "_sampler", None)) in _FRESH_INDEX_SAMPLERS


def writer_cursor(writer: Any) -> int:
    """A round-robin writer's cursor, read without taking its process-shared lock."""
    value = getattr(writer, "_cursor_value", None)
    if value is None:
        return 0
    if type(value) is int:
        return value
    get_obj = getattr(value, "get_obj", None)
    return (get_obj() if get_obj is not None else value).value


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
