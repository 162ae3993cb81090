"""Budget: folding 1,000-value batches into ``Quantiles`` costs at most 1.5x folding them into ``Mean``.

Both one-liners receive the same batches (a float32 tensor of 1,000 values
per event, what ``fn`` returns), through their ``on_post_collect`` (the
function call, the lock and the fold on the tensor's device, no pull),
measured in one run in alternating blocks (``benchmarks/_timing``), torch
on one thread. ``Quantiles`` buckets each value by its float32 bits (a
shift, a table lookup, an ``index_add_``); ``Mean`` stages the values and
reduces 16 folds at a time. Budget: Quantiles / Mean <= 1.5. A missed
budget is measured once more and the better run counts.

``make bench`` prints the numbers (``-s``); ``make test`` runs the same
assertion with ``--benchmark-disable``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks._timing import paired_slowdowns, per_call_seconds
from rl_observers import Mean, Quantiles


def _identity(batch):
    return batch


def _measure(blocks, calls, benchmark=None):
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(1000, generator=generator) * 10 for _ in range(16)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        candidates = {}
        for name, metric in (
            ("mean", Mean("x", _identity)),
            ("quantiles", Quantiles("x", _identity, q=(0.05, 0.5, 0.95))),
        ):
            state = {"i": 0}

            def fold(metric=metric, state=state):
                i = state["i"] = (state["i"] + 1) % 16
                metric.on_post_collect(None, batches[i])

            candidates[name] = fold
        ratios = paired_slowdowns(candidates, "mean", calls=calls, blocks=blocks, warmup=2)
        if benchmark is not None:
            benchmark.pedantic(candidates["quantiles"], rounds=200, iterations=1)
        seconds = {
            name: min(per_call_seconds(fn, calls) for _ in range(3))
            for name, fn in candidates.items()
        }
        return ratios, seconds
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_quantiles_fold_costs_at_most_one_and_a_half_means(benchmark):
    blocks, calls = (9, 160) if benchmark.disabled else (15, 320)
    ratios, seconds = _measure(blocks, calls, benchmark)
    if ratios["quantiles"] > 1.5:
        ratios, seconds = min(
            (ratios, seconds), _measure(blocks, calls), key=lambda r: r[0]["quantiles"]
        )
    benchmark.extra_info.update({f"ratio_{k}": v for k, v in ratios.items()})
    print(
        f"\nQuantiles / Mean fold, 1,000 values: {ratios['quantiles']:.3f} "
        f"(Mean {seconds['mean'] * 1e6:.1f} us, Quantiles {seconds['quantiles'] * 1e6:.1f} us per fold)"
    )
    assert ratios["quantiles"] <= 1.5
