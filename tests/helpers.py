"""Helpers shared by the test and benchmark suites."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
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
