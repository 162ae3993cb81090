"""``attach_logger``: a LoggerObserver on a collector or replay buffer in one line (added when ``rl_observers`` is imported)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from torchrl.collectors import BaseCollector
from torchrl.record.loggers.monitoring import Every

from rl_observers.logging.observer import LoggerObserver
from rl_observers.metrics import MetricSet

__all__ = ["attach_logger", "install_attach_logger"]


def attach_logger(
    self: Any,
    logger: Any,
    *,
    schedule: Every | Literal["auto"] | None = "auto",
    metrics: MetricSet | Iterable[MetricSet] | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Logs this source's metrics: ``add_observer(LoggerObserver(logger, ...))`` in one line.

    Defaults fit the source (:func:`default_metrics`, ``schedule="auto"``:
    :func:`default_schedule`); the keyword arguments are
    :class:`LoggerObserver`'s. Returns the handle of :meth:`add_observer`.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> import rl_observers
        >>> from rl_observers import Every
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl.record import CSVLogger
        >>> logger = CSVLogger(exp_name="sugar", log_dir=tempfile.mkdtemp())
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100))
        >>> handle = rb.attach_logger(logger, schedule=Every.counter("sample_calls", 2))
        >>> _ = rb.extend(torch.arange(10))
        >>> for _ in range(4):
        ...     _ = rb.sample(5)
        >>> handle.remove()
        >>> rl_observers.MetricsChannel.for_logger(logger).flush(timeout=10)
        True
        >>> [step for step, _ in logger.experiment.scalars["replay_buffer/samples_returned"]]
        [2, 4]
    """
    observer = LoggerObserver(logger, schedule=schedule, metrics=metrics, name=name, **kwargs)
    return self.add_observer(observer)


def install_attach_logger() -> None:
    """Adds :func:`attach_logger` to torchrl's collectors and replay buffers (idempotent)."""
    from torchrl.data import ReplayBuffer

    for cls in (BaseCollector, ReplayBuffer):
        cls.attach_logger = attach_logger  # type: ignore[attr-defined]
