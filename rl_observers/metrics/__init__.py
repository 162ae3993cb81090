"""Metric sets: what a :class:`~rl_observers.LoggerObserver` folds and logs.

A metric set has the event methods of an observer (``on_post_collect``,
``on_post_add``, ``on_post_extend``, ``on_post_sample``) and folds what it sees
into reducers (:mod:`rl_observers.stats`), on the data's device and without
waiting for it. Besides the events it offers:

* :meth:`MetricSet.counters`: cumulative host-side counters (``frames``,
  ``batches``, ``episodes``, ``write_count``, ``sample_calls``, ...) for
  counter schedules such as ``Every.counter("frames", 10_000)``;
* :meth:`MetricSet.pull`: closes the current window in **one** device-to-host
  transfer and returns its partials (:class:`~rl_observers.stats.Partial`,
  merged exactly across workers by the channel) and cumulative gauges
  (floats); a payload's logged names are the keys of its float entries and
  the keys of each partial's :meth:`~rl_observers.stats.Partial.finalize`;
* :meth:`MetricSet.stats`: entries for the target's ``stats()``;
* :meth:`MetricSet.state_dict` / :meth:`MetricSet.load_state_dict`:
  cumulative counters and in-flight accumulators, so a resumed run neither
  double-counts nor loses an episode.

Configuration is validated at construction; keys a source's specs prove
absent are refused when the observer is attached
(:meth:`MetricSet.check_keys`: the key, the keys present, the closest
match); keys are resolved at the first batch, and a missing key raises a
:class:`KeyError` naming the key, the keys present and the argument to change
(a LoggerObserver reports it for that set alone, per its ``on_error`` policy,
and its other sets keep logging; :class:`CollectorBatchMetrics` stops only
the metrics that need a key its first batch lacks, and says which).

Counters that depend on tensor values (``episodes``, and ``frames`` of masked
``trajs_per_batch`` batches) are *observed, not exact*: on CPU they are read
at once; on CUDA the value is copied without blocking to pinned memory and
added at a later event, once its CUDA event has completed, so such a counter
may lag by a batch or so. They are exact again after every :meth:`pull`.

Modules: :mod:`~rl_observers.metrics.base` (:class:`MetricSet`),
:mod:`~rl_observers.metrics.oneliners` (:class:`Mean`, :class:`Gauge`, ...:
one more number in one line), :mod:`~rl_observers.metrics.histogram`,
:mod:`~rl_observers.metrics.quantiles`,
:mod:`~rl_observers.metrics.policy_lag`, :mod:`~rl_observers.metrics.source`
(the source's own counters, :class:`StatsProvider`),
:mod:`~rl_observers.metrics.collector` (:class:`CollectorBatchMetrics`, whose
fold paths are modules of that package),
:mod:`~rl_observers.metrics.samples` (:class:`SampleMetrics`),
:mod:`~rl_observers.metrics.priorities` (what a prioritized sampler stores
for the sampled items: :func:`stored_priorities`),
:mod:`~rl_observers.metrics.writes` (:class:`WriteMetrics`),
:mod:`~rl_observers.metrics.keys` (key checks, missing-key errors, the keys
of a source's env) and :mod:`~rl_observers.metrics.storage` (replay-buffer
storage, writer and index helpers).
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
