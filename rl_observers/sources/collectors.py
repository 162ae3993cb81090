"""How collectors emit events.

Collectors call their ``pre_collect_hook`` / ``post_collect_hook`` slots at
every rollout, through the properties of the same names. An observed
collector's properties return its observer list's emitters, which call the
user's own hook first and then the observers, so the slot, ``enable_profile``
and observers never evict one another.
"""

from __future__ import annotations

from typing import Any

from torchrl.collectors import BaseCollector

from rl_observers.observer import ObserverList
from rl_observers.signals import COLLECTOR_EVENTS
from rl_observers.sources.observed import register_mixin

__all__ = ["CollectorObservers", "ObservedCollector"]


class CollectorObservers(ObserverList):
    """The observers of one in-process collector, and the hooks it calls."""

    def __init__(self, source: Any, events: tuple[str, ...] = COLLECTOR_EVENTS, target_name: str = "collector") -> None:
        super().__init__(source, events, target_name)

    def pre_collect_hook(self) -> None:
        user_hook = self.source._pre_collect_hook
        if user_hook is not None:
            user_hook()
        self.emit("pre_collect")

    def post_collect_hook(self, batch: Any) -> None:
        user_hook = self.source._post_collect_hook
        if user_hook is not None:
            user_hook(batch)
        self.emit("post_collect", batch)


class ObservedCollector:
    """Mixin of observed collectors (see :mod:`rl_observers.sources.observed`)."""

    _rl_base: type
    _rl_observers: CollectorObservers

    @property
    def pre_collect_hook(self) -> Any:
        return self._rl_observers.pre_collect_hook

    @pre_collect_hook.setter
    def pre_collect_hook(self, hook: Any) -> None:
        self._rl_base.pre_collect_hook.fset(self, hook)  # type: ignore[attr-defined]

    @property
    def post_collect_hook(self) -> Any:
        return self._rl_observers.post_collect_hook

    @post_collect_hook.setter
    def post_collect_hook(self, hook: Any) -> None:
        self._rl_base.post_collect_hook.fset(self, hook)  # type: ignore[attr-defined]

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        # The collector shuts down even if an observer raises (on_error="raise"): the
        # error is raised once torchrl's shutdown has run.
        observers = self.__dict__.get("_rl_observers")
        try:
            if observers is not None:
                observers.shutdown()
        finally:
            result = self._rl_base.shutdown(self, *args, **kwargs)  # type: ignore[misc]
        return result

    def stats(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        stats = self._rl_base.stats(self, *args, **kwargs)  # type: ignore[misc]
        return self._rl_observers.contribute_stats(stats)


def _is_local_collector(cls: type) -> bool:
    return issubclass(cls, BaseCollector)


register_mixin(_is_local_collector, ObservedCollector)
