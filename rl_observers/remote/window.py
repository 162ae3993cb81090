"""The ``meta`` keys that the channel reads, defined once.

Step of the flow: **channel** (source → observer → channel → logger). A
payload may travel with a ``meta`` mapping. The channel never interprets
most of it (routers do), but a few keys matter on the way: the Ray relay
merges consecutive windows of one copy of an observer, and the owner keeps
an account of what each copy sent. Those keys are spelled here, and every
module that writes or reads them (the channel's transports, ``logging``'s
contributions and aggregation) imports them from here.

Examples:
    >>> from rl_observers.remote import window as meta
    >>> window = {meta.AGGREGATE: "train", meta.WORKER: 0, meta.COUNTERS: {"frames": 100}}
    >>> meta.is_window(window), meta.is_final(window)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AGGREGATE",
    "BASE",
    "COPY",
    "COUNTERS",
    "FINISH",
    "LAST",
    "PROCESS",
    "SEQ",
    "UNMERGED",
    "WINDOWS",
    "WORKER",
    "is_final",
    "is_window",
    "spanning",
]

#: The name of the observer whose window this is (routes the payload to its aggregate).
AGGREGATE = "aggregate"
#: The worker the window comes from (an index, or what the source calls its worker).
WORKER = "worker"
#: A token of the process that sent it (two copies with one worker index stay apart).
PROCESS = "process"
#: The sending copy's cumulative counters (newest wins when windows merge).
COUNTERS = "counters"
#: ``True`` on the marker the owner queues behind an observer's last windows (ends its aggregate).
FINISH = "finish"
#: What the copy's source had counted before the copy did (a restored worker's ``frames``):
#: included in ``COUNTERS``, but not progress of this run (see ``logging/resume.py``).
BASE = "base"

# -- the end-to-end account (set by the channel's handles, read by the owner) --------------------
#: Who sent the window: one copy of an observer in one process (``"host/pid"``, and the Ray node).
COPY = "copy"
#: The window's number among those its copy sent (1, 2, ...).
SEQ = "seq"
#: How many of its copy's windows this one holds, merged on the way (absent: one).
WINDOWS = "windows"
#: ``True`` on a copy's last window (its source shut down, it was removed, its process exits).
LAST = "last"

#: Keys that differ between two windows that may still merge on the way.
UNMERGED = frozenset({COUNTERS, SEQ, WINDOWS})


def is_window(meta: Mapping[str, Any] | None) -> bool:
    """Whether ``meta`` belongs to an observer's window (it names its observer)."""
    return bool(meta) and AGGREGATE in meta


def is_final(meta: Mapping[str, Any] | None) -> bool:
    """Whether ``meta`` ends a run of windows that merge (``FINISH`` or a copy's ``LAST``)."""
    return bool(meta) and bool(meta.get(FINISH) or meta.get(LAST))


def spanning(older: Mapping[str, Any] | None, newer: Mapping[str, Any] | None) -> Any:
    """The meta of a window that ``older``'s and ``newer``'s windows merged into on the way.

    The newest of the two (the higher ``SEQ``: windows can pass each other
    on the way) gives the counters and the number; ``WINDOWS`` counts every
    window merged, so the owner counts each of them. Without numbers,
    ``newer`` (the later arrival) wins.

    Examples:
        >>> from rl_observers.remote.window import spanning
        >>> spanning({"seq": 3, "counters": {"frames": 30}}, {"seq": 5, "counters": {"frames": 50}})
        {'seq': 5, 'counters': {'frames': 50}, 'windows': 2}
        >>> spanning({"seq": 6, "windows": 2}, {"seq": 4})  # arrived out of order
        {'seq': 6, 'windows': 3}
    """
    if not newer or SEQ not in newer or not older or SEQ not in older:
        return newer
    windows = older.get(WINDOWS, 1) + newer.get(WINDOWS, 1)
    base = newer if newer[SEQ] >= older[SEQ] else older
    return {**base, WINDOWS: windows}
