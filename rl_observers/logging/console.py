"""LiveConsole: one line in the terminal with what the run is doing, from the channel's thread (never a hot path)."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import warnings
from typing import Any, TextIO

from torchrl._utils import logger as torchrl_logger

from rl_observers.channel import MetricsChannel
from rl_observers.stats import LastEvent

__all__ = ["LiveConsole"]


class _Rate:
    """A cumulative counter and its rate since the first row that carried it, over the rows' source times (:class:`~rl_observers.stats.LastEvent`)."""

    __slots__ = ("first", "since", "total", "at")

    def __init__(self) -> None:
        self.first: float | None = None
        self.since = self.total = self.at = 0.0

    def update(self, total: float, at: float) -> None:
        if self.first is None or total < self.total:  # the first row, or the counter went back
            self.first, self.since = total, at
        self.total, self.at = total, at

    @property
    def rate(self) -> float:
        elapsed = self.at - self.since
        return (self.total - self.first) / elapsed if elapsed > 0 else math.nan


class LiveConsole:
    """One console line: frames, frames per second, episode return, samples per second, workers, losses.

    Reads the rows ``channel`` delivers, on the channel's thread: a ``tqdm`` bar in
    a terminal, else a plain line at most once per ``plain_interval``. See :doc:`console`.

    Args:
        channel (MetricsChannel or Logger): the channel, or a logger whose
            shared channel to use.

    Keyword Args:
        total_frames (int, optional): the bar's length. Defaults to ``None``.
        mode (str, optional): ``"auto"``, ``"bar"`` or ``"plain"``. Defaults
            to ``"auto"`` (a bar in a terminal).
        interval (float, optional): seconds between bar redraws. Defaults to ``1.0``.
        plain_interval (float, optional): the same for plain lines. Defaults to ``10.0``.
        file (TextIO, optional): Defaults to ``sys.stdout``.

    Examples:
        >>> import io, tempfile
        >>> from torchrl.record import CSVLogger
        >>> from rl_observers import LiveConsole, MetricsChannel
        >>> channel = MetricsChannel(CSVLogger(exp_name="c", log_dir=tempfile.mkdtemp()), background=False)
        >>> out = io.StringIO()
        >>> console = LiveConsole(channel, mode="plain", plain_interval=0.0, file=out)
        >>> channel.submit_metrics({"frames": 1000, "episode_return_mean": 21.5}, step=1000, namespace="collector")
        >>> channel.step()
        1
        >>> print(out.getvalue().strip())
        frames 1,000 | return 21.50
        >>> channel.close()
        True
    """

    def __init__(
        self,
        channel: Any,
        *,
        total_frames: int | None = None,
        mode: str = "auto",
        interval: float = 1.0,
        plain_interval: float = 10.0,
        file: TextIO | None = None,
    ) -> None:
        if mode not in ("auto", "bar", "plain"):
            raise ValueError(f"LiveConsole: mode must be one of 'auto', 'bar' or 'plain', got {mode!r}.")
        if not isinstance(channel, MetricsChannel):
            channel = MetricsChannel.for_logger(channel)
        self.channel = channel
        self.file = sys.stdout if file is None else file
        if mode == "auto":
            isatty = getattr(self.file, "isatty", None)
            mode = "bar" if callable(isatty) and isatty() else "plain"
        self.mode = mode
        self.interval = float(interval if mode == "bar" else plain_interval)
        self.total_frames = total_frames
        self._lock = threading.Lock()
        self._frames: dict[str, _Rate] = {}
        self._samples: dict[str, _Rate] = {}
        self._returns: dict[str, float] = {}
        self._workers: dict[str, tuple[float, float]] = {}
        self._drawn_at = -math.inf
        self._last_line = ""
        self._bar: Any = None
        self._closed = False
        self._warned = False
        self._exit = contextlib.ExitStack()  # close() ends the bar and the log lines' redirection
        if mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=total_frames,
                unit="frames",
                unit_scale=True,
                file=self.file,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
                if total_frames
                else "{n_fmt} frames [{elapsed}{postfix}]",
            )
            self._exit.callback(self._bar.close)
            # torchrl's log lines (its own handler: it does not propagate) go above the bar, not into it
            self._exit.enter_context(logging_redirect_tqdm([torchrl_logger]))
        channel._logging.add_watcher(self)
        channel._logging.add_close_callback(self._channel_closing)

    def __call__(self, namespace: str, metrics: Any, payload: dict[str, Any], step: int | None) -> None:
        """Reads one delivered row; redraws when ``interval`` has passed (on the channel's thread)."""
        try:
            last = metrics.get(LastEvent.KEY)  # when the source saw the window's last event
            at = last.time if isinstance(last, LastEvent) and last.time > -math.inf else time.time()
            self._read(namespace, payload, at)
            now = time.monotonic()
            if now - self._drawn_at >= self.interval:
                self._draw(now)
        except Exception as err:  # a console never stops the logging
            if not self._warned:
                self._warned = True
                warnings.warn(f"LiveConsole failed to show a row ({err!r}); it stays as it was.", stacklevel=2)

    def _read(self, namespace: str, payload: dict[str, Any], at: float) -> None:
        if "/worker_" in namespace or namespace.startswith("worker_"):
            return
        prefix = f"{namespace}/" if namespace else ""
        get = payload.get
        with self._lock:
            for name, rates in (("frames", self._frames), ("samples_returned", self._samples)):
                value = get(prefix + name)
                if isinstance(value, (int, float)):
                    rates.setdefault(namespace, _Rate()).update(float(value), at)
            rolling = prefix + "episode_return_mean_last_"
            value = next((v for k, v in payload.items() if k.startswith(rolling)), None)
            value = get(prefix + "episode_return_mean") if value is None else value
            if isinstance(value, (int, float)):
                self._returns[namespace] = float(value)
            workers = get(prefix + "workers")
            if isinstance(workers, (int, float)):
                reporting = float(get(prefix + "workers_reporting", workers))
                self._workers[namespace] = (reporting, float(workers))

    def line(self) -> str:
        """The line as it would be drawn now."""
        with self._lock:
            parts = []
            # the sources' rates added up (NaN before any has one)
            rates = ([r.rate for r in s.values() if r.rate == r.rate] for s in (self._frames, self._samples))
            fps, samples = (sum(known) if known else math.nan for known in rates)
            if self._frames:
                parts.append(f"frames {sum(r.total for r in self._frames.values()):,.0f}")
                if fps == fps:
                    parts.append(f"{fps:,.0f} fps")
            for namespace, value in self._returns.items():
                name = "" if len(self._returns) == 1 else f"{namespace} "
                parts.append(f"{name}return {value:.2f}")
            if samples == samples:
                parts.append(f"{samples:,.0f} samples/s")
            if self._workers:
                reporting = sum(r for r, _ in self._workers.values())
                total = sum(w for _, w in self._workers.values())
                parts.append(f"workers {reporting:.0f}/{total:.0f}")
        health = self.channel.health()
        lost = sum(health.get(name, 0) for name in ("dropped", "sink_errors", "copies_lost"))
        if lost:
            parts.append(f"lost {lost:,}")
        return " | ".join(parts)

    def _draw(self, now: float) -> None:
        self._drawn_at = now
        line = self.line()
        if self._closed or line == self._last_line:
            return
        self._last_line = line
        if self._bar is not None:
            self._bar.n = sum(r.total for r in self._frames.values())
            self._bar.set_postfix_str(line.partition(" | ")[2], refresh=False)  # (frames: the bar)
            self._bar.refresh()
        else:
            self.file.write(line + "\n")
            self.file.flush()

    def _channel_closing(self) -> None:
        # close callbacks run before the last delivery: wait for the observers' last rows first
        if not self._closed:
            self.channel.flush(timeout=10.0)
        self.close()

    def close(self) -> None:
        """Draws the last line and ends the bar. Idempotent."""
        if self._closed:
            return
        self._draw(time.monotonic())
        self._closed = True
        self._exit.close()

    def __repr__(self) -> str:
        return f"LiveConsole(mode={self.mode!r}, interval={self.interval})"
