"""Where an observer's copies plug in (:func:`register_copies`); without a plug-in it is local everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LocalOnly", "new_copies", "register_copies"]


class LocalOnly:
    """An observer's collaborator when no wing plugs copies in: local in every process."""

    __slots__ = ()

    def keep_pristine(self, sets: Any) -> None:
        """Nothing to keep: no copy restarts from the sets."""

    def start_at(self, counter: float) -> None:
        """No copy's schedule to line up."""

    def moved(self) -> bool:
        return False

    def resolve(self, source: Any, *, has_copies: bool, at_exit: Callable[[], None]) -> tuple[str, None]:
        return "local", None


_MAKE: list[Callable[[], Any]] = [LocalOnly]


def register_copies(make: Callable[[], Any]) -> None:
    """Has every observer created from now on hold ``make()`` for what its copies do."""
    _MAKE[:] = [make]


def new_copies() -> Any:
    """The collaborator of a new observer (the registered one's, else :class:`LocalOnly`)."""
    return _MAKE[0]()
