"""Quantiles: a one-liner logging quantiles within a declared relative accuracy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl_observers.metrics.oneliners import Metric, _complex_tensor, _host_number
from rl_observers.stats import Partial, QuantileReducer, QuantileSketch

__all__ = ["Quantiles"]


class Quantiles(Metric):
    """Quantiles of the values within ``accuracy`` (relative) of the true ones, merged exactly; no edges to choose.

    Logs ``<name>_p5``, ``<name>_p50``, ``<name>_p95`` (one per ``q``) and
    ``<name>_nonfinite`` when NaN or infinite values came. Values are counted
    in a :class:`~rl_observers.stats.QuantileSketch` (tensors on their device,
    no sync), so the aggregate over workers and windows is exact.

    Args:
        name (str): the prefix of the logged names.
        fn (callable): a function of the payload.

    Keyword Args:
        q (sequence of float, optional): each in (0, 1). Defaults to
            ``(0.05, 0.5, 0.95)``.
        accuracy (float, optional): in (0, 0.5). Defaults to ``0.01``.
        on (str, optional): see :class:`~rl_observers.metrics.oneliners.Metric`.

    Raises:
        ValueError: a quantile outside (0, 1) or an accuracy outside (0, 0.5).

    Examples:
        >>> import torch
        >>> from rl_observers import Quantiles
        >>> metric = Quantiles("action_abs", lambda batch: batch.abs(), q=(0.05, 0.5, 0.95))
        >>> metric.on_post_collect(None, torch.arange(-50.0, 51.0))
        >>> {k: round(v, 2) for k, v in metric.pull()["action_abs"].finalize().items()}  # 3, 25, 48
        {'action_abs_p5': 3.02, 'action_abs_p50': 25.12, 'action_abs_p95': 48.25}
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        q: Sequence[float] = (0.05, 0.5, 0.95),
        accuracy: float = 0.01,
        on: str = "post_collect",
    ) -> None:
        super().__init__(name, fn, on=on)
        self._reducer = QuantileReducer(name, quantiles=q, accuracy=accuracy)
        self.q = self._reducer.empty().quantiles
        self.accuracy = float(accuracy)
        self._host: list[float] = []

    def fold(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_complex():
                raise _complex_tensor(value, self)
            self._reducer.fold(value)
        else:
            self._host.append(_host_number(value, self))

    def partials(self) -> dict[str, Partial]:
        host, self._host = self._host, []
        sketch = self._reducer.pull()
        if host:
            empty = self._reducer.empty()
            sketch = sketch.merge(
                QuantileSketch.from_values(
                    self.name, host, quantiles=empty.quantiles, accuracy=empty.accuracy
                )
            )
        return {self.name: sketch}

    def metric_names(self) -> tuple[str, ...]:
        return (self.name, *self._reducer.empty().metric_names())
