"""Observers for the tests of remote sources: they record each event as a line in a file.

Worker processes and Ray actors cannot hand their observer copies back, so
these observers append one line per event to a file the test reads: the
event, the tag of the observer, the process, the worker it runs as and the
number of frames or items involved. Kept in a module of their own, with
light imports, so that ``spawn`` workers can import them by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_observers.sources.placement import source_info


@dataclass(frozen=True)
class Line:
    """One recorded event."""

    tag: str
    event: str
    pid: int
    worker: int | None
    num_workers: int | None
    remote: bool
    count: int


def _none_or_int(text: str) -> int | None:
    return None if text == "None" else int(text)


def append_line(path: Path | str, text: str) -> None:
    """Appends ``text`` and a newline to ``path`` in one ``write`` of an ``O_APPEND`` file.

    Processes appending at once never interleave their lines: each line is
    one small write at the end of the file.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def read_lines(path: Path | str) -> list[Line]:
    """Every whole line recorded in ``path`` so far (none if the file does not exist).

    A last line without its newline is still being written by another process
    and is left out.
    """
    if not os.path.exists(path):
        return []
    lines = []
    with open(path) as file:
        for raw in file:
            if not raw.endswith("\n"):
                break
            tag, event, pid, worker, num_workers, remote, count = raw.split()
            lines.append(
                Line(tag, event, int(pid), _none_or_int(worker), _none_or_int(num_workers), remote == "True", int(count))
            )
    return lines


class _Recorder:
    def __init__(self, path: Path | str, tag: str) -> None:
        self.path = str(path)
        self.tag = tag
        self.events_seen = 0  # worker-local: never read back, the original stays at 0

    def _record(self, source: Any, event: str, count: int) -> None:
        self.events_seen += 1
        info = source_info(source)
        append_line(
            self.path,
            f"{self.tag} {event} {info.process} {info.worker} {info.num_workers} {info.remote} {count}",
        )


class CollectorLog(_Recorder):
    """Records ``pre_collect``, ``post_collect`` (frames) and ``shutdown``."""

    def on_pre_collect(self, source: Any) -> None:
        self._record(source, "pre_collect", 0)

    def on_post_collect(self, source: Any, batch: Any) -> None:
        self._record(source, "post_collect", batch.numel())

    def on_shutdown(self, source: Any) -> None:
        self._record(source, "shutdown", 0)


class BufferLog(_Recorder):
    """Records the writes (items), samples (items), ``empty`` and ``shutdown`` of a buffer."""

    def __init__(self, path: Path | str, tag: str) -> None:
        super().__init__(path, tag)
        self.items_written = 0

    def on_post_add(self, source: Any, data: Any, index: Any) -> None:
        self.items_written += 1
        self._record(source, "post_add", 1)

    def on_post_extend(self, source: Any, data: Any, index: Any) -> None:
        self.items_written += len(index)
        self._record(source, "post_extend", len(index))

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        self._record(source, "post_sample", len(batch))

    def on_empty(self, source: Any) -> None:
        self._record(source, "empty", 0)

    def on_shutdown(self, source: Any) -> None:
        self._record(source, "shutdown", 0)

    def stats(self) -> dict[str, int]:
        return {f"{self.tag}/items_written": self.items_written}


class HookLog:
    """A user ``post_collect_hook`` / ``pre_collect_hook`` that records where it ran."""

    def __init__(self, path: Path | str, tag: str) -> None:
        self.path = str(path)
        self.tag = tag

    def __call__(self, batch: Any = None) -> None:
        count = 0 if batch is None else batch.numel()
        append_line(self.path, f"{self.tag} hook {os.getpid()} None None True {count}")


class FailsToAttach(CollectorLog):
    """Raises in ``attached`` in one worker: the attach must fail and be undone everywhere."""

    def __init__(self, path: Path | str, tag: str, failing_worker: int) -> None:
        super().__init__(path, tag)
        self.failing_worker = failing_worker

    def attached(self, source: Any) -> None:
        if source_info(source).worker == self.failing_worker:
            raise RuntimeError(f"worker {self.failing_worker} refuses this observer")


class BufferRefusesToAttach(BufferLog):
    """Raises in ``attached``, where it runs: the attach must fail on the driver, leaving nothing."""

    def attached(self, source: Any) -> None:
        raise RuntimeError(f"process {os.getpid()} refuses this observer")


class RaisesOnSample:
    """Raises in ``on_post_sample``, where it runs."""

    def on_post_sample(self, source: Any, batch: Any, info: Any) -> None:
        raise RuntimeError(f"process {os.getpid()} refuses this sample")
