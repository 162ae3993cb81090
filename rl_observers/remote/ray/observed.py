"""Observers inside Ray actors: remote collectors and the replay-buffer actor.

Attaching sends one ``__ray_call__`` per actor with the pickled observer;
events happen in the actor, so the driver makes no extra call per write,
sample or batch. Files an observer writes in an actor come back with
:func:`send_file_to_driver`. See ``docs/distributed.rst``.

Inside the actor, Ray calls a buffer's public methods through functions
captured when the actor class was made, so the ``"ray_actor"`` classes
override what those reach through ``self``: ``_add`` / ``_extend`` /
``_sample``, or ``_set_index_in_td`` for ``TensorDictReplayBuffer``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torchrl._utils import logger as torchrl_logger

from rl_observers.remote.ray.receiver import RAY_GONE, close_ray_receivers
from rl_observers.remote.shipping import (
    RemoteAttachError,
    RemoteKind,
    attach_here,
    call_hook,
    detach_here,
    kind_of,
    ship,
)
from rl_observers.signals import COLLECTOR_EVENTS, REPLAY_BUFFER_EVENTS
from rl_observers.sources.observed import (
    how_observed,
    observers_of,
    switch_class,
    torchrl_class,
)
from rl_observers.sources.placement import IdentityMap
from rl_observers.sources.replay_buffers import emit_eagerly

__all__ = ["RAY_COLLECTOR", "RAY_REPLAY_BUFFER", "send_file_to_driver"]

#: The context of the observed classes used inside a Ray actor.
ACTOR = "ray_actor"
#: The context of the observed classes of the driver-side Ray objects.
DRIVER = "ray_driver"
#: The context of the observed clients an observed ``RayReplayBuffer`` hands out.
CLIENT = "ray_client"
# Seconds to wait for the actors to emit ``shutdown`` before torchrl kills them.
_SHUTDOWN_TIMEOUT = 30.0
# Seconds each actor is waited for at least, once the shared deadline has passed.
_MIN_WAIT = 1.0


def _gather(refs: list[Any], action: str, target: Any, received: Any = None) -> None:
    """``ray.get`` of every ref (each result to ``received``), raising the first error once all have finished."""
    import ray  # an optional dependency: imported once a Ray source exists

    errors = []
    for idx, ref in enumerate(refs):
        try:
            result = ray.get(ref)
        except Exception as error:
            errors.append((idx, getattr(error, "cause", None) or error))
            continue
        if received is not None:
            received(result)
    if errors:
        idx, cause = errors[0]
        raise RemoteAttachError(f"{action} {type(target).__name__} actor {idx} failed: {cause}") from None


# The driver-side Ray sources observed in this process, told when Ray goes down under them.
_SOURCES = IdentityMap()


class _RayKind(RemoteKind):
    """A Ray source: its copies live in Ray actors, and go with Ray.

    Subclasses give ``actors(target)``, those holding the copies, and
    ``placed(target, index, actors)``: what ``attach_here`` gets after the
    payload in the actor ``index`` of ``actors``.
    """

    context = DRIVER

    def first_added(self, target: Any) -> None:
        _SOURCES.set(target, self)
        super().first_added(target)

    def attach_remote(self, target: Any, payload: bytes, on_error: str, token: int) -> None:
        try:
            self._attach_from(target, 0, [(payload, on_error, token)], "attaching an observer to")
        except Exception:
            # Undo the actors that attached it; those that failed have no copy.
            with contextlib.suppress(Exception):
                refs = [a.__ray_call__.remote(detach_here, token) for a in self.actors(target)]
                _gather(refs, "undoing", target)
            raise

    def _attach_from(self, target: Any, first: int, payloads: list[tuple], action: str) -> None:
        """Attaches each ``(payload, on_error, token)`` in the actors from index ``first`` on, in order."""
        actors = self.actors(target)
        refs = [
            actor.__ray_call__.remote(_attach_in_actor, *entry, *self.placed(target, i, len(actors)))
            for entry in payloads
            for i, actor in enumerate(actors[first:], first)
        ]
        _gather(refs, action, target)

    def detach_remote(self, target: Any, token: int) -> None:
        refs = [a.__ray_call__.remote(_then_drain, detach_here, token) for a in self.actors(target)]
        _gather(refs, "detaching an observer from", target, _write_files)


def _copies_gone_with_ray() -> None:
    """Ray went down under an open channel: tells the originals, as at a shutdown, that their copies went with it."""
    for target, kind in _SOURCES.items():
        kind.shut_down(target)


RAY_GONE.append(_copies_gone_with_ray)


class RayCollectorKind(_RayKind):
    """Observers of a ``RayCollector``: a copy in every remote collector actor."""

    target_name = "collector"
    emits = COLLECTOR_EVENTS
    where = "in its remote collector actors"
    stopped = "without remote collectors (is it shut down?)"
    # An observer raising in a collector actor kills the actor: the driver gets ActorDiedError.
    raise_reaches_caller = False

    def is_running(self, target: Any) -> bool:
        return bool(getattr(target, "_remote_collectors", None))

    def actors(self, target: Any) -> list[Any]:
        return list(target.remote_collectors)

    def placed(self, target: Any, index: int, actors: int) -> tuple[Any, ...]:
        return index, actors, None, not target._sync  # async: taken when the driver asks again

    def copy_workers(self, target: Any) -> tuple[int | None, ...]:
        return tuple(range(len(target.remote_collectors)))

    def attach_to_new(self, target: Any, first: int, entries: tuple[tuple[Any, str, int], ...]) -> None:
        """Gives the actors from index ``first`` on every attached observer, in order; kills them all if one fails."""
        actors = list(target.remote_collectors)
        new = actors[first:]
        if not entries or not new:
            return
        payloads = [(ship(observer, target, self.where), on_error, token) for observer, on_error, token in entries]
        try:
            self._attach_from(target, first, payloads, "attaching the observers to an added")
        except Exception as error:
            import ray

            for actor in new:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
                with contextlib.suppress(ValueError):
                    target._remote_collectors.remove(actor)
            raise RemoteAttachError(
                f"{error} The {len(new)} collectors being added were stopped and not added."
            ) from None
        for observer, _, _ in entries:
            call_hook(observer, "copies_placed", target, tuple(range(first, len(actors))))


class RayReplayBufferKind(_RayKind):
    """Observers of a ``RayReplayBuffer``: a copy inside the buffer's actor."""

    target_name = "replay buffer"
    emits = REPLAY_BUFFER_EVENTS
    where = "inside its Ray actor"
    stopped = "that is closed"

    def is_running(self, target: Any) -> bool:
        return hasattr(target, "_rb")

    def actors(self, target: Any) -> list[Any]:
        return [target._rb]

    def placed(self, target: Any, index: int, actors: int) -> tuple[Any, ...]:
        return None, None, ACTOR  # no worker: the observed classes of a buffer in an actor

    def check(self, target: Any, action: str) -> None:
        super().check(target, action)
        if target.transport_kind != "ray":
            raise NotImplementedError(
                f"cannot {action} a {type(target).__name__} with "
                f"transport={target.transport_kind!r}: only the 'ray' transport is observed."
            )

    def copy_workers(self, target: Any) -> tuple[int | None, ...]:
        return (None,)


RAY_COLLECTOR = RayCollectorKind()
RAY_REPLAY_BUFFER = RayReplayBufferKind()


# -- run inside the actors -------------------------------------------------------------------------


# Files waiting in this actor for the driver, as (absolute path, bytes); only in an actor whose
# observers the driver attached through this module, which drains them (see the module docstring).
_OUTBOX: list[tuple[str, bytes]] = []
_OUTBOX_LOCK = threading.Lock()
# The id of this process once the driver attached observers here.
_DRAINED: list[int | None] = [None]


def send_file_to_driver(path: str | Path) -> bool:
    """Sends the file at ``path`` back to the driver, if this process is a Ray actor it drains.

    In a Ray actor whose observers were attached from the driver, the bytes
    are read now and kept until the driver removes an observer or shuts the
    source down; the driver then writes them under the same absolute path.
    Elsewhere it does nothing.

    Args:
        path (str or Path): a file written in this process.

    Returns:
        bool: whether the file will be sent.

    Examples:
        >>> from rl_observers.remote.ray.observed import send_file_to_driver
        >>> send_file_to_driver("trace.json")  # not in a Ray actor: nothing to send
        False
    """
    if _DRAINED[0] != os.getpid():
        return False
    path = Path(path).resolve()
    data = path.read_bytes()
    with _OUTBOX_LOCK:
        _OUTBOX.append((str(path), data))
    return True


def _then_drain(source: Any, action: Any, *args: Any) -> list[tuple[str, bytes]]:
    """Runs ``action(source, *args)`` in the actor, then hands over the files waiting for the driver."""
    try:
        action(source, *args)
    finally:
        with _OUTBOX_LOCK:
            files = list(_OUTBOX)
            _OUTBOX.clear()
    return files


def _attach_in_actor(source: Any, *args: Any) -> None:
    """``attach_here``, noting that the driver drains this process's outbox."""
    _DRAINED[0] = os.getpid()  # not a process forked from here (the workers of a collector in it)
    attach_here(source, *args)


def _taken_here(collector: Any) -> None:
    """The driver took this actor's last rollout and stopped iterating: it is delivered."""
    observers = observers_of(collector)
    if observers is not None:
        observers.delivered()


def _write_files(files: list[tuple[str, bytes]]) -> None:
    """Writes the files an actor sent back on the driver, under their paths (see the module docstring)."""
    for path, data in files:
        try:
            target = Path(path)
            if target.is_file() and target.stat().st_size == len(data) and target.read_bytes() == data:
                continue  # the actor ran on this node: the file is already here
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            partial.write_bytes(data)
            partial.replace(target)
            torchrl_logger.info(f"rl_observers: {path} written on the driver, from a Ray actor")
        except Exception as error:
            torchrl_logger.warning(
                f"rl_observers: could not write {path}, sent back by a Ray actor "
                f"({type(error).__name__}: {error})."
            )


def _shutdown_here(source: Any) -> None:
    observers = observers_of(source)
    if observers is not None:
        observers.shutdown()
    elif kind_of(source) is not None:
        # A multiprocessing collector in the actor: closing it makes its workers emit.
        source.shutdown()


def _buffer_stats_here(buffer: Any) -> dict[str, Any]:
    stats = buffer.stats()
    observers = observers_of(buffer)
    return observers.contribute_stats(stats) if observers is not None else stats


def _buffer_empty_here(buffer: Any, empty_write_count: bool) -> None:
    buffer.empty(empty_write_count=empty_write_count)
    observers = observers_of(buffer)
    if observers is not None:
        observers.emit("empty")


def _emit_shutdown(actors: list[Any]) -> None:
    """Runs ``_shutdown_here`` in every actor before they are killed; writes the files they send back.

    Each answer is awaited on its own within one shared deadline, so a dead
    or hung actor does not stop the others; those that failed get one warning.
    """
    import ray

    if not actors or not ray.is_initialized():  # gone with Ray (a call would start a new Ray)
        return
    refs = [actor.__ray_call__.remote(_then_drain, _shutdown_here) for actor in actors]
    deadline = time.monotonic() + _SHUTDOWN_TIMEOUT
    failed = []
    for idx, ref in enumerate(refs):
        try:
            _write_files(ray.get(ref, timeout=max(deadline - time.monotonic(), _MIN_WAIT)))
        except Exception as error:  # the actors are being killed anyway
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            failed.append(f"actor {idx} ({type(error).__name__}: {first_line})")
    if failed:
        torchrl_logger.warning(
            f"rl_observers: could not emit 'shutdown' in {len(failed)} of {len(refs)} Ray actors: "
            f"{', '.join(failed)}."
        )


# -- the driver-side observed classes --------------------------------------------------------------


# Stands in for torchrl's Ray runtime lease while torchrl shuts a source down (_shutting_down).
_LEASE_HELD = SimpleNamespace(release=lambda: None)


@contextlib.contextmanager
def _shutting_down(target: Any, kind: RemoteKind, shutdown_ray: bool = False) -> Any:
    """Runs torchrl's shutdown of ``target`` (the block), tells the originals, then lets Ray go.

    torchrl's Ray runtime lease, whose release may call ``ray.shutdown()``, is
    held until the originals know their copies are gone; the channels then
    take in what the Ray wire holds before Ray goes.
    """
    lease = target.__dict__.get("_runtime_lease")
    if lease is not None:
        target._runtime_lease = _LEASE_HELD
    try:
        yield
    finally:
        if lease is not None:
            target._runtime_lease = lease
        try:
            kind.shut_down(target)
        finally:
            # torchrl's _RayRuntimeLease: its last release stops the Ray it started
            leases = type(lease)
            last = getattr(lease, "_released", True) is False and getattr(leases, "_leases", 0) == 1
            if shutdown_ray or (last and getattr(leases, "_owns_runtime", False)):
                close_ray_receivers()
            if lease is not None:
                lease.release()
            if shutdown_ray:
                import ray

                ray.shutdown()


class _DriverObservedRayCollector:
    """Driver-side ``RayCollector`` with observers: lets the actors emit ``shutdown`` first."""

    def add_collectors(self, *args: Any, **kwargs: Any) -> None:
        # The collectors added now get every observer the others have, in order, under the
        # same tokens, so that removing an observer reaches them too.
        with RAY_COLLECTOR.attached(self) as entries:
            first = len(self._remote_collectors)  # type: ignore[attr-defined]
            torchrl_class(type(self)).add_collectors(self, *args, **kwargs)  # type: ignore[attr-defined]
            RAY_COLLECTOR.attach_to_new(self, first, entries)

    def _async_iterator(self) -> Any:
        # While a batch is out with the user, its actor was not asked for another: if the
        # user stops iterating there, that actor's last rollout was taken all the same.
        batches = torchrl_class(type(self))._async_iterator(self)  # type: ignore[attr-defined]
        for batch in batches:
            frame = batches.gi_frame
            self._rl_taken_last = None if frame is None else frame.f_locals.get("collector_index")
            yield batch
            self._rl_taken_last = None

    def stop_remote_collectors(self) -> None:
        import ray

        # after a ray.shutdown() the actors went with Ray (and a call would start a new Ray)
        actors = list(getattr(self, "_remote_collectors", ())) if ray.is_initialized() else []
        taken_last = getattr(self, "_rl_taken_last", None)
        if isinstance(taken_last, int) and taken_last < len(actors):
            # sent before the shutdown calls: Ray runs one caller's calls to an actor in order
            actors[taken_last].__ray_call__.remote(_taken_here)
            self._rl_taken_last = None
        _emit_shutdown(actors)
        return torchrl_class(type(self)).stop_remote_collectors(self)  # type: ignore[attr-defined]

    def shutdown(self, timeout: float | None = None, shutdown_ray: bool = False) -> None:
        # The actors emit shutdown before they are killed (stop_remote_collectors, above).
        with _shutting_down(self, RAY_COLLECTOR, shutdown_ray):
            torchrl_class(type(self)).shutdown(self, timeout=timeout)  # type: ignore[attr-defined]

    async def async_shutdown(self, shutdown_ray: bool = False) -> None:
        with _shutting_down(self, RAY_COLLECTOR, shutdown_ray):
            await torchrl_class(type(self)).async_shutdown(self, shutdown_ray=False)  # type: ignore[attr-defined]


class _OneCallToTheActor:
    """``stats()`` (observers' entries included) and ``empty()`` (then ``empty`` emitted), one call each."""

    _actor_attribute = "_rb"  # where the buffer's actor is: ``rb._rb``, a client's ``_actor``

    def stats(self) -> dict[str, Any]:
        import ray

        return ray.get(getattr(self, self._actor_attribute).__ray_call__.remote(_buffer_stats_here))

    def empty(self, empty_write_count: bool = True) -> None:
        import ray

        actor = getattr(self, self._actor_attribute)
        return ray.get(actor.__ray_call__.remote(_buffer_empty_here, empty_write_count))


class _DriverObservedRayReplayBuffer(_OneCallToTheActor):
    """Driver-side ``RayReplayBuffer`` with observers: one round trip for what touches them."""

    def client(self) -> Any:
        # torchrl's clients() calls self.client() once per client: both hand out observed ones.
        client = torchrl_class(type(self)).client(self)  # type: ignore[attr-defined]
        if how_observed(type(client), CLIENT) is not None:  # the Ray transport's client
            switch_class(client, CLIENT)
        return client

    def close(self) -> None:
        if hasattr(self, "_rb"):
            _emit_shutdown([self._rb])
        with _shutting_down(self, RAY_REPLAY_BUFFER):  # the actor and its copies are gone
            torchrl_class(type(self)).close(self)  # type: ignore[attr-defined]


#: What a client of a ``RayReplayBuffer`` refuses: observers are attached to the buffer itself.
_OBSERVER_API = frozenset({"add_observer", "remove_observer", "observers"})


class _ObservedRayReplayBufferClient(_OneCallToTheActor):
    """A client handed out by an observed ``RayReplayBuffer``: its observers see what it does."""

    _actor_attribute = "_actor"

    def __getattr__(self, name: str) -> Any:
        if name in _OBSERVER_API:
            # torchrl's client would forward the call to the actor, where an observer attached
            # in process sees samples only (Ray calls the actor's public methods directly).
            raise AttributeError(
                f"a {type(self).__name__} has no {name!r}: attach observers to the RayReplayBuffer "
                "itself, on the driver; they see the writes, samples, stats() and empty() of its clients."
            )
        return torchrl_class(type(self)).__getattr__(self, name)  # type: ignore[attr-defined]


# -- the actor-side observed classes ---------------------------------------------------------------


class _ActorObservedSampling:
    """What every replay buffer inside a Ray actor emits: ``post_sample``."""

    def _sample(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        result = torchrl_class(type(self))._sample(self, *args, **kwargs)  # type: ignore[attr-defined]
        emit_eagerly(self, "post_sample", result[0], result[1])
        return result


class _ActorObservedReplayBuffer(_ActorObservedSampling):
    """``ReplayBuffer`` / ``PrioritizedReplayBuffer`` inside a Ray actor."""

    def _add(self, data: Any) -> Any:
        index = torchrl_class(type(self))._add(self, data)  # type: ignore[attr-defined]
        emit_eagerly(self, "post_add", data, index)
        return index

    def _extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        index = torchrl_class(type(self))._extend(self, data, *args, **kwargs)  # type: ignore[attr-defined]
        emit_eagerly(self, "post_extend", data, index)
        return index


_WRITE_EVENTS = {"add": "post_add", "extend": "post_extend"}


class _ActorObservedTensorDictReplayBuffer(_ActorObservedSampling):
    """``TensorDictReplayBuffer`` and its prioritized variant inside a Ray actor.

    Their ``add`` / ``extend`` call ``self._set_index_in_td(data, index)``
    once: that call, named after its caller, is the event.
    """

    def _set_index_in_td(self, tensordict: Any, index: Any) -> None:
        torchrl_class(type(self))._set_index_in_td(self, tensordict, index)  # type: ignore[attr-defined]
        event = _WRITE_EVENTS.get(sys._getframe(1).f_code.co_name)
        if event is not None:
            emit_eagerly(self, event, tensordict, index)
