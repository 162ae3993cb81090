"""Histogram: a one-liner logging quantiles read off bin counts that merge exactly."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl_observers.metrics.oneliners import Metric, _complex_tensor, _host_number
from rl_observers.stats import BinCounts, Partial
from rl_observers.stats.scalars import quantile_name

__all__ = ["Histogram"]


class Histogram(Metric):
    """Counts of values over fixed bins (merged exactly); logs ``<name>_count`` and quantiles read off them.

    Quantiles are exact up to their bin's width. Tensors are binned on their
    device (no sync); NaN values are counted apart (``<name>_nan_count``).
    The values' exact sum, sum of squares, min and max are kept for
    :func:`~rl_observers.draw_histograms`.

    Args:
        name (str): the prefix of the logged names.
        fn (callable): a function of the payload.

    Keyword Args:
        edges (sequence of float): strictly increasing bin edges.
        quantiles (sequence of float, optional): Defaults to ``(0.5, 0.9, 0.99)``.
        on (str, optional): see :class:`Metric`.

    Examples:
        >>> import torch
        >>> from rl_observers import Histogram
        >>> metric = Histogram("lag", lambda batch: batch, edges=range(11), quantiles=(0.5,))
        >>> metric.on_post_collect(None, torch.arange(10.0))
        >>> metric.pull()["lag"].finalize()
        {'lag_count': 10.0, 'lag_p50': 4.0}
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        edges: Sequence[float],
        quantiles: Sequence[float] = (0.5, 0.9, 0.99),
        on: str = "post_collect",
    ) -> None:
        super().__init__(name, fn, on=on)
        empty = BinCounts(name, edges, quantiles=quantiles)  # validates
        self.edges, self.quantiles = empty.edges, empty.quantiles
        # the bins, NaN, then the binned values' sum, sum of squares, min and max
        self._counts: torch.Tensor | None = None
        self._edges_t: torch.Tensor | None = None
        self._host = self._empty()  # Python numbers, folded into the same layout on the host

    _transient = ("_edges_t",)

    def fold(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_complex():
                raise _complex_tensor(value, self)
            counts = self._counts
            if counts is None:
                counts = self._counts = torch.zeros(
                    len(self.edges) + 6, dtype=torch.float64, device=value.device
                )
                counts[-2], counts[-1] = math.inf, -math.inf  # no min, no max yet
            edges = self._edges_t
            if edges is None or edges.device != counts.device:
                # A last edge at +inf: bucketize puts NaN past every edge, so NaN gets a
                # count of its own at no extra cost (and +inf stays in the top bin).
                edges = torch.tensor((*self.edges, math.inf), dtype=torch.float64)
                if counts.device.type == "cuda":  # a pinned copy does not wait for the device
                    edges = edges.pin_memory()
                edges = self._edges_t = edges.to(counts.device, non_blocking=True)
            if value.requires_grad:  # (a check costs less than a detached view per fold)
                value = value.detach()
            values = value.reshape(-1).to(counts.device, torch.float64)
            bins = torch.bucketize(values, edges)
            counts.index_add_(0, bins, torch.ones_like(values))
            if values.numel():  # (amin and amax refuse an empty tensor)
                # NaN is in no bin: nansum leaves it out, fmin/fmax pick the other operand
                counts[-4:-2] += torch.stack((values.nansum(), values.square().nansum()))
                counts[-2] = torch.fmin(values, counts[-2]).amin()
                counts[-1] = torch.fmax(values, counts[-1]).amax()
            return
        value, host = _host_number(value, self), self._host
        if value != value:
            host[-5] += 1
            return
        host[bisect.bisect_left(self.edges, value)] += 1
        host[-4] += value
        host[-3] += value * value
        host[-2], host[-1] = min(host[-2], value), max(host[-1], value)

    def _empty(self) -> list[float]:
        return [0.0] * (len(self.edges) + 4) + [math.inf, -math.inf]

    def _bin_counts(self, folded: list[float]) -> BinCounts:
        *counts, nan, total, squares, low, high = folded
        return BinCounts(
            self.name, self.edges, counts, quantiles=self.quantiles, nan=nan,
            sum=total, sum_squares=squares, min=low, max=high,
        )

    def partials(self) -> dict[str, Partial]:
        out, self._host = self._bin_counts(self._host), self._empty()
        if self._counts is not None:
            out = out.merge(self._bin_counts(self._counts.tolist()))  # the one transfer
            self._counts.zero_()
            self._counts[-2], self._counts[-1] = math.inf, -math.inf
        return {self.name: out}

    def metric_names(self) -> tuple[str, ...]:
        quantiles = (quantile_name(self.name, q) for q in self.quantiles)
        return (self.name, f"{self.name}_count", *quantiles, f"{self.name}_nan_count")
