"""CollectorBatchMetrics and its fold paths (``from_keys``, ``ring``, ``interleaved``), one module each."""

from rl_observers.metrics.collector.batch_metrics import CollectorBatchMetrics

__all__ = ["CollectorBatchMetrics"]
