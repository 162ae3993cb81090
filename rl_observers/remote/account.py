"""The end-to-end account: what each copy of an observer sent, and what reached the owner.

A copy's handle numbers its windows and marks its last one. Once the
observer is done, the owner's :class:`Account` settles each copy: windows that
never came, wherever lost, count as dropped (``count_lost``); a copy whose
last window never came, or that was expected and never heard from, is
reported and counted in ``copies_lost``. See ``docs/distributed.rst``.

Examples:
    >>> from rl_observers.remote.account import Account
    >>> from rl_observers.remote.window import Window
    >>> lost = []
    >>> account = Account("demo", lost.append)
    >>> def window(copy, seq, counters, last=False):
    ...     return Window("train/worker_0", {}, observer="train", worker=0, counters=counters,
    ...                   copy=copy, seq=seq, last=last)
    >>> account.note(window("h/pid 1", 1, {"frames": 10}))
    False
    >>> account.note(window("h/pid 1", 3, {"frames": 30}, last=True))
    False
    >>> account.waiting("train")  # window 2 has not arrived
    ['worker 0 (h/pid 1)']
    >>> account.settle("train")  # warns: window 2 never arrived
    >>> lost, account.copies_lost
    ([1], 0)
    >>> account.expect("train", [0, 1])  # copies attached in workers 0 and 1
    >>> account.note(window("h/pid 2", 1, {}, last=True))
    False
    >>> account.waiting("train")  # worker 1 never sent anything
    ['worker 1 (never heard from)']
    >>> account.settle("train")  # warns: worker 1's copy vanished
    >>> lost, account.copies_lost
    ([1], 1)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rl_observers.remote.window import Window, worker_key

__all__ = ["Account"]

torchrl_logger = logging.getLogger("torchrl")


@dataclass(slots=True, eq=False)
class _Copy:
    """What the owner knows of one copy of one observer."""

    worker: Any
    where: str
    sent: int = 0  # the highest window number seen
    received: int = 0  # windows received (a merged one counts every window it holds)
    last: bool = False
    counters: Mapping[str, Any] = field(default_factory=dict)
    counters_seq: int = 0  # the number of the window the newest counters came with


class Account:
    """Per copy: the windows it numbered, those that arrived, whether its last one did.

    Args:
        channel (str): the channel's name (for warnings).
        count_lost (Callable): given the windows a settled copy numbered that never arrived.
    """

    def __init__(self, channel: str, count_lost: Callable[[int], None]) -> None:
        self._channel = channel
        self._count_lost = count_lost
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, Any, str], _Copy] = {}
        self._sources: dict[str, str] = {}  # observer name -> its source, in words
        # copies whose account is closed: the highest window number counted then (lost or received)
        self._settled: dict[tuple[str, Any, str], int] = {}
        # copies attached and not heard from yet: (observer name, worker)
        self._expected: set[tuple[str, Any]] = set()
        self.copies_lost = 0

    def describe(self, name: str, description: str) -> None:
        """Names the source of the observer ``name`` in warnings (``description``)."""
        with self._lock:
            self._sources[name] = description

    def expect(self, name: str, workers: Any) -> None:
        """Notes that copies of ``name`` were attached in ``workers``; one never heard from is counted lost."""
        with self._lock:
            for worker in workers:
                key = (name, worker_key(worker))
                if not any(k[0] == name and k[1] == key[1] for k in self._copies):
                    self._expected.add(key)

    def note(self, window: Window) -> bool | None:
        """Notes one numbered window received by the owner; whether it arrived late.

        A late window is given its copy's newest counters (cumulative, they never go back).
        ``None``: its copy was settled with it counted lost, so it must not count again.
        """
        seq = window.seq
        if seq.__class__ is not int:
            return False
        key = (window.observer, worker_key(window.worker), window.copy)
        with self._lock:
            copy = self._copies.get(key)
            if copy is None:
                if self._expected:  # an attached copy's first window: it is heard from
                    self._expected.discard(key[:2])
                counted = self._settled.get(key)
                if counted is not None:  # a window that arrived after its account closed
                    return None if seq <= counted else False
                copy = self._copies[key] = _Copy(window.worker, str(window.copy))
            windows = window.windows
            copy.received += windows if windows.__class__ is int and windows > 0 else 1
            copy.last = copy.last or bool(window.last)
            copy.sent = max(copy.sent, seq)
            counters = window.counters
            if counters is None:  # a last window that only marks the end
                return False
            if seq >= copy.counters_seq:
                copy.counters_seq = seq
                copy.counters = counters
                return False
            window.counters = copy.counters
            return True

    def members(self, name: str) -> frozenset[tuple[Any, ...]]:
        """The copies of the observer ``name`` known now: those heard from and those expected."""
        with self._lock:
            return frozenset(key for key in (*self._copies, *self._expected) if key[0] == name)

    def waiting(self, name: str, members: frozenset[tuple[Any, ...]] | None = None) -> list[str]:
        """The copies of ``name`` (only ``members``, if given) with a window still missing."""
        with self._lock:
            return [
                f"worker {c.worker} ({c.where})"
                for key, c in self._copies.items()
                if key[0] == name and _belongs(key, members) and (not c.last or c.received < c.sent)
            ] + [
                f"worker {key[1]} (never heard from)"
                for key in self._expected
                if key[0] == name and _belongs(key, members)
            ]

    def settle(self, name: str | None = None, members: frozenset[tuple[Any, ...]] | None = None) -> None:
        """Closes the account of ``name`` (every observer's with ``None``; only ``members``, if given).

        Missing windows go to ``count_lost``; copies whose last window
        never came are reported (one warning per observer) and counted in
        ``copies_lost``. The name may then be used again.
        """

        def chosen(key: tuple[Any, ...]) -> bool:
            return (name is None or key[0] == name) and _belongs(key, members)

        with self._lock:
            done = [key for key in self._copies if chosen(key)]
            self._settled.update((key, self._copies[key].sent) for key in done)
            copies = [(key, self._copies.pop(key)) for key in done]
            unheard = [key for key in self._expected if chosen(key)]
            self._expected.difference_update(unheard)
            self.copies_lost += len(unheard)
            sources = dict(self._sources)
            if name is None:
                self._sources.clear()
            elif members is None or not any(key[0] == name for key in (*self._copies, *self._expected)):
                self._sources.pop(name, None)
        vanished: dict[str, list[str]] = {}
        for observer, worker in unheard:
            vanished.setdefault(observer, []).append(
                f"worker {worker}: never heard from (it died, or its windows were lost, before its first one arrived)"
            )
        gaps: list[str] = []
        for (observer, _, _), copy in copies:
            missing = max(copy.sent - copy.received, 0)
            if missing:
                self._count_lost(missing)
            if copy.last and missing:
                gaps.append(
                    f"{sources.get(observer, repr(observer))}, worker {copy.worker} ({copy.where}): "
                    f"{missing} of its {copy.sent} windows"
                )
            elif not copy.last:
                with self._lock:
                    self.copies_lost += 1
                vanished.setdefault(observer, []).append(
                    f"worker {copy.worker} ({copy.where}): its last report was window {copy.sent}"
                    f" with counters {dict(copy.counters)}"
                    + (f", and {missing} of its windows never arrived" if missing else "")
                )
        if gaps:
            torchrl_logger.warning(
                f"MetricsChannel {self._channel!r}: windows that copies numbered never arrived: "
                f"{'; '.join(gaps)}. Counted in health()['dropped']."
            )
        for observer, lines in vanished.items():
            source = sources.get(observer, f"observer {observer!r}")
            torchrl_logger.warning(
                f"MetricsChannel {self._channel!r}: {len(lines)} copies of {source} vanished "
                f"without their final report (actor killed, node lost or worker killed): "
                f"{'; '.join(lines)}. What they reported is in the aggregate; what they collected "
                "after it is lost. Counted in health()['copies_lost']."
            )

    def forget(self, name: str) -> None:
        """Forgets the copies of ``name`` uncounted: the channel closed while their source still runs."""
        with self._lock:
            for key in [k for k in self._copies if k[0] == name]:
                del self._copies[key]
                self._settled[key] = 0  # nothing counted lost: what comes later counts as it goes
            self._expected = {k for k in self._expected if k[0] != name}
            self._sources.pop(name, None)


def _belongs(key: tuple[Any, ...], members: frozenset[tuple[Any, ...]] | None) -> bool:
    """Whether a copy's key, or its expected ``(name, worker)``, is one of ``members`` (all if ``None``)."""
    return members is None or key in members or key[:2] in members
