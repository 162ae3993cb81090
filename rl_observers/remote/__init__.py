"""Everything that crosses a process: observer copies out, their windows back, the merge.

Step of the flow: **source → observer** where the data is elsewhere, and
**channel → logger** at the owner (source → observer → channel → logger).
An observer attached to a source whose data lives in other processes runs
as copies next to the data; each copy sends numbered *windows* back to the
channel's owner, which keeps an account of them and merges them into rows.
Modules, in the order a window meets them:

Out, shipping copies (:mod:`~rl_observers.remote.shipping`, the common part):

- :mod:`~rl_observers.remote.multiprocess`: the worker processes of multiprocessing collectors;
- :mod:`~rl_observers.remote.shared_buffers`: every process writing into a shared replay buffer;
- :mod:`~rl_observers.remote.distributed`: torch.distributed and RPC collectors;
- :mod:`~rl_observers.remote.ray`: Ray actors (remote collectors, the replay-buffer actor),
  and the Ray transport back.

Back, windows to the owner:

- :mod:`~rl_observers.remote.contributions`: what a ``LoggerObserver`` shares with its
  copies (its ``Contribution``): where a copy runs, when it reports, and what it sends;
- :mod:`~rl_observers.remote.window`: what a window says besides its metrics;
- :mod:`~rl_observers.remote.handle`: :class:`MetricsHandle`, a channel's picklable stand-in;
- :mod:`~rl_observers.remote.transport`: the transport interface and registry;
  :mod:`~rl_observers.remote.socket` (this machine) and :mod:`~rl_observers.remote.ray` (any node);
- :mod:`~rl_observers.remote.owner`: the channel's wing, registered with the local
  :class:`~rl_observers.MetricsChannel` (:mod:`rl_observers.channel`): its receivers, and
  its stand-in in a forked child;
- :mod:`~rl_observers.remote.account`: what each copy sent and what reached the owner;
- :mod:`~rl_observers.remote.aggregate`: the owner merges the windows into rows.

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
