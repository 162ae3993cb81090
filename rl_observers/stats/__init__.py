"""Statistics that merge exactly: torch-free partials, device reducers, observed counters.

This package imports no other part of :mod:`rl_observers`.
"""

from rl_observers.stats.counters import ObservedCounters
from rl_observers.stats.latest import LatestReducer
from rl_observers.stats.partials import (
    MOMENT_STATS,
    WINDOW_STATS,
    Count,
    LatestWindow,
    Moments,
    Partial,
    QuantileSketch,
)
from rl_observers.stats.reducers import (
    CountReducer,
    MomentsGroupReducer,
    MomentsReducer,
    QuantileReducer,
    ReducerBank,
)
from rl_observers.stats.scalars import (
    SCALAR_RULES,
    BinCounts,
    Fraction,
    LastEvent,
    PerSecond,
    Scalar,
)

__all__ = [
    "MOMENT_STATS",
    "SCALAR_RULES",
    "BinCounts",
    "Fraction",
    "LastEvent",
    "PerSecond",
    "Scalar",
    "Count",
    "CountReducer",
    "LatestReducer",
    "LatestWindow",
    "Moments",
    "MomentsGroupReducer",
    "MomentsReducer",
    "ObservedCounters",
    "Partial",
    "QuantileReducer",
    "QuantileSketch",
    "ReducerBank",
    "WINDOW_STATS",
]
