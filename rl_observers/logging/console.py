"""LiveConsole: one line in the terminal with what the run is doing, from the channel's thread.

Step of the flow: a watcher of the channel's delivered rows. It never runs
on a collection, write or sample path: the rows it reads are the ones the
channel's thread logs anyway (merged across workers), and it redraws at most
once per ``interval`` seconds, on that thread.
"""

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
from rl_observers.logging.histograms import add_watcher
from rl_observers.stats import LastEvent

__all__ = ["LiveConsole"]

#: Channel counters that mean something was lost (see ``MetricsChannel.health``).
LOSS_COUNTERS: tuple[str, ...] = ("dropped", "remote_dropped", "sink_errors", "copies_lost", "windows_lost")


class _Rate:
    """A cumulative counter and its rate since the first row that carried it.

    Over the source's times of the rows' last events (:class:`~rl_observers.stats.LastEvent`),
    not over when the rows arrive: the last window of a run arrives at shutdown.
    """

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
        return (self.total - self.first) / (self.at - self.since) if self.at > self.since else math.nan


def _rate(rates: dict[str, _Rate]) -> float:
    """The sources' rates added up (NaN before any has one)."""
    known = [r.rate for r in rates.values() if r.rate == r.rate]
    return sum(known) if known else math.nan


class LiveConsole:
    """One console line: frames, frames per second, episode return, samples per second, workers, losses.

    Opt-in. Watches the rows ``channel`` delivers (after the merge across
    workers) and shows, on one line:

    * ``frames``: the sum of the top-level ``<namespace>/frames`` gauges
      (collectors; per-worker rows are not counted twice), and the frames
      per second since the first row, over the source's own times of the
      rows' last batches (:class:`~rl_observers.stats.LastEvent`), not
      over when the rows arrive;
    * ``return``: the rolling episode return
      (``<namespace>/episode_return_mean_last_<N>`` when the collector's
      metrics keep an episode window, else the last window's
      ``episode_return_mean``);
    * ``samples/s``: from the replay buffers' ``samples_returned`` gauges, in the same way;
    * ``workers``: ``workers_reporting/workers`` of aggregated rows;
    * ``lost``: what the channel counts as lost (dropped payloads, sink
      errors, lost copies and windows); shown only when not zero.

    The line is redrawn at most once per ``interval`` seconds, on the
    channel's thread (never on a hot path), and once more at :meth:`close`
    (which :meth:`MetricsChannel.close` calls too). In a terminal it is a
    ``tqdm`` bar rewritten in place (``total_frames`` gives it a length),
    with torchrl's log lines written above it while it is live; when
    ``file`` is not a terminal (a log file, a pipe) it is a plain line
    per update, without control characters, at most once per
    ``plain_interval`` seconds.

    Args:
        channel (MetricsChannel or Logger): the channel (or the logger whose
            shared channel, :meth:`MetricsChannel.for_logger`, to use).

    Keyword Args:
        total_frames (int, optional): the run's frames, for the bar's length. Defaults to ``None``.
        mode (str, optional): ``"auto"`` (a bar when ``file`` is a
            terminal, else plain lines), ``"bar"`` or ``"plain"``. Defaults to ``"auto"``.
        interval (float, optional): the least seconds between two redraws
            of the bar. Defaults to ``1.0``.
        plain_interval (float, optional): the same for plain lines. Defaults to ``10.0``.
        file (TextIO, optional): where to write. Defaults to ``sys.stdout``.

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
        channel = channel if isinstance(channel, MetricsChannel) else MetricsChannel.for_logger(channel)
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
        self._exit = contextlib.ExitStack()  # what close() ends: the bar, the redirection of log lines
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
        add_watcher(channel, self)
        channel._logging.add_close_callback(self._channel_closing)

    # -- the channel's watcher -------------------------------------------------------

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
            rolling = [key for key in payload if key.startswith(prefix + "episode_return_mean_last_")]
            value = get(rolling[0]) if rolling else get(prefix + "episode_return_mean")
            if isinstance(value, (int, float)):
                self._returns[namespace] = float(value)
            workers = get(prefix + "workers")
            if isinstance(workers, (int, float)):
                self._workers[namespace] = (float(get(prefix + "workers_reporting", workers)), float(workers))

    # -- drawing ---------------------------------------------------------------------

    def line(self) -> str:
        """The line as it would be drawn now."""
        with self._lock:
            parts = []
            fps, samples = _rate(self._frames), _rate(self._samples)
            if self._frames:
                parts.append(f"frames {sum(r.total for r in self._frames.values()):,.0f}")
                if fps == fps:
                    parts.append(f"{fps:,.0f} fps")
            for namespace, value in self._returns.items():
                parts.append(f"return {value:.2f}" if len(self._returns) == 1 else f"{namespace} return {value:.2f}")
            if samples == samples:
                parts.append(f"{samples:,.0f} samples/s")
            if self._workers:
                reporting = sum(r for r, _ in self._workers.values())
                total = sum(w for _, w in self._workers.values())
                parts.append(f"workers {reporting:.0f}/{total:.0f}")
        health = self.channel.health()
        lost = sum(health.get(name, 0) for name in LOSS_COUNTERS)
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
            self._bar.set_postfix_str(line.split(" | ", 1)[1] if " | " in line else "", refresh=False)
            self._bar.refresh()
        else:
            self.file.write(line + "\n")
            self.file.flush()

    def _channel_closing(self) -> None:
        # The channel's close callbacks run before its last delivery: the last rows the
        # observers' callbacks (registered before this one) submitted are waited for first.
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
