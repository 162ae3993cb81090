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
from collections.abc import Iterator

import pytest

from tests.remote.far_node import FLOWS
from tests.remote.multinode import Cluster, two_node_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(num_cpus=1) as running:
        yield running


@pytest.mark.parametrize("flow", list(FLOWS))
def test_far_node_flow_delivers_exactly(cluster, flow):
    with tempfile.TemporaryDirectory() as tmp:
        result = FLOWS[flow](cluster, tmp)
    assert result.exact, str(result)
