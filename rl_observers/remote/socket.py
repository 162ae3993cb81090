"""The Unix-datagram transport: processes on the owner's machine send to its socket.

Step **observer → channel**, on one machine. The owner binds a datagram
socket in a private (0700) temporary directory (:class:`SocketReceiver`); a
handle elsewhere on the machine sends each pickled payload as one datagram,
never blocking (:class:`SocketWire`). A datagram may be as large as the
send buffer the kernel grants (about 416 KiB with Linux's defaults), at
most ``MAX_DATAGRAM``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pickle
import select
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from torchrl._utils import logger as torchrl_logger

from rl_observers import lifecycle
from rl_observers.remote.transport import GONE, RETRY, SENT, Accept, register_transport

__all__ = ["SocketAddress", "SocketReceiver", "SocketWire", "machine_id", "reachable"]

# The largest payload a handle sends in one datagram (pickled), in bytes: the receiver reads
# this much at once. A sender's own limit is its send buffer, which the kernel may keep smaller.
MAX_DATAGRAM = 1 << 20
# Linux refuses a datagram longer than the sender's SO_SNDBUF minus this (EMSGSIZE).
_SNDBUF_OVERHEAD = 32
# How many datagrams the receiver reads in one go before releasing its lock.
_RECEIVE_BATCH = 4096
# Errors meaning "the owner's socket queue is full right now": retry later.
_RETRY_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.ENOMEM})


@functools.cache
def machine_id() -> str:
    """This machine's identity: its boot id (the same in every container and mount namespace)."""
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as file:
                found = file.read().strip()
        except OSError:
            continue
        if found:
            return found
    return socket.gethostname()


class SocketAddress(str):
    """The owner's socket path, and the machine it lives on (:func:`machine_id`)."""

    __slots__ = ("machine",)

    def __new__(cls, path: str, machine: str | None = None) -> SocketAddress:
        address = super().__new__(cls, path)
        address.machine = machine_id() if machine is None else machine
        return address

    def __reduce__(self) -> tuple[Any, ...]:
        return (SocketAddress, (str(self), self.machine))


def reachable(address: Any) -> bool:
    """Whether the owner's socket is reachable here: same machine, and its file exists here.

    A file system shared between machines can show the socket file where it reaches nothing.
    """
    if not isinstance(address, str):
        return False
    machine = getattr(address, "machine", None)
    if machine is not None and machine != machine_id():
        return False
    return os.path.exists(address)


class SocketWire:
    """Sends one datagram to an owner's socket from another process; never blocks.

    ``EAGAIN`` (the owner's socket queue is full) is ``RETRY``; any other
    error (owner gone, a message too large) is ``GONE``. ``path=None`` loses all.
    """

    name = "socket"
    # this process's socket, the largest datagram it sends, its send buffer (forgotten by a fork)
    _sockets: tuple[socket.socket, int, int] | None = None

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._warned = False

    @classmethod
    def _socket(cls) -> tuple[socket.socket, int, int]:
        """This process's socket, the largest datagram it sends and its send buffer."""
        if cls._sockets is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            # the send buffer bounds one datagram: ask for room for the largest, and
            # read back what the kernel granted (it caps the request)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_DATAGRAM)
            try:
                sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            except OSError:
                sndbuf = MAX_DATAGRAM
            limit = max(0, min(MAX_DATAGRAM, sndbuf - _SNDBUF_OVERHEAD))
            cls._sockets = (sock, limit, sndbuf)
        return cls._sockets

    @classmethod
    def max_payload(cls) -> int:
        """The most bytes a pickled payload may take to be sent from this process."""
        return cls._socket()[1]

    def send(self, data: bytes) -> str:
        if self.path is None:
            return GONE
        sock, limit, sndbuf = self._socket()
        try:
            if len(data) <= limit:
                sock.sendto(data, self.path)
                return SENT
        except OSError as err:
            if err.errno in _RETRY_ERRNOS:
                return RETRY
            if err.errno != errno.EMSGSIZE:
                return GONE  # the owner is gone (ENOENT, ECONNREFUSED) or worse
        if not self._warned:
            self._warned = True
            why = (
                f"this process's socket send buffer is {sndbuf} bytes, as much as the kernel "
                "grants (on Linux, raise net.core.wmem_max for more)"
                if limit < MAX_DATAGRAM
                else "the most the channel's socket reads at once"
            )
            torchrl_logger.warning(
                f"MetricsHandle dropped a payload: {len(data)} bytes pickled, more than the "
                f"{limit} bytes one datagram carries here ({why}). It is counted in the owner's "
                "health()['dropped']; log less per payload (a smaller window, fewer "
                "metrics). Further such errors are silent."
            )
        return GONE


class SocketReceiver:
    """The owner's datagram socket, and the thread that reads it.

    Args:
        name (str): the channel's name, for warnings.
    """

    name = "socket"

    def __init__(self, name: str) -> None:
        self._name = name
        self._pid = os.getpid()
        self.path: str | None = None
        self._sock: socket.socket | None = None
        self._dir: str | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._lock = threading.Lock()  # guards reading the socket
        self._stop = False
        self._thread: threading.Thread | None = None
        self._accept: Accept | None = None
        self._refuse: Callable[[], None] | None = None
        # one buffer for every datagram, a byte longer than the largest: a datagram
        # that fills it was cut short, and is refused
        self._buffer = bytearray(MAX_DATAGRAM + 1)

    @classmethod
    def create(cls, token: str, name: str) -> SocketReceiver | None:
        """Binds the socket; ``None`` (with a warning) where that is impossible."""
        if not hasattr(socket, "AF_UNIX"):
            torchrl_logger.warning(
                f"MetricsChannel {name!r}: Unix-domain sockets are not available on "
                "this platform; handles used in other processes will drop their metrics."
            )
            return None
        receiver = cls(name)
        try:  # a datagram socket in a new private (0700) temporary directory
            directory = tempfile.mkdtemp(prefix="rl_observers-")
            path = os.path.join(directory, "channel.sock")
            if len(os.fsencode(path)) > 100:  # sun_path holds ~108 bytes
                os.rmdir(directory)
                directory = tempfile.mkdtemp(prefix="rlo-", dir="/tmp")
                path = os.path.join(directory, "channel.sock")
            receiver._dir, receiver.path = directory, path
            receiver._sock = sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(path)
                sock.setblocking(False)
                # Linux ignores it for Unix datagrams; others count them
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MAX_DATAGRAM)
                receiver._wake_r, receiver._wake_w = socket.socketpair()
                receiver._wake_w.setblocking(False)
            except OSError:
                receiver._close_sockets()
                receiver._unlink()
                raise
        except OSError as err:  # no temporary directory, no socket, no room: handles elsewhere drop
            torchrl_logger.warning(
                f"MetricsChannel {name!r} could not bind its socket ({err!r}); "
                "handles used in other processes will drop their metrics."
            )
            return None
        return receiver

    def address(self) -> SocketAddress | None:
        return None if self.path is None else SocketAddress(self.path)

    def start(self, accept: Accept, refuse: Callable[[], None], background: bool) -> None:
        self._accept, self._refuse = accept, refuse
        if background:
            self._thread = threading.Thread(
                target=self._loop, name=f"MetricsChannel[{self._name}].receiver", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        sock, wake = self._sock, self._wake_r
        assert sock is not None and wake is not None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(wake.fileno(), select.POLLIN)
        broken = select.POLLERR | select.POLLHUP | select.POLLNVAL
        try:
            while not self._stop:
                try:
                    events = poller.poll()
                except OSError:
                    break
                if any(mask & broken for _, mask in events):
                    break
                with self._lock:
                    self._receive_available()
            with self._lock:
                self._receive_available()
        finally:
            self._close_sockets()

    def poll(self, deadline: float | None) -> None:
        """Reads the datagrams already queued on the socket."""
        if self._sock is None:
            return
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if self._lock.acquire(timeout=wait):
            try:
                self._receive_available()
            finally:
                self._lock.release()

    def _receive_available(self) -> int:
        """Hands over the datagrams waiting on the socket. Caller holds ``_lock``."""
        sock = self._sock
        if sock is None:
            return 0
        count = 0
        buffer = self._buffer
        view = memoryview(buffer)
        while count < _RECEIVE_BATCH:
            try:
                size = sock.recv_into(buffer)
            except OSError:  # nothing left (EAGAIN) or socket closed
                break
            count += 1
            try:
                message = None if size > MAX_DATAGRAM else pickle.loads(view[:size])
                valid = message.__class__ is tuple and len(message) == 2
            except Exception:
                valid = False
            if valid:
                self._accept(*message)  # type: ignore[misc]
            else:
                self._refuse()  # type: ignore[misc]
        return count

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is not None:
            with contextlib.suppress(OSError):
                wake.send(b"\0")

    def _unlink(self) -> None:
        if os.getpid() != self._pid:
            return
        for remove, target in ((os.unlink, self.path), (os.rmdir, self._dir)):
            if target is not None:
                with contextlib.suppress(OSError):
                    remove(target)

    def _close_sockets(self) -> None:
        for sock in (self._sock, self._wake_r, self._wake_w):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self, deadline: float | None) -> None:
        """Removes the socket file, reads what was already sent, closes the socket."""
        self._unlink()
        thread = self._thread
        if thread is not None:
            self._stop = True
            self._wake()
            wait = 2.0 if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(min(wait, 2.0))
            if thread.is_alive():  # never expected: it only reads and hands over
                self._close_sockets()
        else:
            with self._lock:
                self._receive_available()
            self._close_sockets()

    def release(self) -> None:
        if os.getpid() != self._pid:
            return
        self._unlink()
        if self._thread is not None:
            self._stop = True
            self._wake()
        else:
            self._close_sockets()

    def forget_after_fork(self) -> None:
        self._close_sockets()


lifecycle.after_fork_in_child(lambda: setattr(SocketWire, "_sockets", None))

register_transport(
    "socket",
    make_sender=SocketWire,
    make_receiver=SocketReceiver.create,
    reachable=reachable,
    priority=0,
)
