"""Batch keys: configuration checks, missing-key errors and the keys a source's env specs give.

Replay-buffer storage, writer and index helpers are in :mod:`rl_observers.metrics.storage`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensordict import unravel_key

# Helpers of the metric sets: nothing public here (see docs/api.rst).
__all__: list[str] = []

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
