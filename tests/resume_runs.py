"""One observed run, whole or in two parts with a torchrl ``Checkpoint`` between them.

Run as a script by ``tests/test_checkpoint_resume.py``, each part in a new
process, as a resumed training script would be::

    python -m tests.resume_runs --phase whole --out whole.json
    python -m tests.resume_runs --phase first --checkpoint ckpt --out first.json
    python -m tests.resume_runs --phase second --checkpoint ckpt --out second.json

The first part saves the checkpoint twice, as a directory (``ckpt``) and as
an archive (``ckpt.zip``); ``--archive`` resumes from the archive.

Each part writes what its ``CSVLogger`` logged, ``{name: [[step, value], ...]}``,
to ``--out``. The environment is a ``CountingEnv`` driven by a constant
policy: its episodes end at batch boundaries, so a rebuilt collector (whose
environments start afresh, as torchrl's do) sees what the whole run sees.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
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
SPLIT_AT = 4  # batches in the first part


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


def build(source: str, logger: CSVLogger) -> tuple[object, ...]:
    if source == "multisync":
        collector = MultiSyncCollector(
            [make_env, make_env],
            make_policy(),
            frames_per_batch=FRAMES_PER_BATCH * 2,
            total_frames=TOTAL_FRAMES * 2,
            cat_results="stack",
        )
        rb = None
    else:
        collector = Collector(
            make_env(), make_policy(), frames_per_batch=FRAMES_PER_BATCH, total_frames=TOTAL_FRAMES
        )
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1_000))
    channel = MetricsChannel(logger, health_interval=None)
    collector_observer = LoggerObserver(
        channel, schedule=Every.counter("frames", 2 * FRAMES_PER_BATCH if rb is not None else 40)
    )
    collector.add_observer(collector_observer)
    buffer_observer = None
    if rb is not None:
        buffer_observer = LoggerObserver(channel, schedule=Every.counter("sample_calls", 2))
        rb.add_observer(buffer_observer)
    checkpoint = Checkpoint(rng=GlobalRNGState(), collector=collector, collector_observer=collector_observer)
    if rb is not None:
        checkpoint.register("replay_buffer", rb)
        checkpoint.register("buffer_observer", buffer_observer)
    return collector, rb, channel, checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("whole", "first", "second"), required=True)
    parser.add_argument("--source", choices=("collector", "multisync"), default="collector")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--archive", action="store_true", help="the checkpoint is an archive (--phase first: save both)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--without-observers", action="store_true", help="load all but the observers")
    args = parser.parse_args()
    torch.manual_seed(0)
    logger = CSVLogger(exp_name=args.phase, log_dir=tempfile.mkdtemp())
    collector, rb, channel, checkpoint = build(args.source, logger)
    if args.phase == "second":
        names = [n for n in checkpoint.components if not (args.without_observers and "observer" in n)]
        path = args.checkpoint + (".zip" if args.archive else "")
        checkpoint.load(path, components=names, strict="ignore" if args.without_observers else None)
    for i, batch in enumerate(collector):
        if rb is not None:
            rb.extend(batch.reshape(-1))
            rb.sample(4)
        if args.phase == "first" and i + 1 == SPLIT_AT:
            checkpoint.save(args.checkpoint)
            checkpoint.save(args.checkpoint + ".zip", format="archive")
            break
    collector.shutdown()
    assert channel.close(timeout=30)
    scalars = {name: [[int(s), float(v)] for s, v in rows] for name, rows in logger.experiment.scalars.items()}
    with open(args.out, "w") as file:
        json.dump(scalars, file)


if __name__ == "__main__":
    main()
