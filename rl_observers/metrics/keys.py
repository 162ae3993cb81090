"""Keys and indices: configuration checks, missing-key errors, replay-buffer index and writer helpers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from tensordict import is_tensor_collection, unravel_key
from torch.utils._pytree import tree_leaves
from torchrl.data import RoundRobinWriter

__all__ = [
    "FROM_SOURCE",
    "MissingKeyError",
    "NestedKey",
    "check_bool",
    "check_key",
    "dim0_capacity",
    "dim0_slots",
    "env_of",
    "info_get",
    "keys_from_source",
    "leading_size",
    "leaf_keys",
    "missing_key",
    "round_robin",
    "storage_device",
    "storage_of",
    "stored_slots",
    "writer_cursor",
    "writer_may_skip",
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


def missing_key(
    owner: str, what: str, key: NestedKey, present: Iterable[NestedKey], *, fix: str | None = None
) -> KeyError:
    """The error of a key missing from the data: names the key, the keys present and the fix.

    Args:
        owner (str): who reads the key (a class name).
        what (str): the argument of ``owner`` that names the key.
        key (NestedKey): the key missing.
        present (iterable of NestedKey): the keys the data has.

    Keyword Args:
        fix (str, optional): what to change, when it is more than passing
            another key or ``None``. Defaults to ``None``: pass
            ``owner(what=...)`` one of the keys present, or ``None``.

    Examples:
        >>> print(missing_key("WriteMetrics", "reward_key", "rew", ["obs", ("next", "reward")]))
        WriteMetrics: reward_key='rew' is not in the data; keys present: ('next', 'reward'), 'obs'. Pass WriteMetrics(reward_key=...) one of these keys, or None to leave that metric out.
    """
    shown = ", ".join(repr(k) for k in sorted(present, key=str)) or "none"
    if fix is None:
        fix = f"Pass {owner}({what}=...) one of these keys, or None to leave that metric out."
    return MissingKeyError(f"{owner}: {what}={key!r} is not in the data; keys present: {shown}. {fix}")


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


def writer_may_skip(source: Any) -> bool:
    """Whether a replay buffer's writer may leave items of a write unstored (index ``-1``).

    torchrl's round-robin writers store every item; others (such as
    ``TensorDictMaxValueWriter``, which keeps the best items) may not.
    """
    return not isinstance(getattr(source, "_writer", None), RoundRobinWriter)


def stored_slots(
    index: Any, storage: Any, *, may_skip: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The dim-0 slots of the items a write stored, and which items of the write those are.

    Returns ``(slots, stored)``: one slot per item stored, and a boolean
    ``[items]`` mask of the items stored, or ``None`` when every item was
    (always, unless ``may_skip``). A writer marks an item it did not store
    with index ``-1``; dropping those reads the index on the host (such
    writers, like ``TensorDictMaxValueWriter``, read every item's rank on the
    host anyway).
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
    """``(writer, storage, capacity)`` when slots are written in turn, on a 1-D storage.

    torchrl's round-robin writers write item ``k`` of the buffer's writes at
    slot ``k % capacity`` and keep the next slot in their cursor, so the age
    and the position of every stored item follow from the cursor alone.
    Not with a consuming sampler: its buffer writes into consumed slots
    (``write_at``), wherever they are, without moving the cursor.
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


def info_get(info: Any, *keys: str) -> Any:
    for key in keys:
        value = info.get(key, None)
        if value is not None:
            return value
    return None


class _FromSource:
    """The default of a key that the source's specs decide (see :func:`keys_from_source`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FROM_SOURCE"

    def __reduce__(self) -> str:
        return "FROM_SOURCE"


#: Default of a key taken from the source's env specs when the set is bound to a collector.
FROM_SOURCE: Any = _FromSource()


def _as_tuple(key: Any) -> tuple[str, ...]:
    key = unravel_key(key)
    return key if isinstance(key, tuple) else (key,)


def env_of(source: Any) -> Any:
    """The env of a collector running in this process, or ``None`` (a buffer, a remote collector)."""
    env = getattr(source, "env", None)
    return env if hasattr(env, "reward_keys") and hasattr(env, "done_keys") else None


def keys_from_source(source: Any) -> dict[str, NestedKey | None] | None:
    """Batch keys of a collector's steps, from its env's specs; ``None`` without an env here.

    ``reward`` is ``("next", *env.reward_keys[0])``. ``done``,
    ``terminated`` and ``truncated`` are the done keys of that name in the
    reward's group (``("agents", "done")`` next to ``("agents", "reward")``),
    else at the root, else anywhere; ``None`` when the env has none.
    ``episode_reward`` and ``step_count`` are where ``RewardSum`` and
    ``StepCounter`` write them: next to the reward and to the done key.

    Examples:
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.testing.mocking_classes import NestedCountingEnv
        >>> from rl_observers.metrics.keys import keys_from_source
        >>> env = NestedCountingEnv()
        >>> collector = Collector(env, RandomPolicy(env.full_action_spec), frames_per_batch=4, total_frames=4)
        >>> keys_from_source(collector)["reward"], keys_from_source(collector)["done"]
        (('next', 'data', 'reward'), ('next', 'data', 'done'))
        >>> collector.shutdown()
    """
    env = env_of(source)
    if env is None:
        return None
    reward_keys = [_as_tuple(k) for k in env.reward_keys]
    done_keys = [_as_tuple(k) for k in env.done_keys]
    reward = reward_keys[0] if reward_keys else None
    group = reward[:-1] if reward is not None else ()

    def done_named(leaf: str) -> tuple[str, ...] | None:
        named = [k for k in done_keys if k[-1] == leaf]
        for wanted in (group, ()):
            for key in named:
                if key[:-1] == wanted:
                    return key
        return named[0] if named else None

    done, terminated, truncated = (done_named(n) for n in ("done", "terminated", "truncated"))
    any_done = done or terminated or truncated
    return {
        "reward": None if reward is None else ("next", *reward),
        "done": None if done is None else ("next", *done),
        "terminated": None if terminated is None else ("next", *terminated),
        "truncated": None if truncated is None else ("next", *truncated),
        "episode_reward": ("next", *group, "episode_reward"),
        "step_count": ("next", *(any_done[:-1] if any_done else group), "step_count"),
    }
