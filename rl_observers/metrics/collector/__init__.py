"""CollectorBatchMetrics and its fold paths, one module (and class) each.

* :mod:`~rl_observers.metrics.collector.batch_metrics`: the set itself, which
  resolves a batch's keys and hands each batch to its fold path;
* :mod:`~rl_observers.metrics.collector.plan`: the keys resolved at the first
  batch, layout helpers and the episodes in flight;
* :mod:`~rl_observers.metrics.collector.reducers`: what a batch is folded
  into (the set's reducers, counters and episode window), held by each fold
  path;
* :mod:`~rl_observers.metrics.collector.from_keys`: episodes read at closing
  steps from ``RewardSum`` / ``StepCounter`` entries;
* :mod:`~rl_observers.metrics.collector.ring`: running episode sums of
  ``[*B, T]`` batches, staged into a ring and summed a ring at a time;
* :mod:`~rl_observers.metrics.collector.split_trajs`: padded batches of split
  trajectories, carries matched by trajectory id;
* :mod:`~rl_observers.metrics.collector.interleaved`: the interleaved envs of
  ``AsyncBatchedCollector``, carried per env index;
* :mod:`~rl_observers.metrics.collector.window`: the last ``N`` episodes
  (``episode_window``).
"""

from rl_observers.metrics.collector.batch_metrics import CollectorBatchMetrics

__all__ = ["CollectorBatchMetrics"]
