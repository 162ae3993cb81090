"""Batch keys: configuration checks, missing-key errors and the keys a source's env specs give."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
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


def public_error_name(error: BaseException) -> str:
    """The name a message shows for ``error``: the builtin it stands for when its class is private.

    Examples:
        >>> public_error_name(MissingKeyError("reward"))
        'KeyError'
    """
    cls = type(error)
    if isinstance(error, MissingKeyError) or cls.__name__.startswith("_"):
        cls = next(c for c in cls.__mro__ if c.__module__ == "builtins")
    return cls.__name__


def missing_key(
    owner: str, what: str, key: NestedKey, present: Iterable[NestedKey], *, fix: str | None = None
) -> KeyError:
    """The error of a key missing from the data: names the key, the keys present and the fix.

    ``owner`` reads the key through its argument ``what``; ``fix`` replaces
    the default advice (pass another key or ``None``).

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

    __reduce__ = __repr__  # pickled by name: the one instance


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

    The reward is the first reward key; done keys are those of the reward's
    group, else the root, else anywhere; ``RewardSum`` / ``StepCounter``
    entries sit next to the reward and done keys.

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

    found = {"reward": reward, **{n: done_named(n) for n in ("done", "terminated", "truncated")}}
    any_done = found["done"] or found["terminated"] or found["truncated"]
    keys = {name: None if key is None else ("next", *key) for name, key in found.items()}
    keys["episode_reward"] = ("next", *group, "episode_reward")
    keys["step_count"] = ("next", *(any_done[:-1] if any_done else group), "step_count")
    return keys


def closest_key(key: NestedKey, present: Iterable[NestedKey]) -> NestedKey | None:
    """The key of ``present`` whose spelling is closest to ``key`` (``difflib``), or ``None``.

    Examples:
        >>> closest_key(("next", "rewardz"), [("next", "reward"), ("next", "done"), "observation"])
        ('next', 'reward')
        >>> closest_key("reward", [("next", "reward"), "obs"])
        ('next', 'reward')
    """
    def leaf(k: NestedKey) -> str:
        return k[-1] if isinstance(k, tuple) else k

    best, best_score = None, 0.6  # difflib's default cutoff
    for candidate in sorted(present, key=str):
        # the whole key, or its last name (``"reward"`` for ``("next", "reward")``)
        score = max(
            difflib.SequenceMatcher(None, str(key), str(candidate)).ratio(),
            difflib.SequenceMatcher(None, leaf(key), leaf(candidate)).ratio() - 0.01,
        )
        if score > best_score:
            best, best_score = candidate, score
    return best


def absent_key(owner: str, what: str, key: NestedKey, present: Iterable[NestedKey], where: str) -> ValueError:
    """The error of a key that ``where`` proves absent: the key, the keys present, the closest match.

    Examples:
        >>> print(absent_key("CollectorBatchMetrics", "reward_key", ("next", "rewardz"),
        ...                  [("next", "reward"), ("next", "done")], "the env's specs"))
        CollectorBatchMetrics: reward_key=('next', 'rewardz') is not in the data (known from the env's specs); keys present: ('next', 'done'), ('next', 'reward'); closest: ('next', 'reward'). Pass CollectorBatchMetrics(reward_key=...) one of these keys, or None to leave that metric out.
    """
    present = list(present)
    shown = ", ".join(repr(k) for k in sorted(present, key=str)) or "none"
    match = closest_key(key, present)
    closest = f"; closest: {match!r}" if match is not None else ""
    return ValueError(
        f"{owner}: {what}={key!r} is not in the data (known from {where}); "
        f"keys present: {shown}{closest}. Pass {owner}({what}=...) one of these keys, or None "
        "to leave that metric out."
    )


@dataclass(frozen=True)
class SpecKeys:
    """The keys a collector's batches hold as far as its env's specs (and policy) tell.

    ``next_complete``: no key under ``"next"`` can come from elsewhere (no
    ``postproc``). ``root_complete``: root keys are complete too (and the
    policy declares its ``out_keys``).
    """

    keys: set[NestedKey]
    next_complete: bool
    root_complete: bool

    def proves_absent(self, key: NestedKey) -> bool:
        """Whether ``key`` is provably not in the batches."""
        if key in self.keys:
            return False
        under_next = isinstance(key, tuple) and key[0] == "next"
        return self.next_complete if under_next else self.root_complete


def spec_keys(source: Any) -> SpecKeys | None:
    """What :class:`SpecKeys` the collector ``source`` tells, or ``None`` without an env here.

    Examples:
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> env = CountingEnv()
        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=4, total_frames=4)
        >>> known = spec_keys(collector)
        >>> known.proves_absent(("next", "rewardz")), known.proves_absent(("next", "reward"))
        (True, False)
        >>> known.proves_absent("logits")  # RandomPolicy declares no out_keys
        False
        >>> collector.shutdown()
    """
    env = env_of(source)
    if env is None:
        return None

    def leaves(spec: Any) -> set[tuple[str, ...]]:
        try:
            return {_as_tuple(k) for k in spec.keys(include_nested=True, leaves_only=True)}
        except Exception:  # an env without that spec
            return set()

    observed = leaves(env.full_observation_spec) | leaves(env.full_state_spec)
    done = leaves(env.full_done_spec)
    root = observed | done | leaves(env.full_action_spec)
    after_step = observed | done | leaves(env.full_reward_spec)
    policy = getattr(source, "policy", None)
    out_keys = getattr(policy, "out_keys", None)
    keys: set[NestedKey] = {unravel_key(k) for k in root}
    keys |= {("next", *k) for k in after_step}
    keys.add(("collector", "traj_ids"))
    if out_keys is not None:
        keys |= {unravel_key(k) for k in out_keys}
    plain = getattr(source, "postproc", None) is None
    return SpecKeys(keys, plain, plain and out_keys is not None)
