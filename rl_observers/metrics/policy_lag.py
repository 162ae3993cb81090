"""PolicyLag: how many policy versions old collected or sampled data is."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import is_tensor_collection, unravel_key

from rl_observers.metrics.keys import leaf_keys, missing_key
from rl_observers.metrics.oneliners import Summary

__all__ = ["PolicyLag"]


class PolicyLag(Summary):
    """How many policy versions old the data is: ``policy_lag_mean``, ``policy_lag_max``.

    Collectors built with ``track_policy_version=True`` stamp each step with
    the acting policy's version; the lag is ``current - stamped``.

    Keyword Args:
        current_version (callable | object | None, optional): a callable, an
            object with ``policy_version`` (a collector), or ``None``: the
            newest version seen in the data (works in workers and actors). Read
            once per event where the metric runs. Defaults to ``None``.
        on (str, optional): ``"post_sample"`` or ``"post_collect"``. Defaults
            to ``"post_collect"``.
        key (NestedKey, optional): the stamped key; missing, a ``KeyError``
            says the fix. Defaults to ``"policy_version"``.
        name (str, optional): Defaults to ``"policy_lag"``.
        stats (sequence of str, optional): Defaults to ``("mean", "max")``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rl_observers import PolicyLag
        >>> lag = PolicyLag(current_version=lambda: 5, on="post_sample")
        >>> sampled = TensorDict({"policy_version": torch.tensor([5, 4, 2])}, [3])
        >>> lag.on_post_sample(None, sampled, {})
        >>> lag.pull()["policy_lag"].finalize()
        {'policy_lag_mean': 1.3333333333333333, 'policy_lag_max': 3.0}
    """

    def __init__(
        self,
        current_version: Callable[[], int] | Any | None = None,
        *,
        on: str = "post_collect",
        key: Any = "policy_version",
        name: str = "policy_lag",
        stats: Sequence[str] = ("mean", "max"),
    ) -> None:
        if on not in ("post_collect", "post_sample"):
            raise ValueError(f"PolicyLag: on must be 'post_collect' or 'post_sample', got {on!r}.")
        self.key = key
        self.current_version = current_version
        self._newest: torch.Tensor | None = None
        super().__init__(name, self._lag, stats=stats, on=on)
        if current_version is None and on == "post_sample":
            self.folded_events = ("post_add", "post_extend", "post_sample")

    def _versions(self, data: Any) -> torch.Tensor:
        # TensorDict.get returns None for a missing key: a missing stamp must not pass silently.
        if not is_tensor_collection(data):
            raise TypeError(
                f"{self!r}: needs TensorDict data with a {self.key!r} entry, got "
                f"{type(data).__name__}."
            )
        versions = data.get(self.key, None)
        if versions is not None:
            return versions
        present = leaf_keys(data)
        stamped = unravel_key(("next", self.key))
        if stamped in present:
            # Collectors that write into a replay buffer stamp the next step's entry.
            fix = (
                f"The data stamps the policy version under {stamped!r} (as a collector writing "
                f"into a replay buffer does): pass PolicyLag(key={stamped!r})."
            )
        else:
            fix = (
                "Build the collector with track_policy_version=True, which stamps each step "
                "with the version of the policy that acted, or pass PolicyLag(key=...) the "
                "key holding that version."
            )
        raise missing_key("PolicyLag", "key", self.key, present, fix=fix)

    def _seen(self, versions: torch.Tensor) -> None:
        if not versions.numel():
            return
        newest = versions.detach().max().reshape(())
        self._newest = newest.clone() if self._newest is None else torch.maximum(self._newest, newest)

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        if self.current_version is None:
            versions = self._versions(data)
            with self._lock:
                self._seen(versions)

    on_post_add = on_post_extend

    def _lag(self, batch: Any, info: Any = None) -> torch.Tensor | None:
        versions = self._versions(batch)
        current = self.current_version
        if current is not None:
            return int(current() if callable(current) else current.policy_version) - versions
        if self.on == "post_collect":
            with self._lock:
                self._seen(versions)
        if self._newest is None:
            return None
        return self._newest.to(versions.device) - versions

    def __repr__(self) -> str:
        return f"PolicyLag(on={self.on!r}, key={self.key!r})"
