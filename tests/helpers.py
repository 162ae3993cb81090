"""Helpers shared by the test and benchmark suites."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any


@contextlib.contextmanager
def start_method(method: str) -> Iterator[None]:
    """torchrl picks the global start method (``spawn`` if unset) when workers start."""
    context = multiprocessing.context._default_context
    previous = context._actual_context
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        context._actual_context = previous


def scalars(logger: Any, name: str) -> list[tuple[int, float]]:
    """The ``(step, value)`` pairs a torchrl ``CSVLogger`` logged under ``name``."""
    return logger.experiment.scalars.get(name, [])


class CountingHandle:
    """Stands for a Ray actor handle on the driver and counts the remote calls made through it."""

    def __init__(self, handle: Any, counts: Counter[str]) -> None:
        self._handle = handle
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        counts = self._counts

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return method.remote(*args, **kwargs)

        return _Method


@contextlib.contextmanager
def counting_rpcs(rb: Any) -> Iterator[Counter[str]]:
    """Counts every call the driver makes to ``rb``'s actor, through the buffer or its client."""
    counts: Counter[str] = Counter()
    handle = rb._rb
    rb._rb = rb._client._actor = CountingHandle(handle, counts)
    try:
        yield counts
    finally:
        rb._rb = rb._client._actor = handle


@contextlib.contextmanager
def local_ray(*by_value: ModuleType) -> Iterator[Any]:
    """A local Ray cluster (2 CPUs, no dashboard) for the block, unless one already runs.

    ``by_value`` modules are shipped to Ray's workers by value: Ray pickles what it is
    handed with its own copy of cloudpickle. Skips the test when Ray is not installed.
    """
    import pytest

    ray = pytest.importorskip("ray")
    for module in by_value:
        ray.cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        for module in by_value:
            ray.cloudpickle.unregister_pickle_by_value(module)
        if started:
            ray.shutdown()


def read_csv(path: Any) -> list[tuple[int, float]]:
    """The ``(step, value)`` rows of one scalar file written by torchrl's ``CSVLogger``."""
    import csv

    with open(path, newline="") as file:
        return [(int(step), float(value)) for step, value in csv.reader(file)]
