"""Host-side cumulative counters that device values feed without a sync."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ObservedCounters"]


class ObservedCounters:
    """Host-side counters, some fed by device values without a sync.

    ``add_observed`` takes a 1-D integer tensor, one entry per counter: read
    at once on CPU, added by a later :meth:`poll` on CUDA (so they may lag by
    a batch), at :meth:`drain` elsewhere.
    """

    __slots__ = ("values", "_pending")

    def __init__(self, names: Sequence[str]) -> None:
        self.values: dict[str, int] = dict.fromkeys(names, 0)
        self._pending: deque[tuple[tuple[str, ...], torch.Tensor, Any]] = deque()

    def add(self, name: str, amount: int) -> None:
        self.values[name] += amount

    def add_observed(self, names: tuple[str, ...], amounts: torch.Tensor) -> None:
        device = amounts.device
        if device.type == "cpu":
            self._apply(names, amounts)
            return
        if device.type == "cuda":
            host = torch.empty(amounts.shape, dtype=amounts.dtype, pin_memory=True)
            host.copy_(amounts, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._pending.append((names, host, event))
        else:
            self._pending.append((names, amounts, None))
        self.poll()

    def _apply(self, names: tuple[str, ...], amounts: torch.Tensor) -> None:
        values = self.values
        if not amounts.ndim:
            values[names[0]] += int(amounts)
            return
        for name, amount in zip(names, amounts.tolist()):
            values[name] += int(amount)

    def poll(self) -> dict[str, int]:
        """Adds every pending amount whose copy has completed; never waits."""
        pending = self._pending
        while pending:
            names, host, event = pending[0]
            if event is None or not event.query():
                break
            pending.popleft()
            self._apply(names, host)
        return self.values

    def drain(self) -> dict[str, int]:
        """Adds every pending amount, waiting for copies still in flight."""
        pending = self._pending
        while pending:
            names, host, event = pending.popleft()
            if event is not None:
                event.synchronize()
            self._apply(names, host)
        return self.values

    def load(self, values: dict[str, Any]) -> None:
        self._pending.clear()
        for name in self.values:
            self.values[name] = int(values.get(name, 0))
