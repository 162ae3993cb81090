"""Metric sets: what a :class:`~rl_observers.LoggerObserver` folds and logs.

Step **observer** of the flow. A metric set has an observer's event
methods and folds what it sees into reducers (:mod:`rl_observers.stats`)
on the data's device; :meth:`MetricSet.counters` feeds counter schedules,
:meth:`MetricSet.pull` closes a window in one transfer, and the state
methods make a resumed run neither double-count nor lose an episode.
Counters fed by tensor values (``episodes``) may lag by a batch on CUDA
and are exact again after every pull. See :ref:`metric-names` and
:doc:`custom`.
"""

from rl_observers.metrics.base import MetricSet
from rl_observers.metrics.collector import CollectorBatchMetrics
from rl_observers.metrics.health import WorkerHealth
from rl_observers.metrics.histogram import Histogram
from rl_observers.metrics.oneliners import (
    CountTrue,
    Gauge,
    Max,
    Mean,
    Metric,
    Min,
    Rate,
    Ratio,
    Sum,
    Summary,
)
from rl_observers.metrics.policy_lag import PolicyLag
from rl_observers.metrics.priorities import stored_priorities
from rl_observers.metrics.quantiles import Quantiles
from rl_observers.metrics.samples import SampleMetrics
from rl_observers.metrics.source import StatsProvider
from rl_observers.metrics.writes import WriteMetrics

__all__ = [
    "CollectorBatchMetrics",
    "CountTrue",
    "Gauge",
    "Histogram",
    "Max",
    "Mean",
    "Metric",
    "MetricSet",
    "Min",
    "PolicyLag",
    "Quantiles",
    "Rate",
    "Ratio",
    "SampleMetrics",
    "StatsProvider",
    "Sum",
    "Summary",
    "WorkerHealth",
    "WriteMetrics",
    "stored_priorities",
]
