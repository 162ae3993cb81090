"""``attach_logger``: a LoggerObserver on a collector or replay buffer in one line.

Step of the flow: **source → observer** (source → observer → channel →
logger): :func:`install_attach_logger` adds :func:`attach_logger` to
torchrl's collectors and replay buffers when ``rl_observers`` is imported.
"""

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

    Metrics default to those fitting the source (:func:`default_metrics`),
    the schedule to one that does not flood (``"auto"``: every 1,000 frames
    on a collector, every 100 ``sample()`` calls on a replay buffer, see
    :func:`default_schedule`), the namespace to ``"collector"`` or
    ``"replay_buffer"``. Returns the same handle as :meth:`add_observer`.

    Args:
        logger (Logger | MetricsChannel | MetricsHandle): where the metrics go.

    Keyword Args:
        schedule (Every | str, optional): see :class:`LoggerObserver`.
            Defaults to ``"auto"``.
        metrics (MetricSet | Sequence[MetricSet], optional): see :class:`LoggerObserver`.
        name (str, optional): see :class:`LoggerObserver`.
        **kwargs: the other keyword arguments of :class:`LoggerObserver`.

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
