"""Everything that crosses a process: observer copies out, their windows back, the merge.

Steps **source → observer** where the data is elsewhere, and **channel →
logger** at the owner. An observer on such a source runs as copies next to
the data; each copy sends numbered *windows* to the channel's owner, which
accounts for them and merges them into rows. Modules, in the order a window
meets them:

- out: :mod:`~rl_observers.remote.shipping` (common part),
  :mod:`~rl_observers.remote.multiprocess`, :mod:`~rl_observers.remote.shared_buffers`,
  :mod:`~rl_observers.remote.distributed`, :mod:`~rl_observers.remote.ray`;
- back: :mod:`~rl_observers.remote.contributions` (when a copy reports),
  :mod:`~rl_observers.remote.window`, :mod:`~rl_observers.remote.handle`
  (:class:`MetricsHandle`), :mod:`~rl_observers.remote.transport`
  (:mod:`~rl_observers.remote.socket`, :mod:`~rl_observers.remote.ray`),
  :mod:`~rl_observers.remote.owner` (the channel's wing),
  :mod:`~rl_observers.remote.account`, :mod:`~rl_observers.remote.aggregate`.

Only this package imports Ray.
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
