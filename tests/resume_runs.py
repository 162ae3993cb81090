"""One observed run, whole or in two parts with a torchrl ``Checkpoint`` between them.

Run as a script by ``tests/test_checkpoint_resume.py``, each part in a new
process, as a resumed training script would be; one process runs a part of
every kind of source asked for, one after the other::

    python -m tests.resume_runs --phase first --checkpoint ckpt --out first.json \\
        collector multisync
    python -m tests.resume_runs --phase second --checkpoint ckpt --out second.json \\
        collector:directory,archive,without multisync:directory,without

The first part saves a source's checkpoint twice, as a directory
(``ckpt/<source>``) and as an archive (``ckpt/<source>.zip``), and records
what was logged until then (``"first"``); then it goes on to the end,
uninterrupted: what it logged in all is the reference (``"whole"``; a save
does not change a run). The second part resumes once per variant, each with
everything rebuilt (a new logger, channel, source and observers):
``directory``, ``archive`` (from the archive), ``without`` (the directory,
all but the observers' state).

Each part writes ``{source: {run: {name: [[step, value], ...]}}}`` to
``--out``, what each run's ``CSVLogger`` logged. The environment is a
``CountingEnv`` driven by a constant policy: its episodes end at batch
boundaries, so a rebuilt collector (whose environments start afresh, as
torchrl's do) sees what the whole run sees. The source ``raybuffer`` starts
Ray in the process (``ray.init(num_cpus=2)``), shut down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from functools import partial

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.checkpoint import Checkpoint, GlobalRNGState
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401  (installs add_observer / attach_logger)
from rl_observers import Every, LoggerObserver, MetricsChannel

FRAMES_PER_BATCH = 10  # two whole episodes of CountingEnv(max_steps=4) per batch
TOTAL_FRAMES = 80
SPLIT_AT = 4  # batches (or writes into the Ray buffer) in the first part
RAY_WRITES = 8


class Env(CountingEnv):
    """A ``CountingEnv`` whose count restarts when a collector is rebuilt, as a Gym env's would.

    (torchrl's collector saves an empty ``env_state_dict`` for a plain env,
    and ``CountingEnv`` keeps its count in a buffer that loading then misses.)
    """

    def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ANN001, ANN201
        return super().load_state_dict(state_dict, strict=False, assign=assign)


def make_env() -> CountingEnv:
    return Env(max_steps=4)


def constant_action(observation: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(observation)


def make_policy() -> TensorDictModule:
    return TensorDictModule(constant_action, in_keys=["observation"], out_keys=["action"])


class Run:
    """One observed run: a source (and buffer), its observers, its channel and the checkpoint."""

    def __init__(self, source: str, name: str) -> None:
        self.logger = CSVLogger(exp_name=name, log_dir=tempfile.mkdtemp())
        self.channel = MetricsChannel(self.logger, health_interval=None)
        self.collector = self.rb = self.ray_rb = None
        if source == "raybuffer":
            from torchrl.data import RayReplayBuffer

            self.ray_rb = RayReplayBuffer(
                storage=partial(LazyTensorStorage, 1_000),
                batch_size=4,
                replay_buffer_cls=TensorDictReplayBuffer,
                remote_config={"num_cpus": 0},
            )
            observer = LoggerObserver(self.channel, schedule=Every.counter("sample_calls", 2))
            self.ray_rb.add_observer(observer)
            self.checkpoint = Checkpoint(replay_buffer=self.ray_rb, buffer_observer=observer)
            return
        if source == "multisync":
            self.collector = MultiSyncCollector(
                [make_env, make_env],
                make_policy(),
                frames_per_batch=FRAMES_PER_BATCH * 2,
                total_frames=TOTAL_FRAMES * 2,
                cat_results="stack",
            )
        else:
            self.collector = Collector(
                make_env(), make_policy(), frames_per_batch=FRAMES_PER_BATCH, total_frames=TOTAL_FRAMES
            )
            self.rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1_000))
        collector_observer = LoggerObserver(
            self.channel, schedule=Every.counter("frames", 2 * FRAMES_PER_BATCH if self.rb is not None else 40)
        )
        self.collector.add_observer(collector_observer)
        self.checkpoint = Checkpoint(
            rng=GlobalRNGState(), collector=self.collector, collector_observer=collector_observer
        )
        if self.rb is not None:
            buffer_observer = LoggerObserver(self.channel, schedule=Every.counter("sample_calls", 2))
            self.rb.add_observer(buffer_observer)
            self.checkpoint.register("replay_buffer", self.rb)
            self.checkpoint.register("buffer_observer", buffer_observer)

    def load(self, path: str, without_observers: bool = False) -> None:
        checkpoint = self.checkpoint
        names = [n for n in checkpoint.components if not (without_observers and "observer" in n)]
        checkpoint.load(path, components=names, strict="ignore" if without_observers else None)

    def steps(self):  # noqa: ANN201
        """Yields after each batch (or each write and sample of the Ray buffer)."""
        if self.ray_rb is not None:
            start = self.ray_rb.write_count
            for i in range(start // 5, RAY_WRITES):
                data = TensorDict(
                    {"obs": torch.arange(5) + 5 * i, ("next", "reward"): torch.full((5, 1), float(i))}, [5]
                )
                self.ray_rb.extend(data)
                self.ray_rb.sample(4)
                yield
            return
        for batch in self.collector:
            if self.rb is not None:
                self.rb.extend(batch.reshape(-1))
                self.rb.sample(4)
            yield

    def logged(self) -> dict[str, list[list[float]]]:
        assert self.channel.flush(timeout=30)
        return {name: [[int(s), float(v)] for s, v in rows] for name, rows in self.logger.experiment.scalars.items()}

    def close(self) -> dict[str, list[list[float]]]:
        if self.collector is not None:
            self.collector.shutdown()
        else:
            self.ray_rb.close()
        assert self.channel.close(timeout=30)
        return self.logged()


def first(source: str, path: str) -> dict[str, dict]:
    """Saves at the split, records what was logged by then, goes on to the end (the whole run)."""
    run = Run(source, "first")
    out = {}
    for i, _ in enumerate(run.steps()):
        if i + 1 == SPLIT_AT:
            run.checkpoint.save(path)
            run.checkpoint.save(path + ".zip", format="archive")
            out["first"] = run.logged()
            if source == "multisync":  # (the workers are asked for their state: stop here)
                break
    out["whole"] = run.close()
    if source == "multisync":
        del out["whole"]
    return out


def second(source: str, path: str, variants: list[str]) -> dict[str, dict]:
    out = {}
    for variant in variants:
        run = Run(source, variant)
        run.load(path + (".zip" if variant == "archive" else ""), without_observers=variant == "without")
        for _ in run.steps():
            pass
        out[variant] = run.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("first", "second"), required=True)
    parser.add_argument("--checkpoint", required=True, help="a directory: one checkpoint per source in it")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "sources", nargs="+", help="collector, multisync or raybuffer; in the second phase, with :variants"
    )
    args = parser.parse_args()
    sources = dict(
        (source, variants.split(",") if variants else ["directory"])
        for source, _, variants in (item.partition(":") for item in args.sources)
    )
    assert set(sources) <= {"collector", "multisync", "raybuffer"}, sources
    os.makedirs(args.checkpoint, exist_ok=True)
    out = {}
    try:
        for source, variants in sources.items():
            if source == "raybuffer":
                import ray

                ray.init(num_cpus=2, include_dashboard=False)
            torch.manual_seed(0)  # each source as if it ran alone
            path = f"{args.checkpoint}/{source}"
            out[source] = first(source, path) if args.phase == "first" else second(source, path, variants)
    finally:
        if "raybuffer" in sources:
            import ray

            ray.shutdown()
    with open(args.out, "w") as file:
        json.dump(out, file)


if __name__ == "__main__":
    from tests.helpers import preloaded_forkserver

    preloaded_forkserver()  # the MultiSyncCollector's workers, as the suite's
    main()
