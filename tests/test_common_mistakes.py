"""Common mistakes fail at once, with the exact message that says what to do instead.

One table (:data:`MISTAKES`): each row is a mistake a new user makes, the
exception it raises and its exact message. ``docs/faq.rst`` ("Common
mistakes") lists the same rows; :func:`test_every_mistake_is_in_the_faq`
keeps the two in sync.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401  (adds add_observer / attach_logger)
from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)
from tests.helpers import replay_buffer

FAQ = Path(__file__).resolve().parents[1] / "docs" / "faq.rst"


class Mistake(NamedTuple):
    title: str  # the FAQ's entry
    make: Callable[[Any], Any]  # does the mistake, given a fresh CSVLogger
    error: type[BaseException]
    message: str


def _collector() -> Collector:
    env = CountingEnv(max_steps=5)
    return Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=20)


def _on_collector(logger: Any, **kwargs: Any) -> None:
    collector = _collector()
    try:
        collector.add_observer(LoggerObserver(logger, **kwargs))
    finally:
        collector.shutdown()


def _two_collectors(logger: Any) -> None:
    first, second = _collector(), _collector()
    try:
        first.attach_logger(logger)
        second.attach_logger(logger)
    finally:
        first.shutdown()
        second.shutdown()


def _missing_reward_key(logger: Any) -> None:
    rb = replay_buffer("plain", 100)
    rb.add_observer(LoggerObserver(logger, metrics=WriteMetrics(reward_key="reward")), on_error="raise")
    rb.extend(TensorDict(obs=torch.zeros(4), batch_size=[4]))


MISTAKES: tuple[Mistake, ...] = (
    Mistake(
        "Collector metrics on a replay buffer",
        lambda logger: replay_buffer("plain", 100).add_observer(LoggerObserver(logger, metrics=CollectorBatchMetrics())),
        TypeError,
        (
            'LoggerObserver: CollectorBatchMetrics folds post_collect, which a ReplayBuffer '
            'never emits, so it would log nothing; on a replay buffer use WriteMetrics() or '
            'SampleMetrics() (or a MetricSet with on_post_add, on_post_extend or '
            'on_post_sample).'
        ),
    ),
    Mistake(
        "Replay-buffer metrics on a collector",
        lambda logger: _on_collector(logger, metrics=SampleMetrics()),
        TypeError,
        (
            'LoggerObserver: SampleMetrics folds post_add, post_extend, post_sample, which a '
            'Collector never emits, so it would log nothing; on a collector use '
            'CollectorBatchMetrics() (or a MetricSet with on_post_collect).'
        ),
    ),
    Mistake(
        "A logger class instead of a logger",
        lambda logger: LoggerObserver(CSVLogger),
        TypeError,
        (
            'LoggerObserver expects a logger instance, got the class CSVLogger; create the '
            'logger first, e.g. LoggerObserver(CSVLogger(exp_name=..., log_dir=...)), and '
            'pass that.'
        ),
    ),
    Mistake(
        "A logger class given to MetricsChannel",
        lambda logger: MetricsChannel(CSVLogger),
        TypeError,
        (
            'MetricsChannel expected a logger instance, got the class CSVLogger; create the '
            'logger first, e.g. CSVLogger(exp_name=..., log_dir=...), and pass that.'
        ),
    ),
    Mistake(
        "A metric-set class instead of a metric set",
        lambda logger: LoggerObserver(logger, metrics=CollectorBatchMetrics),
        TypeError,
        (
            'LoggerObserver: metrics= got the class CollectorBatchMetrics, not a metric set; '
            'instantiate it: metrics=CollectorBatchMetrics().'
        ),
    ),
    Mistake(
        "Two metric sets logging the same names",
        lambda logger: replay_buffer("plain", 100).add_observer(LoggerObserver(logger, metrics=[WriteMetrics(), WriteMetrics()])),
        ValueError,
        (
            'LoggerObserver: metric sets WriteMetrics (#1) and WriteMetrics (#2) both log '
            "'items_written', 'writes'; one would overwrite the other in every row. Keep one "
            'of them, or log the other from a second LoggerObserver with its own name=.'
        ),
    ),
    Mistake(
        "Two observers with one namespace on one logger",
        _two_collectors,
        ValueError,
        (
            "LoggerObserver: the namespace 'collector' (the default for this kind of target) "
            "is already used on this logger by LoggerObserver(name='collector', "
            "schedule=Every(kind='counter', interval=1000, key='frames'), "
            'metrics=[CollectorBatchMetrics]); pass name= to tell them apart, e.g. '
            "name='collector_2'."
        ),
    ),
    Mistake(
        "A schedule over a counter the metric sets do not count",
        lambda logger: replay_buffer("plain", 100).add_observer(LoggerObserver(logger, schedule=Every.counter("frames", 1000))),
        ValueError,
        (
            "LoggerObserver: Every.counter(key, n) names the counter 'frames', which none of "
            'its metric sets (WriteMetrics, SampleMetrics) counts; use one of '
            "['items_written', 'sample_calls', 'samples_returned', 'write_count', 'writes']."
        ),
    ),
    Mistake(
        "A key missing from the data",
        _missing_reward_key,
        KeyError,
        (
            "WriteMetrics: reward_key='reward' is not in the data; keys present: 'obs'. Pass "
            'WriteMetrics(reward_key=...) one of these keys, or None to leave that metric '
            'out.'
        ),
    ),
)


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.title for m in MISTAKES])
def test_mistake_fails_with_its_message(mistake: Mistake, tmp_path: Path) -> None:
    logger = CSVLogger(exp_name="mistakes", log_dir=str(tmp_path))
    with pytest.raises(mistake.error) as info:
        mistake.make(logger)
    message = str(info.value) if not isinstance(info.value, KeyError) else info.value.args[0]
    assert message == mistake.message
    assert "_MissingKeyError" not in message


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_every_mistake_is_in_the_faq() -> None:
    faq = _flat(FAQ.read_text())
    assert "Common mistakes" in faq
    for mistake in MISTAKES:
        assert mistake.title in faq, mistake.title
        assert _flat(mistake.message) in faq, mistake.message
