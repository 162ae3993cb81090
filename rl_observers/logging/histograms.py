"""Distributions drawn in the logger's histogram view, from the merged partials, on the channel's thread.

TensorBoard, W&B and Trackio get their pre-binned call; other loggers the
quantile scalars only. See :doc:`histograms`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from rl_observers.channel import MetricsChannel
from rl_observers.stats import BinCounts, QuantileSketch
from rl_observers.stats.partials import SKETCH_EXPONENTS

__all__ = ["HistogramDrawer", "draw_histograms", "histogram_of"]

#: The most bins drawn in W&B (its own limit).
WANDB_MAX_BINS = 512
# The torchrl logger class of each backend that has a histogram view.
_BACKENDS = {
    "tensorboard": "torchrl.record.loggers.tensorboard:TensorboardLogger",
    "wandb": "torchrl.record.loggers.wandb:WandbLogger",
    "trackio": "torchrl.record.loggers.trackio:TrackioLogger",
}


def histogram_of(partial: Any) -> tuple[list[float], list[float]] | None:
    """``(edges, counts)`` of a distribution partial (``len(edges) == len(counts) + 1``), or ``None``.

    Bins are contiguous and ascending, gaps filled with zero counts; values
    outside a :class:`~rl_observers.stats.BinCounts`'s edges get a bin of the
    outer width; NaN and infinities are not drawn.

    Examples:
        >>> from rl_observers.stats import BinCounts
        >>> histogram_of(BinCounts.from_values("x", [0.5, 1.5, 1.7, 9.0], edges=[0, 1, 2]))
        ([0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 1.0])
        >>> histogram_of(42.0) is None
        True
    """
    if isinstance(partial, QuantileSketch):
        return _sketch(partial)
    if not isinstance(partial, BinCounts):
        return None
    edges, counts = list(partial.edges), list(partial.counts)
    inner = counts[1:-1]  # (a BinCounts has at least two edges)
    if counts[0]:
        edges.insert(0, edges[0] - (edges[1] - edges[0]))
        inner.insert(0, counts[0])
    if counts[-1]:
        edges.append(edges[-1] + (edges[-1] - edges[-2]))
        inner.append(counts[-1])
    if not any(inner):
        return None
    return edges, inner


def _key_bounds(key: int, p: int) -> tuple[float, float]:
    exponent, mantissa = divmod(key, 1 << p)
    low, high = (math.ldexp(1.0 + m * 2.0**-p, exponent - 127) for m in (mantissa, mantissa + 1))
    return low, high


def _sketch(sketch: QuantileSketch) -> tuple[list[float], list[float]] | None:
    bins: list[tuple[float, float, float]] = []
    for key in sorted(sketch.negative, reverse=True):  # the most negative first
        low, high = _key_bounds(key, sketch.p)
        bins.append((-high, -low, sketch.negative[key]))
    if sketch.zero:
        tiny = 2.0 ** SKETCH_EXPONENTS[0]
        bins.append((-tiny, tiny, sketch.zero))
    for key in sorted(sketch.positive):
        low, high = _key_bounds(key, sketch.p)
        bins.append((low, high, sketch.positive[key]))
    if not bins:
        return None
    edges, counts = [bins[0][0]], []
    for low, high, count in bins:
        if low > edges[-1]:  # a gap: a bin with no values
            edges.append(low)
            counts.append(0.0)
        edges.append(max(high, edges[-1]))
        counts.append(count)
    return edges, counts


def coarsen(edges: list[float], counts: list[float], most: int) -> tuple[list[float], list[float]]:
    """Joins adjacent bins so that at most ``most`` remain; counts stay exact.

    Examples:
        >>> coarsen([0, 1, 2, 3, 4], [1, 2, 3, 4], 2)
        ([0, 2, 4], [3, 7])
    """
    if len(counts) <= most:
        return edges, counts
    step = -(-len(counts) // most)
    new_edges = edges[::step]
    if new_edges[-1] != edges[-1]:
        new_edges.append(edges[-1])
    return new_edges, [sum(counts[i : i + step]) for i in range(0, len(counts), step)]


class HistogramDrawer:
    """Draws the distribution partials of each delivered row with the logger's pre-binned call.

    Args:
        logger: the channel's sink.

    Keyword Args:
        names (iterable of str, optional): the partials' keys to draw.
            Defaults to ``None`` (all).

    Attributes:
        backend (str or None): ``"tensorboard"``, ``"wandb"``, ``"trackio"``,
            or ``None`` (nothing drawn).
    """

    def __init__(self, logger: Any, *, names: Iterable[str] | None = None) -> None:
        self.logger = logger
        self.names = None if names is None else frozenset(names)
        classes = {f"{c.__module__}:{c.__name__}" for c in type(logger).__mro__}  # (no imports)
        self.backend = next((name for name, cls in _BACKENDS.items() if cls in classes), None)
        self.channel: MetricsChannel | None = None

    def __call__(self, namespace: str, metrics: Mapping[str, Any], payload: Any, step: int | None) -> None:
        """The channel's watcher: draws the row's distributions."""
        self.draw(namespace, metrics, step)

    def draw(self, namespace: str, metrics: Mapping[str, Any], step: int | None) -> None:
        """Draws the row's distributions (nothing without a backend)."""
        if self.backend is None:
            return
        names = self.names
        draw = self._tensorboard if self.backend == "tensorboard" else self._binned
        for key, value in metrics.items():
            histogram = histogram_of(value) if names is None or key in names else None
            if histogram is not None:
                name = key.removesuffix("_quantiles")
                draw(f"{namespace}/{name}" if namespace else name, *histogram, step, value)

    def _tensorboard(
        self, tag: str, edges: list[float], counts: list[float], step: int | None, partial: Any
    ) -> None:
        if getattr(partial, "min", math.inf) <= getattr(partial, "max", -math.inf):
            low, high, total, squares = partial.min, partial.max, partial.sum, partial.sum_squares
        else:  # a sketch keeps only its buckets: their bounds and midpoints
            mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
            low, high, total = edges[0], edges[-1], sum(c * m for c, m in zip(counts, mids))
            squares = sum(c * m * m for c, m in zip(counts, mids))
        self.logger.experiment.add_histogram_raw(
            tag,
            min=low,
            max=high,
            num=sum(counts),
            sum=total,
            sum_squares=squares,
            bucket_limits=edges[1:],
            bucket_counts=counts,
            global_step=step,
        )

    def _binned(self, tag: str, edges: list[float], counts: list[float], step: int | None, _: Any) -> None:
        # (W&B's and Trackio's Histogram take the same arguments; only W&B limits the bins)
        import numpy as np

        module = importlib.import_module(self.backend)  # type: ignore[arg-type]
        if self.backend == "wandb":
            edges, counts = coarsen(edges, counts, WANDB_MAX_BINS)
        histogram = module.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))
        self.logger.log_metrics({tag: histogram}, step=step)  # torchrl's own step handling


def draw_histograms(target: Any, *, names: Iterable[str] | None = None) -> HistogramDrawer:
    """Opts in: the distributions logged through ``target`` are also drawn as histograms.

    Loggers without such a view get the quantile scalars only, and no error.

    Args:
        target (MetricsChannel or Logger): the channel, or a logger whose
            shared channel then stays open until closed or exit.

    Keyword Args:
        names (iterable of str, optional): only these partial keys. Defaults
            to all.

    Returns:
        The :class:`HistogramDrawer` (its ``backend`` says what is drawn).

    Raises:
        ValueError: if ``target`` is a channel's copy in another process.

    Examples:
        >>> import tempfile, torch
        >>> from torchrl.record import CSVLogger
        >>> from rl_observers import MetricsChannel, draw_histograms
        >>> channel = MetricsChannel(CSVLogger(exp_name="h", log_dir=tempfile.mkdtemp()), background=False)
        >>> draw_histograms(channel).backend is None  # CSV: quantile scalars only
        True
        >>> channel.close()
        True
    """
    channel = target if isinstance(target, MetricsChannel) else MetricsChannel.for_logger(target)
    drawer = HistogramDrawer(channel.logger, names=names)
    if drawer.backend is not None:
        drawer.channel = channel  # a logger's shared channel stays open with the opt-in
        channel._logging.add_watcher(drawer)
    return drawer
