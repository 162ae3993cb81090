"""Budget: recording a training-loop value costs no more than a ``Mean`` one-liner per call.

Three ways to log a loss (a 0-dim tensor, as a training step leaves it)
every step, windows of 100 steps into one ``MetricsChannel`` over a
``CSVLogger``, measured in one run in alternating blocks
(``benchmarks/_timing``), each ending with the channel's ``flush`` (what a
candidate submitted is logged, and charged, in its own block):

* ``training``: ``TrainingMetrics.record(step, loss=loss)``;
* ``one_liner``: ``Mean("loss", fn).on_post_collect(None, loss)`` per step,
  and every 100 steps its ``pull()`` submitted to the channel (what a
  ``LoggerObserver`` does with it);
* ``item``: ``channel.submit_metrics({"loss": loss.item()}, step)`` per step,
  the hand-written way (a host-device sync per step on a GPU; on the CPU,
  only the per-step submit), for reference.

Budget: training / one-liner <= ``BUDGET``. A missed budget is measured once
more and the better run counts. ``make bench`` prints the numbers (``-s``)
and asserts the budget; ``make test`` (``--benchmark-disable``, fewer
blocks, one core possibly busy) asserts ``TEST_CEILING``.
"""

from __future__ import annotations

import itertools
import tempfile
from contextlib import ExitStack

import pytest
import torch
from torchrl.record import CSVLogger

from benchmarks._timing import paired_slowdowns
from rl_observers import Mean, MetricsChannel, TrainingMetrics

WINDOW = 100


def _identity(value):
    return value


def _measure(blocks, calls, benchmark=None):
    with ExitStack() as stack:
        channel = MetricsChannel(CSVLogger(exp_name="bench", log_dir=tempfile.mkdtemp()), capacity=1 << 16)
        stack.callback(channel.close)
        loss = torch.tensor(0.25)
        train = TrainingMetrics(channel, every=WINDOW, namespace="training")
        steps = itertools.count(1)

        def training():
            train.record(next(steps), loss=loss)

        metric = Mean("loss", _identity)
        mean_steps = itertools.count(1)

        def one_liner():
            metric.on_post_collect(None, loss)
            step = next(mean_steps)
            if step % WINDOW == 0:
                channel.submit_metrics(metric.pull(), step=step, namespace="one_liner")

        item_steps = itertools.count(1)

        def item():
            channel.submit_metrics({"loss": loss.item()}, step=next(item_steps), namespace="item")

        candidates = {"training": training, "one_liner": one_liner, "item": item}
        # Each block ends with the channel's flush: the rows a candidate submitted are logged,
        # and charged, in its own block (``item``'s row per call would otherwise keep the
        # channel's thread busy through the next candidate's block).
        flush = {name: channel.flush for name in candidates}
        ratios = paired_slowdowns(
            candidates, "one_liner", calls=calls, blocks=blocks, warmup=1, block_end=flush
        )
        if benchmark is not None:
            benchmark.pedantic(training, rounds=3, iterations=calls)
        train.close()
        return ratios


BUDGET = 1.05
TEST_CEILING = 1.30


@pytest.mark.timeout(120)
def test_training_record_costs_no_more_than_a_mean_one_liner(benchmark):
    blocks, calls = (7, 2_000) if benchmark.disabled else (15, 10_000)
    limit = TEST_CEILING if benchmark.disabled else BUDGET
    ratios = _measure(blocks, calls, benchmark)
    if ratios["training"] > limit:
        ratios = min(ratios, _measure(blocks, calls), key=lambda r: r["training"])
    benchmark.extra_info.update({f"ratio_{k}": v for k, v in ratios.items()})
    print(
        f"\ntraining / one-liner: {ratios['training']:.3f}; "
        f"per-step .item() submit / one-liner: {ratios['item']:.3f}"
    )
    assert ratios["training"] <= limit, ratios
