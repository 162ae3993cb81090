"""TrainingMetrics: values of the training loop (losses, gradient norms, learning rates) in one line."""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from typing import Any

import torch

from rl_observers.channel import MetricsChannel
from rl_observers.channel.payload import coalesce
from rl_observers.logging.defaults import is_handle
from rl_observers.stats import Moments, Partial, ReducerBank, Scalar

__all__ = ["TRAINING_RULES", "TrainingMetrics"]

#: How :class:`TrainingMetrics` reduces a name over a window (and across ranks).
TRAINING_RULES: tuple[str, ...] = ("mean", "sum", "min", "max", "latest", "summary")
# The moments each rule folds: a summary's are logged as they are, the others' give one number.
_MOMENTS = ("count", "mean", "min", "max")
_STATS = {"summary": ("mean", "std", "min", "max")}


def _reduced(name: str, rule: str, moments: Moments) -> Partial:
    """A window's moments as ``rule`` logs them: the summary's moments, else one exact scalar."""
    if rule == "summary":
        return moments
    value = moments.sum if rule in ("mean", "sum") else getattr(moments, rule)
    return Scalar(name, rule, value, count=moments.count)


class TrainingMetrics:
    """Records values from the training loop and logs them once per window, without a sync.

    A tensor is folded on its device, a number on the host; when ``step`` reaches
    the next multiple of ``every`` the window is copied to the host in one
    non-blocking transfer. Rules per name: ``"mean"`` (default), ``"sum"``,
    ``"min"``, ``"max"``, ``"summary"`` (``_mean``, ``_std``, ``_min``, ``_max``)
    and ``"latest"`` (host numbers only). Under ``torch.distributed`` with
    ``merge_ranks=True`` rank 0 logs the ranks' exact merge; see :doc:`training`.

    Args:
        channel (MetricsChannel, MetricsHandle, Logger or None): where rows
            go (a logger gets its shared channel); ``None`` only on ranks
            other than 0 when ranks are merged.

    Keyword Args:
        every (int, optional): the window, on the step axis. Defaults to ``100``.
        namespace (str, optional): Defaults to ``"train"``.
        reduce (Mapping[str, str], optional): a rule per name. Defaults to
            ``None`` (all ``"mean"``).
        merge_ranks (bool, optional): merge ranks at rank 0 (else each logs
            ``<namespace>/rank_<r>``). Defaults to ``True``.

    Examples:
        >>> import tempfile, torch
        >>> from torchrl.record import CSVLogger
        >>> from rl_observers import MetricsChannel, TrainingMetrics
        >>> logger = CSVLogger(exp_name="train", log_dir=tempfile.mkdtemp())
        >>> channel = MetricsChannel(logger, background=False)
        >>> train = TrainingMetrics(channel, every=2, reduce={"grad_norm": "max", "lr": "latest"})
        >>> for step, loss in enumerate([4.0, 2.0, 1.0, 3.0], start=1):
        ...     train.record(step, loss=torch.tensor(loss), grad_norm=torch.tensor(loss * 10), lr=1e-3 / step)
        >>> channel.step()
        2
        >>> logger.experiment.scalars["train/loss"], logger.experiment.scalars["train/grad_norm"]
        ([(2, 3.0), (4, 2.0)], [(2, 40.0), (4, 30.0)])
        >>> logger.experiment.scalars["train/lr"]
        [(2, 0.0005), (4, 0.00025)]
        >>> train.close(); channel.close()
        True
    """

    def __init__(
        self,
        channel: Any,
        *,
        every: int = 100,
        namespace: str = "train",
        reduce: Mapping[str, str] | None = None,
        merge_ranks: bool = True,
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"TrainingMetrics: every must be a positive int, got {every!r}.")
        if not isinstance(namespace, str):
            raise TypeError(f"TrainingMetrics: namespace must be a str, got {namespace!r}.")
        self.rules = dict(reduce or {})
        for name, rule in self.rules.items():
            if rule not in TRAINING_RULES:
                raise ValueError(
                    f"TrainingMetrics: the rule of {name!r} must be one of {TRAINING_RULES}, got {rule!r}."
                )
        self.every = every
        distributed = torch.distributed
        initialized = distributed.is_available() and distributed.is_initialized()
        self.rank, self.world = (distributed.get_rank(), distributed.get_world_size()) if initialized else (0, 1)
        self.merge_ranks = bool(merge_ranks) and self.world > 1
        if self.world > 1 and not self.merge_ranks:
            namespace = f"{namespace}/rank_{self.rank}" if namespace else f"rank_{self.rank}"
        self.namespace = namespace
        if channel is not None and not (isinstance(channel, MetricsChannel) or is_handle(channel)):
            channel = MetricsChannel.for_logger(channel)
        if channel is None and not (self.merge_ranks and self.rank != 0):
            raise ValueError(
                "TrainingMetrics: channel may be None only on ranks other than 0 when ranks are "
                f"merged (this is rank {self.rank} of {self.world}); pass a MetricsChannel or a logger."
            )
        self.channel = channel
        self._lock = threading.Lock()
        self._bank = ReducerBank()
        self._folds: dict[str, Any] = {}  # name -> the fold of its device reducer
        self._host: dict[str, list[float]] = {}  # name -> its host numbers in the window
        self._slots: list[_DeviceSlots] = []
        self._due = every
        self._last_step: int | None = None
        self._pending: collections.deque[tuple[int, Any, dict[str, Partial]]] = collections.deque()
        self._closed = False
        if isinstance(channel, MetricsChannel):  # held weakly; a handle's channel closes elsewhere
            channel._logging.add_close_callback(self.close)

    def record(self, step: int, /, **values: Any) -> None:
        """Folds ``values`` (name -> tensor or real number) at ``step`` (rising); closes the window when due."""
        with self._lock:
            if self._pending:
                self._deliver(wait=False)
            if self._closed:
                raise RuntimeError(f"{self!r} is closed; record before close().")
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    fold = self._folds.get(name) or self._device_fold(name)
                    fold(value)
                else:
                    self._host.setdefault(name, []).append(float(value))
            self._last_step = step
            if step >= self._due:
                self._close_window(step)

    def flush(self) -> None:
        """Closes the current window and submits every window copied, waiting for copies in flight.

        A collective under merged ranks: call it on every rank.
        """
        with self._lock:
            if self._last_step is not None and (self._host or (self._folds and self._bank.device is not None)):
                self._close_window(self._last_step)
            self._deliver(wait=True)

    def close(self) -> None:
        """:meth:`flush`, then refuses further records. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True

    def __enter__(self) -> TrainingMetrics:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TrainingMetrics(namespace={self.namespace!r}, every={self.every})"

    def _rule(self, name: str) -> str:
        return self.rules.get(name, "mean")

    def _device_fold(self, name: str) -> Any:
        rule = self._rule(name)
        if rule == "latest":
            raise TypeError(
                f"TrainingMetrics: {name!r} has rule 'latest', which keeps host numbers only "
                "(keeping the last tensor would need a transfer of its own); pass a float, or "
                "use 'mean' or 'max'."
            )
        slots = _DeviceSlots(self._bank.moments(name, stats=_STATS.get(rule, _MOMENTS)))
        self._slots.append(slots)
        fold = self._folds[name] = slots.fold
        return fold

    def _close_window(self, step: int) -> None:
        for slots in self._slots:
            slots.reduce()
        host: dict[str, Partial] = {}
        for name, values in self._host.items():
            rule = self._rule(name)
            if rule == "latest" and values:
                host[name] = Scalar(name, "latest", values[-1], stamp=0.0)
            elif values:
                moments = Moments.from_values(name, values, stats=_STATS.get(rule, _MOMENTS))
                host[name] = _reduced(name, rule, moments)
            values.clear()
        self._pending.append((step, self._bank.copy_out(), host))
        self._due = (step // self.every + 1) * self.every
        self._deliver(wait=self.merge_ranks)  # the collective waits for this window's copy

    def _payload(self, copy: Any, host: dict[str, Partial]) -> dict[str, Partial]:
        payload: dict[str, Any] = {}
        for name, partial in copy.partials().items():
            if partial.count:
                payload[name] = _reduced(name, self._rule(name), partial)
        coalesce(payload, host)
        return payload

    def _deliver(self, *, wait: bool) -> None:
        pending = self._pending
        while pending:
            step, copy, host = pending[0]
            if not wait and not copy.ready():
                return
            pending.popleft()
            payload = self._payload(copy, host)
            if self.merge_ranks:  # every rank's payload merged exactly at rank 0; a collective
                gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
                torch.distributed.gather_object(payload, gathered, dst=0)
                if self.rank != 0:
                    continue
                payload = {}
                for part in gathered:  # type: ignore[union-attr]
                    coalesce(payload, part)
            if payload:
                self.channel.submit_metrics(payload, step=step, namespace=self.namespace)


class _DeviceSlots:
    """One-element tensors of a name, copied into a device buffer (one ``copy_`` per step), reduced when full or at close."""

    __slots__ = ("reducer", "buffer", "views", "used")
    size = 256

    def __init__(self, reducer: Any) -> None:
        self.reducer = reducer
        self.buffer: torch.Tensor | None = None
        self.views: tuple[torch.Tensor, ...] = ()
        self.used = 0

    def fold(self, value: torch.Tensor) -> None:
        if value.numel() != 1 or value.is_complex():
            self.reducer.fold(value, staged=False)  # (the reducer refuses complex values)
            return
        if value.requires_grad:
            value = value.detach()
        used = self.used
        if used == len(self.views):
            self.reduce()
            if self.buffer is None or self.buffer.device != value.device:
                self.buffer = torch.empty(self.size, dtype=torch.float64, device=value.device)
                self.views = self.buffer.unbind(0)
            used = 0
        self.views[used].copy_(value.reshape(()))
        self.used = used + 1

    def reduce(self) -> None:
        used = self.used
        if used:
            self.used = 0
            self.reducer.fold(self.buffer[:used], staged=used == self.size)  # type: ignore[index]

