"""The events sources emit, as blinker signals.

Each event's :class:`blinker.Signal` is sent after the observers, only when it
has receivers, with the source as ``sender`` and the payload as keywords
(:data:`EVENT_PAYLOADS`). A receiver connected for one source makes that source
emit; a receiver that raises is handled like an observer (its ``on_error``
attribute, else ``"warn"``). See the concepts page, "Signals".

Examples:
    >>> import torch
    >>> import rl_observers
    >>> from rl_observers import signals
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(10))
    >>> seen = []
    >>> def on_extend(sender, data, index):
    ...     seen.append(len(index))
    >>> _ = signals.post_extend.connect(on_extend, sender=rb)
    >>> _ = rb.extend(torch.arange(4))
    >>> seen
    [4]
    >>> signals.post_extend.disconnect(on_extend, sender=rb)
"""

from __future__ import annotations

from blinker import Namespace, Signal

__all__ = [
    "COLLECTOR_EVENTS",
    "REPLAY_BUFFER_EVENTS",
    "empty",
    "post_add",
    "post_collect",
    "post_extend",
    "post_sample",
    "pre_collect",
    "shutdown",
    "signal_for",
]

_namespace = Namespace()

pre_collect: Signal = _namespace.signal("pre_collect", doc="Before a collector's rollout.")
post_collect: Signal = _namespace.signal("post_collect", doc="After a collector's batch.")
shutdown: Signal = _namespace.signal("shutdown", doc="When a source shuts down.")
post_add: Signal = _namespace.signal("post_add", doc="After ``add`` on a replay buffer.")
post_extend: Signal = _namespace.signal("post_extend", doc="After ``extend`` on a replay buffer.")
post_sample: Signal = _namespace.signal("post_sample", doc="After a replay buffer sampled.")
empty: Signal = _namespace.signal("empty", doc="After ``empty()`` on a replay buffer.")

#: Events a collector emits, in the order of one collection cycle.
COLLECTOR_EVENTS: tuple[str, ...] = ("pre_collect", "post_collect", "shutdown")
#: Events a replay buffer emits.
REPLAY_BUFFER_EVENTS: tuple[str, ...] = ("post_add", "post_extend", "post_sample", "empty", "shutdown")

#: The payload names of each event, after the source.
EVENT_PAYLOADS: dict[str, tuple[str, ...]] = {
    "pre_collect": (),
    "post_collect": ("batch",),
    "shutdown": (),
    "post_add": ("data", "index"),
    "post_extend": ("data", "index"),
    "post_sample": ("batch", "info"),
    "empty": (),
}


def signal_for(event: str) -> Signal:
    """Returns the signal of ``event`` (``"post_collect"``, ...); raises ``ValueError`` for another name.

    Examples:
        >>> from rl_observers.signals import signal_for
        >>> signal_for("post_sample").name
        'post_sample'
    """
    if event not in EVENT_PAYLOADS:
        raise ValueError(f"event must be one of {sorted(EVENT_PAYLOADS)}, got {event!r}.")
    return _namespace[event]
