"""The owner's side of the Ray transport: its ingest actor and the thread that drains it.

See :mod:`rl_observers.remote.ray.transport` for the flow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from rl_observers.remote.ray.ingest import (
    ACTOR_NAMESPACE,
    DRAIN_BATCH,
    DRAIN_WAIT,
    INGEST_CAPACITY,
    NAME,
    SENDER_INTERVAL,
    Message,
    RayAddress,
    _ray,
    call_remote,
    ingest_class,
    no_start,
    ready_within,
)

# torchrl's logger (the same object as torchrl._utils.logger)
torchrl_logger = logging.getLogger("torchrl")

# The receivers started in this process (closed by close_ray_receivers).
_STARTED: weakref.WeakSet[RayReceiver] = weakref.WeakSet()
#: Called once a receiver found Ray shut down under it (the Ray sources' copies went with it).
RAY_GONE: list[Callable[[], None]] = []


def close_ray_receivers() -> None:
    """Takes in what Ray holds for this process's channels, then stops their Ray transport.

    For a ``ray.shutdown()`` known to come (a torchrl source's runtime lease).
    """
    for receiver in list(_STARTED):
        receiver.close(time.monotonic() + 5.0)


class RayReceiver:
    """The owner's side: an ingest actor on the owner's node and a thread that drains it.

    Args:
        token (str): the channel's token (names the actors).

    Keyword Args:
        capacity (int, optional): messages the ingest holds before it drops.
            Defaults to ``INGEST_CAPACITY``.
        name (str, optional): the channel's name, for warnings. Defaults to ``""``.
    """

    name = NAME

    def __init__(self, token: str, *, capacity: int = INGEST_CAPACITY, name: str = "") -> None:
        self.token = token
        self._capacity = capacity
        channel = f"MetricsChannel {name!r} " if name else ""
        self._owner = f"{channel}(pid {os.getpid()} on {os.uname().nodename})"
        self._pid = os.getpid()
        self._actor: Any = None
        self._in_flight: Any = None  # a drain whose reply a timed-out get left: taken next time
        self._address: RayAddress | None = None
        self._accept: Callable[..., None] | None = None
        self._refuse: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._lock = threading.Lock()  # one drain at a time (thread, poll or close)
        self._gone = threading.Lock()  # taken, never released, when Ray is gone: said once
        self.drains = 0
        self.restarts = 0  # ingest actors that died (what they held is lost: windows by their gaps)
        self.error: BaseException | None = None

    def start(
        self,
        accept: Callable[[Any, tuple[int, int, int]], None],
        refuse: Callable[[], None] | None = None,
        background: bool = True,
    ) -> None:
        """Creates the ingest actor (the owner must be connected to Ray) and the draining thread.

        With ``background=False`` messages are accepted only by :meth:`poll`.
        """
        ray = _ray()
        if ray is None or not ray.is_initialized():
            raise RuntimeError("RayReceiver.start expected a process connected to Ray (ray.init()).")
        ingest = f"rl_observers-ingest-{self.token}"
        self._address = RayAddress(self.token, ingest, ACTOR_NAMESPACE, self._owner)
        self._node = ray.get_runtime_context().get_node_id()
        self._accept = accept
        # an unreadable batch counts as one dropped
        self._refuse = refuse or (lambda: accept(None, (1, 0, 0)))
        self._actor = self._create_ingest()
        _STARTED.add(self)
        if background:
            self._thread = threading.Thread(target=self._run, name="rl_observers-ray-ingest", daemon=True)
            self._thread.start()

    def _create_ingest(self) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        address = self._address
        here = NodeAffinitySchedulingStrategy(node_id=self._node, soft=False)
        named = dict(name=address.ingest, namespace=address.namespace, get_if_exists=True)
        return ingest_class().options(**named, scheduling_strategy=here).remote(self._capacity)

    def address(self) -> RayAddress:
        if self._address is None:
            raise RuntimeError("RayReceiver.address() is known once start() ran.")
        return self._address

    def _run(self) -> None:
        while not self._stop:
            self.drain(DRAIN_WAIT, timeout=DRAIN_WAIT + 1.0)

    def poll(self, deadline: float | None) -> None:
        """Accepts what the ingest holds now (flush, step), until ``deadline`` at most."""
        while not self._stop or self._actor is not None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if not self.drain(0.0, timeout=left):
                return

    def drain(self, wait: float, timeout: float | None = None) -> int:
        """Takes what the ingest holds and accepts it, within ``timeout``; returns how many messages."""
        ray = _ray()
        if self._actor is not None and not ray.is_initialized():
            # not behind the lock: a drain under way may wait on the dead Ray for long
            self._ray_shut_down()
            return 0
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            return 0
        try:
            actor = self._actor
            if actor is None:
                return 0
            if not ray.is_initialized():
                self._ray_shut_down()
                return 0
            reply, self._in_flight = self._in_flight, None
            try:
                if reply is None:
                    reply = call_remote(actor.drain, DRAIN_BATCH, wait)
                if not ready_within([reply], timeout):
                    self._in_flight = reply  # what the ingest handed out is not lost
                    return 0
                batches, dropped, coalesced = no_start(ray.get)(reply, timeout=0)
            # the ingest died: start a new one, senders find it by name (SystemExit: Ray's
            # get when ray.shutdown() runs meanwhile)
            except (Exception, SystemExit) as err:
                self.error = err
                if not ray.is_initialized():  # ray.shutdown() meanwhile
                    self._ray_shut_down()
                    return 0
                if not self._stop:
                    time.sleep(min(wait, 0.1))
                    self.restarts += 1
                    self._refuse()  # what it held besides windows is unknown: counted as one
                    torchrl_logger.warning(
                        f"{self._owner}: its Ray ingest actor died ({err!r}) and a new one is started. "
                        "What it held is lost: the windows of observers' copies among it count in "
                        "health()['dropped'] once their copies are done; its other payloads, whose "
                        "number is unknown, count as one."
                    )
                    try:
                        self._actor = self._create_ingest()
                    except Exception as again:
                        self.error = again
                return 0
            self.drains += 1
            messages = [message for data in batches for message in self._load(data)]
            accept = self._accept
            if dropped or coalesced:  # the ingest's drops: with the first message, or alone
                if messages:
                    messages[0].carrying(dropped, coalesced)
                else:
                    accept(None, (dropped, coalesced, 0))
            for message in messages:
                payload = message.payload
                # its numbered windows were left out of held for the hops (the owner counts them by gap)
                accept(payload, (*message.counts, message.held[0] + getattr(payload, "counted_by_number", 0)))
            return len(messages)
        finally:
            self._lock.release()

    def _ray_shut_down(self) -> None:
        """Ray was shut down in this process: the transport stops (a new actor would start a new Ray), said once."""
        self._stop = True
        self._actor = self._in_flight = None
        if not self._gone.acquire(blocking=False):  # the thread and a poll may both notice
            return
        torchrl_logger.warning(
            f"{self._owner}: Ray was shut down in this process while the "
            "channel was open; its Ray transport stopped, and whatever its ingest actor still "
            "held is lost: the copies of observers in Ray actors went with Ray, and those whose "
            "last window had not arrived are counted in health()['copies_lost']. Shut the Ray "
            "sources down (collector.shutdown(), the buffer's close()) and close the channel "
            "(channel.close()) before ray.shutdown()."
        )
        for hook in RAY_GONE:
            hook()

    def _load(self, data: bytes) -> list[Message]:
        """The messages of one batch; an unreadable batch is refused (counted as dropped)."""
        try:
            messages = pickle.loads(data)
            for message in messages:  # the payload itself is checked where it is accepted
                (d, c), (h, m) = message.counts, message.held
                if message.__class__ is not Message or not all(n.__class__ is int for n in (d, c, h, m)):
                    raise TypeError(f"not a message: {message!r}")
        except Exception as err:
            self.error = err
            self._refuse()
            return []
        return messages

    def barrier(self, deadline: float | None) -> None:
        """Accepts everything sent before the call that left its sender (flush's barrier)."""
        if self._address is None or os.getpid() != self._pid:
            return
        time.sleep(2 * SENDER_INTERVAL)
        self.poll(deadline)

    def close(self, deadline: float | None = None) -> None:
        """Accepts what the ingest holds, then kills it; waits until ``deadline`` (monotonic) at most."""
        if self._address is None or os.getpid() != self._pid:
            return
        self._stop = True
        thread = self._thread
        # with Ray shut down nothing is left to take, and the thread may hang in a call it left
        if thread is not None and _ray().is_initialized():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.poll(deadline)
        self.release()

    def release(self) -> None:
        """Stops without waiting (the channel was garbage-collected): the actors are killed."""
        if os.getpid() != self._pid:
            return
        self._stop = True
        actor, self._actor, self._in_flight = self._actor, None, None
        ray = _ray()
        if actor is not None and ray is not None and ray.is_initialized():
            with contextlib.suppress(Exception):
                no_start(ray.kill)(actor)

    def forget_after_fork(self) -> None:
        """In a forked child: forgets the parent's actors (never kills them)."""
        self._stop = True
        self._actor = self._in_flight = None
        self._address = None
