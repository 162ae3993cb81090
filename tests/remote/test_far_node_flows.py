"""Issue 22's far-node flows, each once, on the real two-node cluster (``tests/remote/multinode.py``).

Each flow (``tests/remote/far_node.py``) builds its Ray sources pinned to the far
node, observes them with one ``LoggerObserver`` and runs the flow a user
runs: iterate → ``shutdown()`` → ``flush`` → ``close``; ``.start()`` →
``async_shutdown()``; a ``RayReplayBuffer`` written, sampled and closed;
``remove_observer`` mid-run; an interpreter that exits after ``shutdown()``
without ``close()``. The last row must be exactly what the sources did,
with nothing counted lost and ``flush`` / ``close`` returning ``True``.
``scripts/far_node_flows.py -n 10`` runs the same flows in a loop.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
from torchrl.record import CSVLogger

from rl_observers import CollectorBatchMetrics, Every, LoggerObserver, MetricsChannel
from tests.helpers import scalars
from tests.remote.far_node import FLOWS, FRAMES_PER_BATCH, _far_collector
from tests.remote.multinode import HEAD_IP, ONE_CLUSTER_AT_A_TIME, cluster_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), ONE_CLUSTER_AT_A_TIME]


cluster = cluster_fixture()


@pytest.mark.real_collector
@pytest.mark.parametrize("flow", list(FLOWS))
def test_far_node_flow_delivers_exactly(cluster, flow):
    with tempfile.TemporaryDirectory() as tmp:
        result = FLOWS[flow](cluster, tmp)
    assert result.exact, str(result)


@pytest.mark.real_collector
def test_a_ray_collector_that_connects_itself_logs_every_window_before_it_disconnects(cluster, tmp_path, told):
    """torchrl's IMPALA flow across nodes: the driver is not connected to Ray; an asynchronous
    ``RayCollector`` with its actors on the far node connects through its ``ray_init_config`` and
    disconnects at the end of iteration (its runtime lease), before the channel can be closed.
    Every window crosses the Ray wire and is logged all the same, and nobody is warned."""
    import ray

    connect = {"address": cluster.address, "_node_ip_address": HEAD_IP, "log_to_driver": False}
    ray.shutdown()  # the driver as the example starts it
    try:
        logger = CSVLogger(exp_name="far", log_dir=str(tmp_path))
        channel = MetricsChannel(logger, health_interval=None)
        collector = _far_collector(cluster, sync=False, ray_init_config=connect)
        collector.add_observer(
            LoggerObserver(channel, schedule=Every.counter("frames", FRAMES_PER_BATCH), metrics=CollectorBatchMetrics())
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            received = [batch.clone() for batch in collector]
        assert not ray.is_initialized()  # the collector's lease disconnected the driver
        collector.shutdown()
        assert channel.close(timeout=60)
    finally:
        if not ray.is_initialized():  # the module's other tests run connected
            ray.init(**connect, include_dashboard=False)
    frames = sum(batch.numel() for batch in received)
    frames_rows = scalars(logger, "collector/frames")
    batches_rows = scalars(logger, "collector/batches")
    assert frames_rows[-1][1] == frames and all(value <= frames for _, value in frames_rows)
    assert [step for step, _ in batches_rows] == [step for step, _ in frames_rows]
    assert [value for _, value in batches_rows] == [value / FRAMES_PER_BATCH for _, value in frames_rows]
    assert batches_rows[-1][1] == len(received)
    dones = sum(int(batch["next", "done"].sum()) for batch in received)
    assert scalars(logger, "collector/episodes_total")[-1][1] == dones
    assert scalars(logger, "collector/frames_discarded")[-1][1] == 2 * FRAMES_PER_BATCH  # one in flight per actor
    health = channel.health()
    assert health["submitted"] == health["logged"] + health["coalesced"] > 0, health
    assert health["copies_lost"] == health["dropped"] == 0, health
    assert not [message for message in told if "Ray was shut down" in message or "lost" in message], told
