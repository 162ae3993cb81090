"""Runs the far-node flows of a RayCollector and a RayReplayBuffer N times on a two-node cluster.

A stress loop to run by hand (``make test`` runs each flow once, in
``tests/remote/test_far_node_flows.py``): every flow must log exactly what was
collected, written or sampled, with nothing counted lost. Needs root and
``unshare`` (see :mod:`tests.remote.multinode`)::

    RAY_AUTH_MODE=disabled PYTHONPATH=$PWD python scripts/far_node_flows.py -n 10

Prints one line per run and flow, then the counts of exact and short runs;
exits 1 if any run was short.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.remote.far_node import FLOWS  # noqa: E402
from tests.remote.multinode import two_node_cluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=10)
    parser.add_argument("--flows", nargs="*", default=list(FLOWS), choices=list(FLOWS))
    args = parser.parse_args()
    outcomes: collections.Counter[tuple[str, bool]] = collections.Counter()
    with two_node_cluster(num_cpus=1) as cluster:
        for run in range(args.runs):
            for name in args.flows:
                with tempfile.TemporaryDirectory() as tmp:
                    started = time.monotonic()
                    result = FLOWS[name](cluster, tmp)
                    ok = result.exact
                    outcomes[(name, ok)] += 1
                    print(f"run {run} {name}: {'exact' if ok else 'SHORT'} {result} "
                          f"({time.monotonic() - started:.1f} s)", flush=True)
    for name in args.flows:
        print(f"{name}: {outcomes[(name, True)]} exact, {outcomes[(name, False)]} short")
    return 0 if not any(not ok for (_, ok) in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
