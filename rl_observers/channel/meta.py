"""The ``meta`` keys that the channel reads, defined once.

Step of the flow: **channel** (source → observer → channel → logger). A
payload may travel with a ``meta`` mapping. The channel never interprets
most of it (routers do), but a few keys matter on the way: the Ray relay
merges consecutive windows of one copy of an observer, and the owner keeps
an account of what each copy sent. Those keys are spelled here, and every
module that writes or reads them (the channel's transports, ``logging``'s
contributions and aggregation) imports them from here.

Examples:
    >>> from rl_observers.channel import meta
    >>> window = {meta.AGGREGATE: "train", meta.WORKER: 0, meta.COUNTERS: {"frames": 100}}
    >>> meta.is_window(window), meta.is_final(window)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["AGGREGATE", "COUNTERS", "FINISH", "PROCESS", "WORKER", "is_final", "is_window"]

#: The name of the observer whose window this is (routes the payload to its aggregate).
AGGREGATE = "aggregate"
#: The worker the window comes from (an index, or what the source calls its worker).
WORKER = "worker"
#: A token of the process that sent it (two copies with one worker index stay apart).
PROCESS = "process"
#: The sending copy's cumulative counters (newest wins when windows merge).
COUNTERS = "counters"
#: ``True`` on the last window of an observer (or of one copy): it is never merged into another.
FINISH = "finish"


def is_window(meta: Mapping[str, Any] | None) -> bool:
    """Whether ``meta`` belongs to an observer's window (it names its observer)."""
    return bool(meta) and AGGREGATE in meta


def is_final(meta: Mapping[str, Any] | None) -> bool:
    """Whether ``meta`` marks a last window (``FINISH``)."""
    return bool(meta) and bool(meta.get(FINISH))
