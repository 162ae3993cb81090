"""The priorities of what a prioritized replay buffer sampled, as its sampler stores them.

torchrl's prioritized samplers keep ``(p + eps) ** alpha`` per item in a
sum tree (``float32`` unless made with ``dtype=torch.float64``), ``p`` the
priority set. The priority is ``stored ** (1 / alpha) - eps`` when
``alpha > 0``; with ``alpha == 0`` it cannot be recovered.

Examples:
    >>> import torch
    >>> from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer
    >>> from rl_observers.metrics import stored_priorities
    >>> rb = PrioritizedReplayBuffer(alpha=0.5, beta=0.4, storage=LazyTensorStorage(8))
    >>> _ = rb.extend(torch.arange(8))
    >>> rb.update_priority(torch.arange(8), torch.tensor([4.0, 9.0, 16.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    >>> batch, info = rb.sample(4, return_info=True)
    >>> stored = stored_priorities(rb, info)
    >>> torch.equal(stored, torch.pow(torch.tensor([4.0, 9.0, 16.0, 1, 1, 1, 1, 1]) + 1e-8, 0.5)[info["index"]])
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler

__all__ = ["stored_priorities"]


def prioritized_sampler(source: Any) -> PrioritizedSampler | None:
    """The prioritized sampler of a replay buffer (or the sampler itself), else ``None``."""
    sampler = source if isinstance(source, PrioritizedSampler) else getattr(source, "_sampler", None)
    return sampler if isinstance(sampler, PrioritizedSampler) else None


def flat_index(index: Any, shape: Any) -> torch.Tensor | None:
    """``info["index"]`` as flat positions in the storage (the sum tree's), or ``None``."""
    if index is None:
        return None
    if isinstance(index, tuple):
        if len(index) == 1:
            index = index[0]
        elif shape is None or len(shape) != len(index):
            return None
        else:  # per-dim tensors of a multi-dim storage: raveled as torchrl's tree is
            flat = torch.zeros_like(index[0], dtype=torch.int64)
            for position, size in zip(index, shape):
                flat = flat * int(size) + position.to(torch.int64)
            return flat.reshape(-1)
    if not isinstance(index, torch.Tensor):
        index = torch.as_tensor(index)
    if index.ndim == 2 and shape is not None and len(shape) > 1 and index.shape[-1] == len(shape):
        return flat_index(tuple(index.unbind(-1)), shape)
    return index.reshape(-1).to(torch.int64)


def stored_priorities(source: Any, info: Any) -> torch.Tensor | None:
    """The sampling priorities ``(p + eps) ** alpha`` of a sample's items, as the sampler stores them (no sync).

    Args:
        source: a replay buffer with a prioritized sampler (or that sampler).
        info: the sample's info, or its ``"index"``.

    Returns:
        One value per sampled item (per step for a slice sampler), on the
        tree's device, read when called; ``None`` without a prioritized
        sampler or an index.
    """
    sampler = prioritized_sampler(source)
    if sampler is None:
        return None
    index = info if info is None or isinstance(info, (torch.Tensor, tuple)) else info.get("index", None)
    storage = getattr(source, "_storage", None) if sampler is not source else None
    return read_stored(sampler, index, storage)


def read_stored(sampler: PrioritizedSampler, index: Any, storage: Any) -> torch.Tensor | None:
    """The tree's values at a sample's ``index`` into ``storage`` (see :func:`stored_priorities`)."""
    if type(index) is torch.Tensor and index.ndim == 1:
        flat = index if index.dtype is torch.int64 else index.to(torch.int64)  # the usual sample
    else:  # a multi-dim storage's index is per dim
        try:
            shape = tuple(storage.shape)
        except Exception:  # not initialized, or no storage
            shape = ()
        flat = flat_index(index, shape if len(shape) > 1 else None)
    if flat is None or not flat.numel():
        return None
    tree = sampler._sum_tree
    device = getattr(tree, "device", None)
    if device is not None and flat.device != torch.device(device):
        flat = flat.to(device, non_blocking=True)
    return torch.as_tensor(tree[flat])
