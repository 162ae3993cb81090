"""Metrics from every node of a Ray cluster, merged into one logger on the driver.

Replay-buffer actors spread over the cluster's nodes (``SPREAD``) each own a
torchrl replay buffer observed by a copy of one driver-side
:class:`~rl_observers.LoggerObserver`. Actors on the driver's machine send
their windows over the channel's Unix socket; actors on other nodes send them
through Ray, to the channel's ingest actor. The driver's channel
merges everything exactly and logs one aggregate series plus one series per
worker; its health shows what was lost on the way, if anything.

Run on any Ray cluster::

    python examples/ray_multinode.py --address auto     # or set RAY_ADDRESS
    python examples/ray_multinode.py                    # a local Ray, for a try
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from torchrl.record import CSVLogger  # noqa: E402

import rl_observers  # noqa: E402,F401
from rl_observers import Every, LoggerObserver, MetricsChannel, WriteMetrics  # noqa: E402


@ray.remote(num_cpus=0, scheduling_strategy="SPREAD")
class BufferActor:
    """One worker: a replay buffer observed where it lives."""

    def __init__(self, observer: LoggerObserver, worker: int, workers: int) -> None:
        from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

        from rl_observers.sources.placement import place

        self.rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000))
        place(self.rb, worker, workers)  # names this actor worker <worker> in per-worker rows
        self.observer = observer
        self.rb.add_observer(observer)

    def where(self) -> tuple[str, str]:
        """This actor's node and how its metrics travel (``"socket"`` or ``"ray"``)."""
        return ray.get_runtime_context().get_node_id()[:8], self.observer._sink.transport

    def write(self, batches: int, size: int, seed: int) -> float:
        from tensordict import TensorDict

        generator = torch.Generator().manual_seed(seed)
        total = 0.0
        for _ in range(batches):
            reward = torch.randn(size, 1, generator=generator)
            self.rb.extend(TensorDict({"next": {"reward": reward}}, batch_size=[size]))
            total += reward.sum().item()
        return total

    def close(self) -> bool:
        self.rb.remove_observer(self.observer)  # sends the last window (log_on_close)
        return self.observer._sink.flush(10.0)


def main(
    out_dir: str = "runs/ray_multinode",
    address: str | None = None,
    workers: int = 4,
    batches: int = 50,
    size: int = 64,
) -> dict:
    address = address or os.environ.get("RAY_ADDRESS")
    started_ray = not ray.is_initialized()
    if started_ray:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    logger = CSVLogger(exp_name="ray_multinode", log_dir=out_dir)
    channel = MetricsChannel(logger)
    observer = LoggerObserver(
        channel,
        schedule=Every.counter("items_written", 4 * size * batches),  # ~4 aggregate rows
        metrics=WriteMetrics(reward_key=("next", "reward")),
        name="buffers",
        scope="both",
    )
    actors = [BufferActor.remote(observer, i, workers) for i in range(workers)]
    try:
        for i, (node, transport) in enumerate(ray.get([a.where.remote() for a in actors])):
            print(f"worker {i}: node {node}, metrics travel by {transport}")
        reward_sum = sum(ray.get([a.write.remote(batches, size, i) for i, a in enumerate(actors)]))
        assert all(ray.get([a.close.remote() for a in actors]))
    finally:
        channel.close(timeout=60)  # logs the last windows, then stops the ingest
        for actor in actors:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
    scalars = logger.experiment.scalars
    summary = {name: values[-1] for name, values in sorted(scalars.items()) if "/" in name}
    items = workers * batches * size
    print(f"written {items} items, reward sum {reward_sum:.3f} (ground truth)")
    for name in ("buffers/items_written", "buffers/workers", "buffers/worker_0/items_written"):
        step, value = summary[name]
        print(f"{name:<28} step {step:>7}  {value:12.6f}")
    print("channel health:", channel.health())
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/ray_multinode")
    parser.add_argument("--address", default=None, help="a Ray cluster's address, or 'auto'")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(sys.argv[1:])
    main(args.out_dir, address=args.address, workers=args.workers)
