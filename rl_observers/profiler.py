"""ProfilerObserver: ``torch.profiler`` over chosen rollouts, as one observer among others.

:func:`install_profiling` (run by ``import rl_observers``) makes torchrl's
``enable_profile()`` / ``disable_profile()`` attach and detach one instead
of taking the ``post_collect_hook`` slot. See :doc:`migration`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerAction
from torchrl._utils import accept_remote_rref_invocation
from torchrl._utils import logger as torchrl_logger
from torchrl.collectors import BaseCollector, MultiCollector, ProfileConfig

from rl_observers.observer import Observer
from rl_observers.remote.ray.observed import send_file_to_driver
from rl_observers.sources import observers_of, source_info

__all__ = ["ProfilerObserver", "disable_profile", "enable_profile"]

_IDLE, _RUNNING, _DONE = "idle", "running", "done"
# torch.profiler supports one profile per process (two at once crash Kineto): the
# (process id, observer) profiling here, if any. The pid makes a forked copy free.
_PROCESS_SLOT: list[tuple[int, Any] | None] = [None]
_PROCESS_SLOT_LOCK = threading.Lock()
_UNSET: Any = object()
#: The profiling options of ``enable_profile`` and :class:`ProfilerObserver`, with torchrl's defaults
#: (read from torchrl's ``enable_profile``, before :func:`install_profiling` replaces it).
CONFIG_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(BaseCollector.enable_profile).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY and not name.startswith("_")
}
CONFIG_KEYS: tuple[str, ...] = tuple(CONFIG_DEFAULTS)
#: :class:`ProfilerObserver`'s defaults: torchrl's without Python stacks (traces ~8x smaller).
OBSERVER_DEFAULTS: dict[str, Any] = {**CONFIG_DEFAULTS, "with_stack": False}


def _make_config(values: dict[str, Any]) -> ProfileConfig:
    """Builds a :class:`ProfileConfig` exactly as ``BaseCollector.enable_profile`` does."""
    defaults = {"workers": [0], "activities": ["cpu", "cuda"]}
    return ProfileConfig(**{k: defaults[k] if v is None and k in defaults else v for k, v in values.items()})


def _rollout_schedule(config: ProfileConfig) -> Callable[[int], ProfilerAction]:
    """``torch.profiler`` schedule: skip, one warm-up step, then record until ``num_rollouts``.

    Unlike ``schedule(warmup=0)`` it does not warn, and it warms up during the
    last skipped rollout so the first recorded one does not pay for it.
    """
    skip, last = config.warmup_rollouts, config.num_rollouts - 1

    def action(step: int) -> ProfilerAction:
        if step < skip - 1 or step > last:
            return ProfilerAction.NONE
        if step < skip:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD if step < last else ProfilerAction.RECORD_AND_SAVE

    return action


def _recorded(fn: Callable[..., Any], observer: Any, event: str) -> Callable[..., Any]:
    # an observer object is named after its class, a plain function after itself
    owner = getattr(observer, "__name__", None) or type(observer).__name__
    name = f"rl_observers/{owner}.on_{event}"

    def call(source: Any, *payload: Any) -> Any:
        with record_function(name):
            return fn(source, *payload)

    return call


class ProfilerObserver(Observer):
    """Profiles whole collector rollouts with :mod:`torch.profiler`, next to any other observers.

    torchrl's ``enable_profile()`` without taking the ``post_collect_hook`` slot.
    It runs where collection runs (a collector that is nobody's worker is worker
    ``0``); each recorded rollout is one ``ProfilerStep#k`` covering every
    observer's work on it. One profile runs per process: a second one warns and
    does not profile. See :doc:`migration`.

    Args:
        config (ProfileConfig, optional): a ready-made configuration; give
            either it or the keywords that build one: ``with_stack`` below and
            the other fields of torchrl's ``ProfileConfig``, with its defaults.

    Keyword Args:
        with_stack (bool, optional): record Python stacks (traces about 8x
            larger). Defaults to ``False``, unlike torchrl.
        record_observers (bool, optional): time each other observer in a
            range ``rl_observers/<ObserverClass>.on_<event>``. Defaults to
            ``False``.
        start_after_frames (int, optional): frames this copy's source collects
            before the profiler starts. Defaults to ``0``.
        start_after_batches (int, optional): likewise, in batches. Defaults
            to ``0``.
        start_when (Callable, optional): ``start_when(source) -> bool``,
            checked before each rollout and after each batch. Defaults to ``None``.

    Raises:
        TypeError: if ``config`` is not a :class:`ProfileConfig`, or comes
            with configuration keywords.
        ValueError: if ``num_rollouts <= warmup_rollouts``,
            ``warmup_rollouts < 0``, or a ``start_after_*`` is not a
            non-negative int.

    Examples:
        >>> import json, tempfile
        >>> import rl_observers
        >>> from rl_observers import ProfilerObserver
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> env = CountingEnv()
        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=40)
        >>> path = tempfile.mkdtemp() + "/trace_{worker_idx}.json"
        >>> profiler = ProfilerObserver(
        ...     num_rollouts=3, warmup_rollouts=1, save_path=path,
        ...     activities=["cpu"], with_stack=False, record_observers=True,
        ... )
        >>> class Frames:
        ...     frames = 0
        ...     def on_post_collect(self, source, batch):
        ...         self.frames += batch.numel()
        >>> _ = collector.add_observer(profiler)
        >>> _ = collector.add_observer(Frames())  # runs inside the profiled steps
        >>> for batch in collector:
        ...     pass
        >>> profiler.trace_path.name
        'trace_0.json'
        >>> events = json.loads(profiler.trace_path.read_text())["traceEvents"]
        >>> sorted({e["name"] for e in events if e["name"].startswith(("ProfilerStep", "rl_observers"))})
        ['ProfilerStep#1', 'ProfilerStep#2', 'rl_observers/Frames.on_post_collect']
        >>> collector.shutdown()

        Profile training, not the warm-up: start after 16 frames of this collector.

        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=64)
        >>> profiler = ProfilerObserver(
        ...     num_rollouts=2, warmup_rollouts=1, save_path=path, activities=["cpu"],
        ...     with_stack=False, start_after_frames=16,
        ... )
        >>> class Profiled:  # whether each rollout starts inside the profiler's window
        ...     seen = []
        ...     def on_pre_collect(self, source):
        ...         self.seen.append(profiler.active)
        >>> _ = collector.add_observer(profiler)
        >>> _ = collector.add_observer(Profiled())
        >>> for batch in collector:
        ...     pass
        >>> Profiled.seen  # rollouts 2 (warm-up) and 3 (recorded): not the first 16 frames
        [False, False, True, True, False, False, False, False]
        >>> collector.shutdown()
    """

    # (see attached; a copy in a worker never has them)
    _workers_attached: tuple[int, ...] = ()
    _attached_at: float | None = None

    def __init__(
        self,
        config: ProfileConfig | None = None,
        *,
        workers: list[int] | None = _UNSET,
        num_rollouts: int = _UNSET,
        warmup_rollouts: int = _UNSET,
        save_path: str | Path | None = _UNSET,
        activities: list[str] | None = _UNSET,
        record_shapes: bool = _UNSET,
        profile_memory: bool = _UNSET,
        with_stack: bool = _UNSET,
        with_flops: bool = _UNSET,
        on_trace_ready: Callable[[Any], None] | None = _UNSET,
        record_observers: bool = False,
        start_after_frames: int = 0,
        start_after_batches: int = 0,
        start_when: Callable[[Any], bool] | None = None,
    ) -> None:
        options = locals()
        given = {key: options[key] for key in CONFIG_KEYS if options[key] is not _UNSET}
        if config is None:
            config = _make_config({**OBSERVER_DEFAULTS, **given})
        elif not isinstance(config, ProfileConfig):
            raise TypeError(
                f"ProfilerObserver expects a torchrl ProfileConfig as config, got {config!r} "
                f"of type {type(config).__name__}."
            )
        elif given:
            raise TypeError(
                "ProfilerObserver takes either a ProfileConfig or configuration keywords, "
                f"not both; got a config and {', '.join(sorted(given))}."
            )
        for name in ("start_after_frames", "start_after_batches"):
            value = options[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ProfilerObserver: {name} must be a non-negative int, got {value!r}.")
        if start_when is not None and not callable(start_when):
            raise TypeError(
                f"ProfilerObserver: start_when must be a callable taking the source, got {start_when!r}."
            )
        self.config = config
        self.record_observers = bool(record_observers)
        self.start_after_frames = start_after_frames
        self.start_after_batches = start_after_batches
        self.start_when = start_when
        self._reset()

    def _reset(self) -> None:
        """The per-process state: nothing started (also what a pickled copy starts from)."""
        self._lock = threading.Lock()
        self._state = _IDLE
        self._profiler: torch.profiler.profile | None = None
        self._observers: Any = None  # the source's observer list, while our transform is in it
        self._steps = 0
        self._worker_idx: int | None = None
        self._trace_path: Path | None = None
        self._frames_seen = 0  # before the profiler starts: what start_after_* count
        self._batches_seen = 0
        self._start_requested = False

    @property
    def active(self) -> bool:
        """Whether this copy's profiler is running (recording or about to)."""
        return self._state == _RUNNING

    @property
    def trace_path(self) -> Path | None:
        """The trace this copy wrote (``None`` before, with ``on_trace_ready``, or on a driver whose workers profile)."""
        return self._trace_path

    @property
    def trace_paths(self) -> dict[int, Path]:
        """``{worker_idx: path}`` of the traces written since the observer was attached, as far as this process knows.

        A ``RayCollector``'s appear once the driver wrote them back (at removal or shutdown).
        """
        if self._trace_path is not None:
            return {self._worker_idx or 0: self._trace_path}
        if self.config.on_trace_ready is not None or self._attached_at is None:
            return {}
        paths = {}
        for idx in filter(self.config.should_profile_worker, self._workers_attached):
            path = self.config.get_save_path(idx)
            with contextlib.suppress(OSError):  # not written
                if path.stat().st_mtime >= self._attached_at:
                    paths[idx] = path
        return paths

    def attached(self, source: Any) -> None:
        """Notes the source's workers and the time, for :attr:`trace_paths`."""
        count = getattr(source, "num_workers", None)  # multiprocessing collectors
        if not isinstance(count, int):
            count = getattr(source, "num_collectors", None)  # RayCollector
        self._workers_attached = tuple(range(count if isinstance(count, int) and count > 0 else 1))
        self._attached_at = time.time() - 1.0  # (file times have coarse resolution on some systems)

    prepare_copies = attached  # on the driver, before copies start in the target's workers

    def start(self) -> None:
        """Starts this copy's profiler at the next event, whatever ``start_after_*`` and ``start_when`` say.

        In-process only (copies in workers are not reached: use ``start_when``).
        """
        self._start_requested = True

    def stop(self) -> None:
        """Stops this copy's profiler now, writing what it recorded; idempotent."""
        with self._lock:
            self._finish()

    def on_pre_collect(self, source: Any) -> None:
        if self._state == _IDLE and self._may_start(source):
            self._start(source)

    def on_post_collect(self, source: Any, batch: Any) -> None:
        state = self._state
        if state == _RUNNING:
            with self._lock:
                if self._state != _RUNNING:
                    return
                self._steps += 1
                if self._steps >= self.config.num_rollouts:
                    self._finish()
                else:
                    self._profiler.step()  # type: ignore[union-attr]
        elif state == _IDLE:
            # counted before starting: the profiled rollouts are the ones after the threshold
            self._frames_seen += batch.numel()
            self._batches_seen += 1
            if self._may_start(source):  # also: attached between a pre_collect and its batch
                self._start(source)

    def _may_start(self, source: Any) -> bool:
        """Whether the profiler starts now: ``start()`` was called, or every start condition holds."""
        if self._start_requested:
            return True
        if self._frames_seen < self.start_after_frames or self._batches_seen < self.start_after_batches:
            return False
        return self.start_when is None or bool(self.start_when(source))

    def on_shutdown(self, source: Any) -> None:
        self.stop()

    detached = on_shutdown

    def _start(self, source: Any) -> None:
        with self._lock:
            if self._state != _IDLE:
                return
            self._state = _DONE  # unless everything below succeeds
            idx = source_info(source).worker
            if idx is None:  # else the collector's own worker_idx, if any
                idx = getattr(source, "worker_idx", None)
                idx = idx if isinstance(idx, int) else None
            if idx is not None and not self.config.should_profile_worker(idx):
                return
            self._worker_idx = 0 if idx is None else idx
            activities = self.config.get_activities()
            if not activities:
                torchrl_logger.warning(
                    f"ProfilerObserver [worker {self._worker_idx}]: none of the activities "
                    f"{self.config.activities!r} is available here; not profiling."
                )
                return
            if not self._claim_process():
                return
            try:
                profiler = torch.profiler.profile(
                    activities=activities,
                    schedule=_rollout_schedule(self.config),
                    on_trace_ready=self.config.on_trace_ready or self._export,
                    record_shapes=self.config.record_shapes,
                    profile_memory=self.config.profile_memory,
                    with_stack=self.config.with_stack,
                    with_flops=self.config.with_flops,
                )
                profiler.start()
            except BaseException:
                self._release_process()
                raise
            self._profiler = profiler
            self._steps = 0
            self._state = _RUNNING
            # this observer's step boundary moves last among the source's observers
            observers = observers_of(source)
            if getattr(observers, "set_call_transform", None) is None:
                return
            if observers.call_transform is not None:
                torchrl_logger.warning(
                    f"ProfilerObserver: {type(source).__name__} already has a call transform "
                    f"({observers.call_transform!r}); profiler steps end at the profiler's "
                    "registration position and observers are not recorded."
                )
                return
            observers.set_call_transform(self._transform)
            self._observers = observers

    def _finish(self) -> None:
        """Stops the profiler (writing its trace if it recorded) and restores the call tuples."""
        if self._state == _DONE:
            return
        self._state = _DONE
        profiler, self._profiler = self._profiler, None
        try:
            if profiler is not None:
                profiler.stop()
        finally:
            self._release_process()
            observers, self._observers = self._observers, None
            if observers is not None and observers.call_transform == self._transform:
                observers.set_call_transform(None)

    def _claim_process(self) -> bool:
        """Takes this process's profiler slot; warns and returns False if another profiler has it."""
        pid = os.getpid()
        with _PROCESS_SLOT_LOCK:
            holder = _PROCESS_SLOT[0]
            other = repr(holder[1]) if holder is not None and holder[0] == pid else None
            if other is None and torch.autograd._profiler_enabled():
                other = "a torch profiler started outside rl_observers"
            if other is None:
                _PROCESS_SLOT[0] = (pid, self)
                return True
        torchrl_logger.warning(
            f"ProfilerObserver [worker {self._worker_idx}]: {other} is already profiling in "
            "this process, and torch.profiler runs one profile per process; this one does not "
            "profile. Profile one collector per process at a time."
        )
        return False

    def _release_process(self) -> None:
        with _PROCESS_SLOT_LOCK:
            holder = _PROCESS_SLOT[0]
            if holder is not None and holder[1] is self:
                _PROCESS_SLOT[0] = None

    def _export(self, profiler: torch.profiler.profile) -> None:
        path = self.config.get_save_path(self._worker_idx or 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        self._trace_path = path
        torchrl_logger.info(f"Profiler [worker {self._worker_idx}]: trace saved to {path}")
        try:  # from a Ray actor: the driver writes it under the same path (nodes share no files)
            send_file_to_driver(path)
        except OSError as error:
            torchrl_logger.warning(
                f"Profiler [worker {self._worker_idx}]: could not send {path} to the driver ({error}); "
                "the trace stays on this node."
            )

    def _transform(
        self, event: str, calls: tuple[tuple[Callable[..., Any], Any], ...]
    ) -> Iterable[tuple[Callable[..., Any], Any]]:
        """Moves this observer's step boundary last and, if asked, times the other observers."""
        out, boundary = [], []
        for fn, entry in calls:
            if entry.observer is self:
                (boundary if event == "post_collect" else out).append((fn, entry))
            elif self.record_observers:
                out.append((_recorded(fn, entry.observer, event), entry))
            else:
                out.append((fn, entry))
        return out + boundary

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        c = self.config
        start = "".join(f"{name}={getattr(self, name)!r}, " for name in _PICKLED[2:] if getattr(self, name))
        return (
            f"{type(self).__name__}(workers={c.workers!r}, num_rollouts={c.num_rollouts}, "
            f"warmup_rollouts={c.warmup_rollouts}, save_path={c.save_path!r}, {start}state={self._state!r})"
        )


# What a copy of a ProfilerObserver takes to its new process; the rest starts from scratch there.
_PICKLED = ("config", "record_observers", "start_after_frames", "start_after_batches", "start_when")


_ORIGINALS: dict[str, Any] = {}
_INSTALL_LOCK = threading.Lock()


def enable_profile(
    self: BaseCollector,
    *,
    workers: list[int] | None = None,
    num_rollouts: int = 3,
    warmup_rollouts: int = 1,
    save_path: str | Path | None = None,
    activities: list[str] | None = None,
    record_shapes: bool = True,
    profile_memory: bool = False,
    with_stack: bool = True,
    with_flops: bool = False,
    on_trace_ready: Callable[[Any], None] | None = None,
) -> None:
    """Enables profiling of collector rollouts by attaching a :class:`ProfilerObserver`.

    torchrl's signature, errors and ``profile_config``, but it never evicts a user
    hook or another observer; calling it again replaces the profiler. The arguments
    are :class:`ProfilerObserver`'s, ``with_stack`` defaulting to ``True`` as in torchrl.

    Raises:
        RuntimeError: if iteration over the collector has started, or the
            workers of a multi-process collector are not running.
        ValueError: if ``num_rollouts <= warmup_rollouts`` or ``warmup_rollouts < 0``.

    Examples:
        >>> import tempfile
        >>> import rl_observers
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs.utils import RandomPolicy
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> env = CountingEnv()
        >>> collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=8, total_frames=32)
        >>> sizes = []
        >>> collector.post_collect_hook = lambda batch: sizes.append(batch.numel())
        >>> collector.enable_profile(
        ...     num_rollouts=2, warmup_rollouts=1, activities=["cpu"], with_stack=False,
        ...     save_path=tempfile.mkdtemp() + "/trace_{worker_idx}.json",
        ... )
        >>> [type(observer).__name__ for observer in collector.observers]
        ['ProfilerObserver']
        >>> for batch in collector:
        ...     pass
        >>> sizes  # the user's hook ran on every batch, profiled or not
        [8, 8, 8, 8]
        >>> collector.disable_profile()
        >>> collector.observers, collector.post_collect_hook is not None
        ((), True)
        >>> collector.shutdown()
    """
    if getattr(self, "_iteration_started", False):
        raise RuntimeError(
            "Cannot enable profiling after iteration has started. "
            "Call enable_profile() before iterating over the collector."
        )
    options = locals()
    config = _make_config({key: options[key] for key in CONFIG_KEYS})
    if isinstance(self, MultiCollector) and (not hasattr(self, "pipes") or getattr(self, "closed", True)):
        raise RuntimeError(
            "MultiCollector workers are not running; call enable_profile() "
            "before close()/shutdown()."
        )
    _detach_profiler(self)
    observer = ProfilerObserver(config)
    self.add_observer(observer)  # type: ignore[attr-defined]
    self._rl_profiler = observer  # type: ignore[attr-defined]
    self._profile_config = config


def disable_profile(self: BaseCollector) -> None:
    """Stops profiling and detaches the profiler (a no-op if none); user hooks and other observers stay."""
    if self._profile_config is None:
        return
    _detach_profiler(self)  # a collector refusing the removal now (being iterated) keeps both
    self._profile_config = None


def _detach_profiler(collector: BaseCollector) -> None:
    """Removes the profiler ``enable_profile`` attached; forgets it only once it is removed."""
    observer = collector.__dict__.get("_rl_profiler")
    if observer is not None and any(o is observer for o in collector.observers):  # type: ignore[attr-defined]
        collector.remove_observer(observer)  # type: ignore[attr-defined]
    collector.__dict__.pop("_rl_profiler", None)


def _wraps(fn: Any, target: Any) -> bool:
    """Whether ``fn`` is ``target`` or a ``functools.wraps`` chain ending at it."""
    while fn is not None:
        if fn is target:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _subclasses(cls: type) -> Iterable[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def install_profiling() -> None:
    """Makes every torchrl collector's ``enable_profile()`` / ``disable_profile()`` use observers; idempotent.

    Also replaces the copies torchrl makes of them in its collector classes, keeping their RPC wrapper.
    """
    with _INSTALL_LOCK:
        if _ORIGINALS:
            return
        replacements = {"enable_profile": enable_profile, "disable_profile": disable_profile}
        originals = {name: BaseCollector.__dict__[name] for name in replacements}
        for cls in (BaseCollector, *_subclasses(BaseCollector)):
            for name, replacement in replacements.items():
                own = cls.__dict__.get(name)
                if own is None or not _wraps(own, originals[name]):
                    continue  # inherited, or the class's own override: leave it alone
                if own is not originals[name]:
                    replacement = accept_remote_rref_invocation(replacement)
                setattr(cls, name, replacement)
        _ORIGINALS.update(originals)
