"""LiveConsole: one line in the terminal with what the run is doing, from the channel's thread.

Step of the flow: a watcher of the channel's delivered rows. It never runs
on a collection, write or sample path: the rows it reads are the ones the
channel's thread logs anyway (merged across workers), and it redraws at most
once per ``interval`` seconds, on that thread.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import warnings
from typing import Any, TextIO

from rl_observers.channel import MetricsChannel
from rl_observers.logging.histograms import add_watcher

__all__ = ["LiveConsole"]

#: Channel counters that mean something was lost (see ``MetricsChannel.health``).
LOSS_COUNTERS: tuple[str, ...] = ("dropped", "remote_dropped", "sink_errors", "copies_lost", "windows_lost")


class _Rate:
    """A cumulative counter and its rate between the last two rows that moved it."""

    __slots__ = ("total", "at", "rate")

    def __init__(self) -> None:
        self.total: float | None = None
        self.at = 0.0
        self.rate = math.nan

    def update(self, total: float, now: float) -> None:
        if self.total is not None and total > self.total and now > self.at:
            self.rate = (total - self.total) / (now - self.at)
        if self.total is None or total != self.total:
            self.total, self.at = total, now


class LiveConsole:
    """One console line: frames, frames per second, episode return, samples per second, workers, losses.

    Opt-in. Watches the rows ``channel`` delivers (after the merge across
    workers) and shows, on one line:

    * ``frames``: the sum of the top-level ``<namespace>/frames`` gauges
      (collectors; per-worker rows are not counted twice), and the frames
      per second between the last two rows that moved it, measured where
      the rows arrive;
    * ``return``: the rolling episode return
      (``<namespace>/episode_return_mean_last_<N>`` when the collector's
      metrics keep an episode window, else the last window's
      ``episode_return_mean``);
    * ``samples/s``: from the replay buffers' ``samples_returned`` gauges;
    * ``workers``: ``workers_reporting/workers`` of aggregated rows;
    * ``lost``: what the channel counts as lost (dropped payloads, sink
      errors, lost copies and windows); shown only when not zero.

    The line is redrawn at most once per ``interval`` seconds, on the
    channel's thread (never on a hot path), and once more at :meth:`close`
    (which :meth:`MetricsChannel.close` calls too). In a terminal it is a
    ``tqdm`` bar rewritten in place (``total_frames`` gives it a length);
    when ``file`` is not a terminal (a log file, a pipe) it is a plain line
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
        self._frames: dict[str, float] = {}
        self._samples: dict[str, float] = {}
        self._returns: dict[str, float] = {}
        self._workers: dict[str, tuple[float, float]] = {}
        self._frame_rate = _Rate()
        self._sample_rate = _Rate()
        self._drawn_at = -math.inf
        self._last_line = ""
        self._bar: Any = None
        self._closed = False
        self._warned = False
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_frames,
                unit="frames",
                unit_scale=True,
                file=self.file,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}"
                if total_frames
                else "{n_fmt} frames [{elapsed}] {postfix}",
            )
        add_watcher(channel, self)
        channel._logging.add_close_callback(self._channel_closing)

    # -- the channel's watcher -------------------------------------------------------

    def __call__(self, namespace: str, metrics: Any, payload: dict[str, Any], step: int | None) -> None:
        """Reads one delivered row; redraws when ``interval`` has passed (on the channel's thread)."""
        try:
            self._read(namespace, payload)
            now = time.monotonic()
            if now - self._drawn_at >= self.interval:
                self._draw(now)
        except Exception as err:  # a console never stops the logging
            if not self._warned:
                self._warned = True
                warnings.warn(f"LiveConsole failed to show a row ({err!r}); it stays as it was.", stacklevel=2)

    def _read(self, namespace: str, payload: dict[str, Any]) -> None:
        if "/worker_" in namespace or namespace.startswith("worker_"):
            return
        prefix = f"{namespace}/" if namespace else ""
        get = payload.get
        now = time.monotonic()
        with self._lock:
            frames = get(prefix + "frames")
            if isinstance(frames, (int, float)):
                self._frames[namespace] = float(frames)
                self._frame_rate.update(sum(self._frames.values()), now)
            samples = get(prefix + "samples_returned")
            if isinstance(samples, (int, float)):
                self._samples[namespace] = float(samples)
                self._sample_rate.update(sum(self._samples.values()), now)
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
            if self._frames:
                parts.append(f"frames {sum(self._frames.values()):,.0f}")
                if self._frame_rate.rate == self._frame_rate.rate:
                    parts.append(f"{self._frame_rate.rate:,.0f} fps")
            for namespace, value in self._returns.items():
                parts.append(f"return {value:.2f}" if len(self._returns) == 1 else f"{namespace} return {value:.2f}")
            if self._sample_rate.rate == self._sample_rate.rate:
                parts.append(f"{self._sample_rate.rate:,.0f} samples/s")
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
            frames = sum(self._frames.values())
            self._bar.n = frames
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
        if self._bar is not None:
            self._bar.close()

    def __repr__(self) -> str:
        return f"LiveConsole(mode={self.mode!r}, interval={self.interval})"
