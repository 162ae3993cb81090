"""A small DQN on CartPole, built from torchrl's parts: the agent of the demo and the yardstick benchmark.

:func:`make_dqn` builds the pieces (env, Q-network, epsilon-greedy policy,
collector, replay buffer, DQN loss, target-network updater, optimizer);
:func:`train` runs training iterations on them::

    collect a batch -> extend the buffer -> K x (sample -> loss -> backward -> step -> target update)
    -> anneal epsilon

It runs bare, or fully observed: :func:`observe` attaches a ``LoggerObserver``
to the collector (reward, episode return and length) and one to the replay
buffer (writes, and the age of sampled data), both through one
``MetricsChannel`` into CSV and TensorBoard loggers, and detaches them again.
``examples/demo.py`` trains it observed; ``benchmarks/test_bench_training.py``
measures what observing costs. On 2 CPU cores the defaults take CartPole's
episode return from ~20 to a few hundred in about a minute.

Run with ``python examples/dqn_cartpole.py [--frames N]``: prints the return
of the collected episodes as it learns. With ``--checkpoint PATH`` it is
also observed (CSV and TensorBoard under ``PATH.logs``) and saved at the
end with torchrl's :class:`~torchrl.checkpoint.Checkpoint`, the observers
registered next to the collector, the buffer, the loss, the optimizer and
the RNG (:func:`checkpoint`); ``--resume`` loads it first and trains
``--frames`` more: the observers' curves go on where the first run
stopped (collector steps continue on its restored frames; totals, sample
calls and episode windows come back from the observers' state).
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictSequential
from torchrl.checkpoint import Checkpoint, GlobalRNGState
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate
from torchrl.record import CSVLogger, TensorboardLogger

import rl_observers  # noqa: F401  (adds add_observer / remove_observer to torchrl's classes)
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)


@dataclass(frozen=True)
class DQNConfig:
    """Hyperparameters of the DQN. The defaults learn CartPole in about a minute on 2 cores."""

    frames_per_batch: int = 128
    updates_per_batch: int = 8
    batch_size: int = 128
    buffer_size: int = 20_000
    init_random_frames: int = 1_024
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 1e-3
    gamma: float = 0.99
    target_tau: float = 0.01
    eps_init: float = 1.0
    eps_end: float = 0.05
    eps_frames: int = 10_000
    max_episode_steps: int = 500
    seed: int = 0
    #: Where the networks, the loss and the replay buffer's storage live; the env steps on the CPU.
    device: str = "cpu"


@dataclass
class DQN:
    """The pieces of one DQN agent, built by :func:`make_dqn`."""

    config: DQNConfig
    env: TransformedEnv
    actor: QValueActor
    greedy: EGreedyModule
    policy: TensorDictSequential
    collector: Collector
    buffer: TensorDictReplayBuffer
    loss: DQNLoss
    target_updater: SoftUpdate
    optimizer: torch.optim.Optimizer
    batches: Iterator[TensorDictBase]
    frames: int = 0
    updates: int = 0


def make_env(config: DQNConfig) -> TransformedEnv:
    """Gymnasium's ``CartPole-v1`` with a step counter (truncation) and episode returns."""
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter(max_steps=config.max_episode_steps))
    env.append_transform(RewardSum())
    env.set_seed(config.seed)
    return env


def make_dqn(config: DQNConfig | None = None) -> DQN:
    """Builds a DQN agent on CartPole; ``config`` defaults to :class:`DQNConfig()`."""
    config = config or DQNConfig()
    torch.manual_seed(config.seed)
    env = make_env(config)
    n_actions = env.action_spec.shape[-1]
    net = MLP(out_features=n_actions, num_cells=list(config.hidden), activation_class=torch.nn.ReLU)
    actor = QValueActor(net, in_keys=["observation"], spec=env.action_spec)
    actor(env.reset())  # materialises the lazy layers
    greedy = EGreedyModule(
        env.action_spec,
        eps_init=config.eps_init,
        eps_end=config.eps_end,
        annealing_num_steps=config.eps_frames,
    )
    policy = TensorDictSequential(actor, greedy).to(config.device)
    collector = Collector(
        env,
        policy,
        frames_per_batch=config.frames_per_batch,
        total_frames=-1,
        init_random_frames=config.init_random_frames,
        auto_register_policy_transforms=False,
        policy_device=config.device,
        storing_device=config.device,
    )
    buffer = TensorDictReplayBuffer(
        storage=LazyTensorStorage(config.buffer_size, device=config.device),
        batch_size=config.batch_size,
    )
    loss = DQNLoss(actor, loss_function="l2", delay_value=True, action_space=env.action_spec)
    loss.make_value_estimator(gamma=config.gamma)
    target_updater = SoftUpdate(loss, tau=config.target_tau)
    optimizer = torch.optim.Adam(loss.parameters(), lr=config.lr)
    return DQN(
        config=config,
        env=env,
        actor=actor,
        greedy=greedy,
        policy=policy,
        collector=collector,
        buffer=buffer,
        loss=loss,
        target_updater=target_updater,
        optimizer=optimizer,
        batches=iter(collector),
    )


def train(
    dqn: DQN,
    iterations: int,
    on_batch: Callable[[DQN, TensorDictBase], None] | None = None,
) -> DQN:
    """Runs ``iterations`` training iterations; call it again to go on where it stopped.

    One iteration: collect ``frames_per_batch`` frames, extend the buffer, then
    ``updates_per_batch`` times sample a batch, compute the DQN loss, step the
    optimizer and move the target network; finally anneal epsilon. Updates
    start once the buffer holds ``init_random_frames`` frames.

    Args:
        dqn: the agent, from :func:`make_dqn`.
        iterations: how many batches to collect and train on.
        on_batch: called as ``on_batch(dqn, batch)`` after each iteration.
    """
    config = dqn.config
    for _ in range(iterations):
        batch = next(dqn.batches)
        dqn.buffer.extend(batch)
        dqn.frames += batch.numel()
        if dqn.frames >= config.init_random_frames:
            for _ in range(config.updates_per_batch):
                loss = dqn.loss(dqn.buffer.sample())["loss"]
                dqn.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                dqn.optimizer.step()
                dqn.target_updater.step()
                dqn.updates += 1
            dqn.greedy.step(batch.numel())
        if on_batch is not None:
            on_batch(dqn, batch)
    return dqn


def close(dqn: DQN) -> None:
    """Shuts the collector and the replay buffer down."""
    dqn.collector.shutdown()
    dqn.buffer.shutdown()


class FanOutLogger:
    """Hands every ``log_metrics`` call to several torchrl loggers; remembers the latest values.

    One channel (and one set of observers folding each batch once) then feeds
    CSV and TensorBoard alike, and ``latest`` is what a console line can show.
    """

    def __init__(self, *loggers: Any) -> None:
        self.loggers = loggers
        self.latest: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)
        self.latest.update(metrics)


@dataclass
class Observed:
    """The observers :func:`observe` attached to a DQN, their channel and loggers."""

    dqn: DQN
    channel: MetricsChannel
    fan_out: FanOutLogger
    csv: CSVLogger
    tensorboard: TensorboardLogger
    observers: list[tuple[Any, LoggerObserver]] = field(default_factory=list)
    attached: bool = False

    def attach(self) -> Observed:
        """Attaches the observers (again, after :meth:`detach`)."""
        if not self.attached:
            for target, observer in self.observers:
                target.add_observer(observer)
            self.attached = True
        return self

    def detach(self) -> Observed:
        """Removes the observers: the collector and the buffer run torchrl's own code again."""
        if self.attached:
            for target, observer in self.observers:
                target.remove_observer(observer)
            self.attached = False
        return self

    def close(self, timeout: float = 30.0) -> bool:
        """Detaches, logs the last windows, waits for the loggers and flushes TensorBoard."""
        self.detach()
        delivered = self.channel.close(timeout=timeout)
        self.tensorboard.experiment.flush()
        return delivered


def observe(
    dqn: DQN,
    out_dir: str | pathlib.Path,
    *,
    every_batches: int = 10,
    log_on_close: bool = True,
    quantiles: tuple[float, ...] | None = None,
) -> Observed:
    """Watches ``dqn`` fully: collector, buffer writes and samples, into CSV and TensorBoard.

    The collector logs reward, done, episode return and length statistics
    every ``every_batches`` batches (``collector/...``, step: frames); the
    replay buffer logs its writes and what sampling returns, including the
    age of sampled data, every ``every_batches * updates_per_batch`` samples
    (``replay_buffer/...``, step: sample calls). One ``MetricsChannel`` feeds
    ``CSVLogger`` (``<out_dir>/csv``) and ``TensorboardLogger``
    (``<out_dir>/tensorboard``). ``log_on_close`` logs the last partial
    windows when the observers are detached (see ``LoggerObserver``).
    ``quantiles`` (such as ``(0.05, 0.5, 0.95)``) adds those quantiles of
    the episode return and length and of the sample age
    (``collector/episode_return_p5``, ..., ``replay_buffer/sample_age_p95``).
    """
    out = pathlib.Path(out_dir)
    csv_logger = CSVLogger(exp_name="dqn", log_dir=str(out / "csv"))
    tb_logger = TensorboardLogger(exp_name="dqn", log_dir=str(out / "tensorboard"))
    fan_out = FanOutLogger(csv_logger, tb_logger)
    channel = MetricsChannel(fan_out)
    config = dqn.config
    observed = Observed(dqn, channel, fan_out, csv_logger, tb_logger)
    observed.observers = [
        (
            dqn.collector,
            LoggerObserver(
                channel,
                name="collector",
                log_on_close=log_on_close,
                schedule=Every.counter("frames", every_batches * config.frames_per_batch),
                metrics=CollectorBatchMetrics(
                    episode_return=True, episode_length=True, quantiles=quantiles
                ),
            ),
        ),
        (
            dqn.buffer,
            LoggerObserver(
                channel,
                name="replay_buffer",
                log_on_close=log_on_close,
                schedule=Every.counter("sample_calls", every_batches * config.updates_per_batch),
                metrics=[
                    WriteMetrics(reward_key=("next", "reward")),
                    SampleMetrics(quantiles=quantiles),
                ],
            ),
        ),
    ]
    return observed.attach()


def checkpoint(observed: Observed) -> Checkpoint:
    """Everything a resumed run needs, observers included, as one torchrl ``Checkpoint``.

    An observer is a checkpoint component like the others (``state_dict`` /
    ``load_state_dict``): one line each.
    """
    dqn = observed.dqn
    (_, collector_observer), (_, buffer_observer) = observed.observers
    return Checkpoint(
        collector=dqn.collector,
        replay_buffer=dqn.buffer,
        loss=dqn.loss,
        optimizer=dqn.optimizer,
        greedy=dqn.greedy,
        rng=GlobalRNGState(),
        collector_observer=collector_observer,
        buffer_observer=buffer_observer,
    )


def main(
    frames: int = 60_000, checkpoint_path: str | None = None, resume: bool = False
) -> list[tuple[int, float]]:
    """Trains for ``frames`` frames and prints the mean return of the episodes collected.

    Bare, unless ``checkpoint_path`` is given: then observed, saved there at
    the end, and with ``resume`` loaded from there first.
    """
    torch.set_num_threads(1)
    dqn = make_dqn()
    observed = None
    if checkpoint_path is not None:
        observed = observe(dqn, f"{checkpoint_path}.logs")
        saver = checkpoint(observed)
        if resume:
            saver.load(checkpoint_path)
            dqn.frames = dqn.collector.stats()["frames"]
            print(f"resumed from {checkpoint_path} at {dqn.frames} frames", flush=True)
    curve: list[tuple[int, float]] = []
    returns: list[float] = []
    start = time.monotonic()

    def report(dqn: DQN, batch: TensorDictBase) -> None:
        done = batch["next", "done"]
        returns.extend(batch["next", "episode_reward"][done].tolist())
        if dqn.frames % 5_000 < dqn.config.frames_per_batch and returns:
            mean = sum(returns) / len(returns)
            curve.append((dqn.frames, mean))
            print(
                f"{dqn.frames:>7} frames  {time.monotonic() - start:6.1f} s  "
                f"episode return {mean:6.1f} ({len(returns)} episodes)  eps {dqn.greedy.eps.item():.2f}",
                flush=True,
            )
            returns.clear()

    train(dqn, -(-frames // dqn.config.frames_per_batch), on_batch=report)
    if observed is not None:
        saver.save(checkpoint_path)
        observed.close()
        print(f"saved {checkpoint_path} at {dqn.frames} frames; metrics in {checkpoint_path}.logs", flush=True)
    close(dqn)
    return curve


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=60_000)
    parser.add_argument("--checkpoint", metavar="PATH", help="observe, and save the run there at the end")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint first and go on")
    args = parser.parse_args()
    if args.resume and args.checkpoint is None:
        parser.error("--resume needs --checkpoint PATH")
    main(args.frames, args.checkpoint, args.resume)
