"""rl_observers: event observers and data metrics for TorchRL collectors and replay buffers.

``import rl_observers`` adds ``add_observer``, ``remove_observer``,
``observers`` and ``attach_logger`` to every torchrl collector and replay
buffer, and makes ``collector.enable_profile()`` attach a
:class:`ProfilerObserver`.
"""

from __future__ import annotations

from torchrl.record.loggers.monitoring import Every

from rl_observers import signals
from rl_observers.channel import MetricsChannel
from rl_observers.logging.attach import install_attach_logger as _install_attach_logger
from rl_observers.logging.console import LiveConsole
from rl_observers.logging.defaults import default_metrics, default_schedule
from rl_observers.logging.histograms import draw_histograms
from rl_observers.logging.observer import LoggerObserver
from rl_observers.logging.training import TrainingMetrics
from rl_observers.metrics import (
    CollectorBatchMetrics,
    CountTrue,
    Gauge,
    Histogram,
    Max,
    Mean,
    Metric,
    MetricSet,
    Min,
    PolicyLag,
    Quantiles,
    Rate,
    Ratio,
    SampleMetrics,
    StatsProvider,
    Sum,
    Summary,
    WorkerHealth,
    WriteMetrics,
)
from rl_observers.observer import ON_ERROR_POLICIES, Observer, ObserverHandle, OnError
from rl_observers.profiler import ProfilerObserver
from rl_observers.profiler import install_profiling as _install_profiling
from rl_observers.remote import MetricsHandle
from rl_observers.sources.placement import SourceInfo, source_info
from rl_observers.targets import install as _install

_install()
_install_attach_logger()
_install_profiling()

__version__ = "0.1.0"

__all__ = [
    # observers
    "ON_ERROR_POLICIES",
    "Observer",
    "ObserverHandle",
    "OnError",
    "LoggerObserver",
    "ProfilerObserver",
    # the training loop
    "TrainingMetrics",
    # distributions
    "draw_histograms",
    # the console
    "LiveConsole",
    # metric sets
    "CollectorBatchMetrics",
    "MetricSet",
    "SampleMetrics",
    "StatsProvider",
    "WorkerHealth",
    "WriteMetrics",
    "default_metrics",
    # one-liners
    "CountTrue",
    "Gauge",
    "Histogram",
    "Max",
    "Mean",
    "Metric",
    "Min",
    "PolicyLag",
    "Quantiles",
    "Rate",
    "Ratio",
    "Sum",
    "Summary",
    # channel
    "MetricsChannel",
    "MetricsHandle",
    # schedule
    "Every",
    "default_schedule",
    # where a source runs, and its events
    "SourceInfo",
    "signals",
    "source_info",
]
