"""An aggregate's rows: gauges summed over workers and the workers reporting, kept up to date."""

from __future__ import annotations

from torchrl.record.loggers.monitoring import Every

from rl_observers.remote import aggregate as aggregate_module
from rl_observers.remote.aggregate import Aggregate
from rl_observers.stats import Count


def test_gauges_sum_the_newest_value_of_each_worker_and_latest_keeps_the_last():
    agg = Aggregate("c", schedule=Every.counter("frames", 100), latest=("batch",))
    agg.contribute(0, {"frames": 40.0, "batch": 8.0, "n": Count("n", 1)}, {"frames": 40})
    agg.contribute(1, {"frames": 30.0, "batch": 4.0, "n": Count("n", 1)}, {"frames": 30})
    (row,) = agg.contribute(0, {"frames": 90.0, "batch": 16.0, "n": Count("n", 2)}, {"frames": 90})
    name, metrics, step = row
    assert (name, step) == ("c", 120)
    assert metrics["frames"] == 120.0  # 90 (worker 0's newest) + 30
    assert metrics["batch"] == 16.0  # the last value contributed
    assert metrics["n"].n == 4
    assert (metrics["workers"], metrics["workers_reporting"]) == (2, 2)


def test_a_worker_silent_for_longer_than_stale_after_no_longer_reports():
    agg = Aggregate("c", schedule=Every.counter("frames", 10))
    for worker in range(3):
        agg.contribute(worker, {"frames": 1.0}, {"frames": 1})
    # worker 0 was seen longest ago; make it (and only it) stale
    agg._workers[(0, None)].last_seen -= aggregate_module.STALE_AFTER + 1
    (row,) = agg.contribute(2, {"frames": 20.0}, {"frames": 20})
    assert (row[1]["workers"], row[1]["workers_reporting"]) == (3, 2)
    (row,) = agg.contribute(0, {"frames": 20.0}, {"frames": 20})  # back: it reports again
    assert (row[1]["workers"], row[1]["workers_reporting"]) == (3, 3)
