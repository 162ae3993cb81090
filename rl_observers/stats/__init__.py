"""Statistics that merge exactly: torch-free partials, device reducers, observed counters.

:mod:`~rl_observers.stats.partials` and :mod:`~rl_observers.stats.scalars`
hold the host-side partials, :mod:`~rl_observers.stats.reducers` the device
reducers. This package imports no other part of :mod:`rl_observers`.
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
