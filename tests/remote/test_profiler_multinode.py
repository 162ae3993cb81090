"""ProfilerObserver in a RayCollector actor on another node: the trace comes back to the driver.

Runs on a real two-node cluster (:mod:`tests.remote.multinode`) whose far node shares
no temporary files with the driver: the trace the actor writes under the
test's temporary directory lands in the far node's own tmpfs, and only the
copy sent back reaches the driver's disk.
"""

from __future__ import annotations

import warnings

import pytest

import rl_observers  # noqa: F401
from rl_observers import ProfilerObserver
from tests.remote.multinode import ONE_CLUSTER_AT_A_TIME, cluster_fixture
from tests.test_profiler import (
    FAST,
    RECORDED_3_4,
    Marker,
    marked,
    one_actor_ray_collector,
    trace_events,
)

pytestmark = ONE_CLUSTER_AT_A_TIME
cluster = cluster_fixture()


def _node_id(collector) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trace_written_on_the_far_node_arrives_on_the_driver(cluster, tmp_path):
    import ray

    collector = one_actor_ray_collector({"num_cpus": 0, "resources": cluster.far})
    written = tmp_path / "far" / "trace_0.json"
    profiler = ProfilerObserver(
        num_rollouts=3, warmup_rollouts=1, save_path=tmp_path / "far" / "trace_{worker_idx}.json",
        start_after_frames=16, **FAST,
    )
    try:
        (actor,) = collector.remote_collectors
        assert ray.get(actor.__ray_call__.remote(_node_id)) == cluster.far_node_id
        collector.add_observer(profiler)
        collector.add_observer(Marker())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for i, _ in enumerate(collector):
                if i == 6:  # written on the far node after rollout 4, invisible here
                    assert not written.exists()
    finally:
        collector.shutdown()
    assert marked(trace_events(written)) == RECORDED_3_4
