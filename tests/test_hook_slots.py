"""Collector hook slots round-trip whatever observers are attached (local and multiprocessing)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers  # noqa: F401
from rl_observers.testing import EventRecorder
from tests.helpers import make_collector, make_multi

BATCHES = 3


class Calls:
    """Records which hooks and observers ran, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def hook(self, name: str) -> Any:
        def post(batch: Any) -> None:
            self.log.append(name)

        return post


def run(collector: Collector) -> None:
    for _ in collector:
        pass


def test_reading_a_slot_returns_what_was_set_whatever_is_attached():
    collector = make_collector(CountingEnv(), 4, batches=BATCHES)
    try:
        collector.add_observer(EventRecorder())
        assert collector.post_collect_hook is None
        assert collector.pre_collect_hook is None

        def hook(batch: Any) -> None:
            pass

        def pre() -> None:
            pass

        collector.post_collect_hook = hook
        collector.pre_collect_hook = pre
        assert collector.post_collect_hook is hook
        assert collector.pre_collect_hook is pre
        collector.post_collect_hook = None
        assert collector.post_collect_hook is None
    finally:
        collector.shutdown()


def test_save_swap_restore_neither_recurses_nor_drops_anyone():
    collector = make_collector(CountingEnv(), 4, batches=4)
    calls = Calls()
    try:
        user = calls.hook("user")
        collector.post_collect_hook = user
        collector.add_observer(lambda batch: calls.log.append("observer"))
        saved = collector.post_collect_hook
        collector.post_collect_hook = calls.hook("other")
        collector.post_collect_hook = saved  # the pattern torchrl's enable_profile used
        assert collector.post_collect_hook is user
        run(collector)
        assert calls.log == ["user", "observer"] * 4
    finally:
        collector.shutdown()


def test_the_hook_swapped_mid_run_and_back():
    collector = make_collector(CountingEnv(), 4, batches=4)
    calls = Calls()
    try:
        collector.post_collect_hook = calls.hook("user")
        collector.add_observer(lambda batch: calls.log.append("observer"))
        for i, _ in enumerate(collector):
            if i == 0:
                saved, collector.post_collect_hook = collector.post_collect_hook, calls.hook("other")
            elif i == 1:
                collector.post_collect_hook = saved
            elif i == 2:
                collector.post_collect_hook = None
        assert calls.log == ["user", "observer", "other", "observer", "user", "observer", "observer"]
    finally:
        collector.shutdown()


def test_pre_collect_slot_and_observers_both_run_once_per_rollout():
    collector = make_collector(CountingEnv(), 4, batches=BATCHES)
    recorder = EventRecorder()
    pre_calls = []
    try:
        collector.add_observer(recorder)
        collector.pre_collect_hook = lambda: pre_calls.append(1)
        saved = collector.pre_collect_hook
        collector.pre_collect_hook = saved
        run(collector)
        assert len(pre_calls) == BATCHES
        assert recorder.count("pre_collect") == BATCHES
        assert recorder.count("post_collect") == BATCHES
    finally:
        collector.shutdown()


@pytest.mark.parametrize("order", ["hook_profile_observer", "profile_hook_observer", "observer_profile_hook"])
def test_enable_and_disable_profile_in_any_order_keep_everyone(tmp_path, order):
    collector = make_collector(CountingEnv(), 4, batches=4)
    calls = Calls()
    user = calls.hook("user")

    def observer(batch: Any) -> None:
        calls.log.append("observer")

    steps = {
        "hook": lambda: setattr(collector, "post_collect_hook", user),
        "profile": lambda: collector.enable_profile(
            num_rollouts=2,
            warmup_rollouts=1,
            activities=["cpu"],
            with_stack=False,
            save_path=str(tmp_path / "trace_{worker_idx}.json"),
        ),
        "observer": lambda: collector.add_observer(observer),
    }
    try:
        for step in order.split("_"):
            steps[step]()
        assert collector.post_collect_hook is user
        run(collector)
        collector.disable_profile()
        assert collector.post_collect_hook is user
        assert collector.observers == (observer,)
        assert calls.log == ["user", "observer"] * 4
        collector.disable_profile()  # twice is harmless
        assert collector.post_collect_hook is user
    finally:
        collector.shutdown()


def test_the_slot_round_trips_once_the_last_observer_is_removed():
    collector = make_collector(CountingEnv(), 4, batches=BATCHES)
    calls = Calls()
    try:
        user = calls.hook("user")
        collector.post_collect_hook = user
        handle = collector.add_observer(lambda batch: calls.log.append("observer"))
        saved = collector.post_collect_hook
        handle.remove()
        collector.post_collect_hook = saved
        assert type(collector) is Collector
        run(collector)
        assert calls.log == ["user"] * BATCHES
    finally:
        collector.shutdown()


class FileHook:
    """A picklable ``post_collect_hook`` that appends one line per batch to a file."""

    def __init__(self, path: Path, tag: str) -> None:
        self.path = str(path)
        self.tag = tag

    def __call__(self, batch: Any) -> None:
        with open(self.path, "a") as file:
            file.write(f"{self.tag} {os.getpid()}\n")


class FileObserver(FileHook):
    def on_post_collect(self, source: Any, batch: Any) -> None:
        self(batch)


def tags(path: Path) -> list[str]:
    return path.read_text().split()[::2] if path.exists() else []


@pytest.mark.real_collector
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_multiprocessing_slots_round_trip_and_reach_the_workers(tmp_path):
    log = tmp_path / "calls.txt"
    collector = make_multi(MultiSyncCollector, "fork", frames_per_batch=8, total_frames=8 * 4)
    try:
        collector.add_observer(FileObserver(log, "observer"))
        user = FileHook(log, "user")
        collector.post_collect_hook = user  # forwarded to the workers through their pipes
        assert collector.post_collect_hook is user
        saved = collector.post_collect_hook
        collector.post_collect_hook = FileHook(log, "other")
        collector.post_collect_hook = saved
        assert collector.post_collect_hook is user
        for _ in collector:
            pass
        seen = tags(log)
        assert "other" not in seen
        assert seen.count("user") == seen.count("observer") > 0
        assert collector.pre_collect_hook is None
    finally:
        collector.shutdown()
