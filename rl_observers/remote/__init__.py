"""Everything that crosses a process: observer copies out, their windows back, the merge.

An observer on a source whose data is elsewhere runs as copies next to the
data (:mod:`~rl_observers.remote.shipping`); each copy sends numbered
*windows* (:mod:`~rl_observers.remote.window`) through a
:class:`MetricsHandle` and a transport (:mod:`~rl_observers.remote.transport`)
to the channel's owner, which accounts for them
(:mod:`~rl_observers.remote.account`) and merges them into rows
(:mod:`~rl_observers.remote.aggregate`). Only this package imports Ray.
"""

from __future__ import annotations

from rl_observers.channel import MetricsChannel, register_wing
from rl_observers.logging.copies import register_copies
from rl_observers.logging.observer import LoggerObserver
from rl_observers.remote import socket as _socket  # registers the socket transport
from rl_observers.remote.contributions import Contribution
from rl_observers.remote.distributed import WORKER_VIEWS
from rl_observers.remote.handle import MetricsHandle
from rl_observers.remote.owner import RemoteWing
from rl_observers.remote.ray import transport as _ray_transport  # registers Ray (never imports it)
from rl_observers.remote.shipping import RemoteAttachError
from rl_observers.remote.transport import register_transport

register_wing(RemoteWing)
register_copies(Contribution)
WORKER_VIEWS[LoggerObserver] = LoggerObserver.worker_view
del _ray_transport, _socket

__all__ = ["MetricsChannel", "MetricsHandle", "RemoteAttachError", "register_transport"]
