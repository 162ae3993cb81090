"""CollectorBatchMetrics (:mod:`~.batch_metrics`) and its fold paths, one module each.

:mod:`~.plan` resolves keys, :mod:`~.reducers` holds what a batch folds
into; the paths are :mod:`~.from_keys`, :mod:`~.ring` and
:mod:`~.interleaved`; :mod:`~.window` keeps the last ``N`` episodes.
"""

from rl_observers.metrics.collector.batch_metrics import CollectorBatchMetrics

__all__ = ["CollectorBatchMetrics"]
