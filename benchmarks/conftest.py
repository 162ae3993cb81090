"""Benchmarks run two ways: ``make bench`` measures every budget; ``make test`` keeps the floors.

Under ``--benchmark-disable`` (``make test``) the benchmarks run shorter
loops and assert same-run ratio floors. A test marked ``bench_only`` is a
pure measurement (a budget that only an absolute number or many rounds can
show): it runs in ``make bench`` only and is skipped by ``make test``.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "bench_only: a measurement run by make bench only (skipped under --benchmark-disable)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("benchmark_disable", default=False):
        return
    skip = pytest.mark.skip(reason="bench_only: measured by make bench (benchmarks enabled)")
    for item in items:
        if item.get_closest_marker("bench_only") is not None:
            item.add_marker(skip)
