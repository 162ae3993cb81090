"""Resuming from torchrl's Checkpoint: the observers' curves go on where the first run stopped.

The first part and the resumes run in separate processes
(``tests/resume_runs.py``), as a resumed training script does: run, save,
rebuild everything, load, continue; the series logged by the two parts
together equal those of one uninterrupted run. Two processes in all: the
first part of every kind of source, each going on to the end after saving
(a save changes nothing: that is the uninterrupted run), then its resumes
(directory, archive, without the observers' state), each with everything
rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrl.checkpoint import Checkpoint
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

from rl_observers import (
    CollectorBatchMetrics,
    Every,
    LoggerObserver,
    MetricsChannel,
    SampleMetrics,
    WriteMetrics,
)
from rl_observers.logging.resume import STATE_VERSION
from tests.helpers import scalars

ROOT = Path(__file__).resolve().parents[1]


def run(where: Path, phase: str, *sources: str) -> dict[str, dict[str, dict[str, list[list[float]]]]]:
    out = where / f"{phase}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    command = [sys.executable, "-W", "ignore", "-m", "tests.resume_runs", "--phase", phase]
    command += ["--checkpoint", str(where / "checkpoints"), "--out", str(out), *sources]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def joined(first: dict, second: dict) -> dict:
    return {name: first.get(name, []) + second.get(name, []) for name in {*first, *second}}


# The first test's set-up runs both parts (each a process of up to 400 s).
pytestmark = pytest.mark.timeout(900)

#: Per fixture: the kind of source and the resumes of its second part.
PARTS = {
    "runs": ("collector", "directory,archive,without"),
    "multisync": ("multisync", "directory,without"),
    "ray_buffer": ("raybuffer", "directory,without"),
}


@pytest.fixture(scope="module")
def parts(request, tmp_path_factory):
    """Both parts of each kind of source the selected tests read: one process per part.

    A part runs the kinds one after the other, each as if alone (seeded afresh); a process
    per kind would only add the start of an interpreter each.
    """
    wanted = [
        name for name in PARTS
        if any(name in item.fixturenames for item in request.session.items if getattr(item, "module", None) is request.module)
    ]
    if importlib.util.find_spec("ray") is None and "ray_buffer" in wanted:
        wanted.remove("ray_buffer")  # its fixture skips
    if not wanted:
        return {}
    where = tmp_path_factory.mktemp("resume")
    first = run(where, "first", *(PARTS[name][0] for name in wanted))
    second = run(where, "second", *(":".join(PARTS[name]) for name in wanted))
    return {name: {**first[PARTS[name][0]], **second[PARTS[name][0]]} for name in wanted}


@pytest.fixture(scope="module")
def runs(parts):
    """The first part of a split run (saved as a directory and an archive), its whole run, and three resumes."""
    return parts["runs"]


@pytest.mark.real_collector
@pytest.mark.parametrize("archive", [False, True], ids=["directory", "archive"])
def test_resumed_collector_and_buffer_log_what_one_run_logs(runs, archive):
    whole, first, second = runs["whole"], runs["first"], runs["archive" if archive else "directory"]
    assert joined(first, second) == whole  # steps, totals and values, every series
    assert [step for step, _ in second["collector/frames"]] == [60, 80]
    assert second["collector/episodes_total"][-1][1] == whole["collector/episodes_total"][-1][1] == 16
    for name in ("items_written", "sample_calls", "samples_returned"):
        assert second[f"replay_buffer/{name}"][-1] == whole[f"replay_buffer/{name}"][-1]


@pytest.mark.real_collector
def test_observers_left_out_of_the_checkpoint_still_log_on_the_source_axis(runs):
    """Without their state, steps follow the restored frames and write_count; sample_calls restart."""
    second = runs["without"]
    assert second["collector/frames"] == [[60, 60.0], [80, 80.0]]
    assert second["collector/batches"] == [[60, 6.0], [80, 8.0]]
    assert [value for _, value in second["replay_buffer/items_written"]] == [60.0, 80.0]
    assert second["replay_buffer/sample_calls"] == [[2, 2.0], [4, 4.0]]  # torchrl does not keep them
    assert second["collector/episodes_total"] == [[60, 4.0], [80, 8.0]]


@pytest.fixture(scope="module")
def multisync(parts):
    """A 2-worker MultiSyncCollector, 10 frames a batch each: saved at 80 frames, resumed with and without observers."""
    return parts["multisync"]


@pytest.mark.real_collector
def test_resumed_multiprocessing_collector_goes_on_from_the_owners_aggregate(multisync):
    """The aggregate at the owner is saved and restored."""
    first, second = multisync["first"], multisync["directory"]
    steps = [step for step, _ in first["collector/frames"] + second["collector/frames"]]
    assert steps == sorted(set(steps)) and steps[-1] == 160
    assert first["collector/frames"][-1][0] == 80
    # the driver's rows: every 40 of its frames, its batches 20 frames each (one run logs the same)
    assert [step for step, _ in second["collector/frames"]] == [120, 160]
    # totals go on from the first part's (one run logs the same: 160 frames, 8 batches of
    # each worker, two episodes per worker batch)
    assert second["collector/frames"][-1] == [160, 160.0]
    assert second["collector/batches"][-1] == [160, 16.0]
    assert second["collector/episodes_total"][-1] == [160, 32.0]
    assert set(second["collector/episode_length_mean"][-1][1:]) == {5.0}


@pytest.mark.real_collector
def test_multiprocessing_aggregate_without_saved_state_goes_on_from_the_restored_frames(multisync):
    """No observer state: the workers' restored frames are the aggregate's axis (as the driver's frames)."""
    second = multisync["without"]
    steps = [step for step, _ in second["collector/frames"]]
    assert steps == [120, 160]  # the driver's next rows after the restored 80 (every 40 frames)
    assert second["collector/frames"][-1] == [160, 160.0]
    assert second["collector/batches"][-1] == [160, 16.0]
    # torchrl keeps no episode count: it restarts (two episodes per worker batch, 8 batches)
    assert second["collector/episodes_total"][-1] == [160, 16.0]


@pytest.fixture(scope="module")
def ray_buffer(parts):
    """A RayReplayBuffer, its observer in the actor: saved after 4 writes and 4 samples, resumed twice.

    Each part starts Ray in its process (``ray.init(num_cpus=2)``) and shuts it down.
    """
    pytest.importorskip("ray")
    return parts["ray_buffer"]


#: What a Ray buffer's observer logs that does not depend on the actor's sampling RNG (not in the checkpoint).
RAY_DETERMINISTIC = ("items_written", "writes", "batch_size", "sample_calls", "samples_returned")


@pytest.mark.real_collector
def test_resumed_ray_replay_buffer_logs_what_one_run_logs(ray_buffer):
    """torchrl's Checkpoint saves the buffer (an actor round trip) and the observer (the owner's aggregate)."""
    whole, resumed = ray_buffer["whole"], joined(ray_buffer["first"], ray_buffer["directory"])
    assert sorted(resumed) == sorted(whole)
    for name, rows in whole.items():  # the same steps in every series
        assert [step for step, _ in resumed[name]] == [step for step, _ in rows], name
    for name in RAY_DETERMINISTIC:  # and the same values where they do not depend on the sampler's RNG
        assert resumed[f"replay_buffer/{name}"] == whole[f"replay_buffer/{name}"], name
    assert ray_buffer["directory"]["replay_buffer/items_written"] == [[6, 30.0], [8, 40.0]]
    assert ray_buffer["directory"]["replay_buffer/samples_returned"] == [[6, 24.0], [8, 32.0]]


@pytest.mark.real_collector
def test_ray_replay_buffer_without_observer_state_goes_on_from_the_restored_write_count(ray_buffer):
    """The actor's copy lines up with the restored write_count; sample_calls (not kept by torchrl) restart."""
    second = ray_buffer["without"]
    assert second["replay_buffer/items_written"] == [[2, 30.0], [4, 40.0]]
    assert second["replay_buffer/sample_calls"] == [[2, 2.0], [4, 4.0]]


def _observed_buffer(logger, **kwargs):
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    observer = LoggerObserver(MetricsChannel(logger, background=False), **kwargs)
    rb.add_observer(observer)
    return rb, observer


def test_a_state_that_does_not_fit_is_refused_naming_the_difference(tmp_path):
    logger = CSVLogger(exp_name="fit", log_dir=str(tmp_path))
    rb, observer = _observed_buffer(logger, metrics=[WriteMetrics(), SampleMetrics()])
    rb.extend(torch.arange(10))
    state = observer.state_dict()
    other = CSVLogger(exp_name="other", log_dir=str(tmp_path))
    _, renamed = _observed_buffer(other, metrics=[WriteMetrics(), SampleMetrics()], name="rb")
    with pytest.raises(ValueError, match=r"namespace 'replay_buffer' \(this observer: 'rb'\)"):
        renamed.load_state_dict(state)
    with pytest.raises(ValueError, match=rf"saved in format 0, this version reads format {STATE_VERSION}"):
        renamed.load_state_dict({**state, "version": 0})  # a state of another layout
    _, fewer = _observed_buffer(other, metrics=[WriteMetrics()], name="fewer")
    with pytest.raises(ValueError, match=r"metric sets \['WriteMetrics', 'SampleMetrics'\]"):
        fewer.load_state_dict(state)
    env = CountingEnv(max_steps=3)
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=4, total_frames=8)
    collector_observer = LoggerObserver(MetricsChannel(other, background=False), metrics=CollectorBatchMetrics())
    collector.add_observer(collector_observer)
    with pytest.raises(ValueError, match="kind of source 'replay_buffer'"):
        collector_observer.load_state_dict(state)
    collector.shutdown()


def test_observer_is_a_checkpoint_component_loaded_before_or_after_attaching(tmp_path):
    logger = CSVLogger(exp_name="first", log_dir=str(tmp_path))
    rb, observer = _observed_buffer(logger, schedule=Every.counter("sample_calls", 2))
    rb.extend(torch.arange(10))
    for _ in range(3):
        rb.sample(2)
    Checkpoint(observer=observer).save(tmp_path / "ckpt")
    again = CSVLogger(exp_name="again", log_dir=str(tmp_path))
    # loaded before attaching: applied when attached, once the metric sets exist
    resumed = LoggerObserver(MetricsChannel(again, background=False), schedule=Every.counter("sample_calls", 2))
    Checkpoint(observer=resumed).load(tmp_path / "ckpt")
    rb2 = ReplayBuffer(storage=LazyTensorStorage(100))
    rb2.add_observer(resumed)
    rb2.extend(torch.arange(10))
    rb2.sample(2)  # the 4th sample call overall: crosses 4
    resumed._channel().flush(timeout=10)
    assert scalars(again, "replay_buffer/sample_calls") == [(4, 4.0)]
    # the buffer was not restored (write_count 10): items written go on from the observer's 10
    assert scalars(again, "replay_buffer/items_written") == [(4, 20.0)]


def test_a_step_never_goes_below_the_namespaces_last_one(tmp_path):
    """Loading an older state of a counter torchrl does not keep (sample_calls): no row below the last step."""
    logger = CSVLogger(exp_name="back", log_dir=str(tmp_path))
    rb, observer = _observed_buffer(logger, schedule=None, metrics=SampleMetrics())
    rb.extend(torch.arange(10))
    rb.sample(2)
    older = observer.state_dict()
    rb.sample(2)
    rb.sample(2)
    observer.load_state_dict(older)  # sample_calls back to 1
    for _ in range(3):
        rb.sample(2)
    observer._channel().flush(timeout=10)
    rows = scalars(logger, "replay_buffer/sample_calls")
    # a row after every event (schedule=None), the extend's first
    assert [step for step, _ in rows] == [0, 1, 2, 3, 3, 3, 4]
    assert [value for _, value in rows] == [0.0, 1.0, 2.0, 3.0, 2.0, 3.0, 4.0]  # the counts are the state's


def test_the_owners_aggregate_goes_on_from_its_saved_state():
    """Restarted workers (new processes) count on top of the saved totals, gauges and thresholds."""
    from rl_observers.remote.aggregate import Aggregate
    from rl_observers.stats import Count

    def contribution(frames):
        return {"frames": float(frames), "dones": Count("dones", 1)}, {"frames": frames}

    first = Aggregate("collector", schedule=Every.counter("frames", 100), step_key="frames", scope="both")
    first.contribute(0, *contribution(60), process="a")
    rows = first.contribute(1, *contribution(50), process="b")
    assert [(namespace, step) for namespace, _, step in rows] == [("collector", 110)]
    state = first.state_dict()
    resumed = Aggregate("collector", schedule=Every.counter("frames", 100), step_key="frames", scope="both")
    resumed.load_state_dict(state)
    assert resumed.contribute(0, *contribution(30), process="c") == []  # 140: below 200
    # (a contribution carries its process's cumulative counters)
    rows = resumed.contribute(1, *contribution(70), process="d")  # worker 1 at 120, total 210
    rows += resumed.contribute(0, *contribution(70), process="c")  # worker 0 at 130, total 250
    by_namespace = {namespace: (step, metrics["frames"]) for namespace, metrics, step in rows}
    assert by_namespace == {
        "collector/worker_1": (120, 120.0),
        "collector": (210, 210.0),
        "collector/worker_0": (130, 130.0),
    }


def test_restored_workers_without_saved_state_line_the_aggregate_up_with_their_frames():
    """Each copy tells how much of its count its restored source had (``base``): no threshold fires for it."""
    from rl_observers.remote.aggregate import Aggregate

    aggregate = Aggregate("collector", schedule=Every.counter("frames", 40), step_key="frames", scope="both")
    base = {"frames": 40, "batches": 4}
    rows = aggregate.contribute(0, {"frames": 50.0}, {"frames": 50, "batches": 5}, process="a", base=base)
    rows += aggregate.contribute(1, {"frames": 50.0}, {"frames": 50, "batches": 5}, process="b", base=base)
    assert rows == []  # 100 frames, 80 of them restored: the next threshold is 120
    rows = aggregate.contribute(0, {"frames": 60.0}, {"frames": 60, "batches": 6}, process="a", base=base)
    assert rows == []  # 110; and worker 0 is below its own next threshold, 80
    rows = aggregate.contribute(1, {"frames": 80.0}, {"frames": 80, "batches": 8}, process="b", base=base)
    assert [(namespace, step, metrics["frames"]) for namespace, metrics, step in rows] == [
        ("collector/worker_1", 80, 80.0),
        ("collector", 140, 140.0),
    ]


def test_the_aggregates_rolling_episode_window_is_saved_and_goes_on(tmp_path):
    """The last N episodes merged at the owner survive a Checkpoint; new episodes push the saved ones out."""
    from rl_observers.remote.aggregate import Aggregate
    from rl_observers.stats import LatestWindow

    def window(*entries):
        return {"episode_window": LatestWindow(3, ("episode_return",), entries=entries)}

    def returns(rows):
        return {ns: m["episode_window"].values("episode_return") for ns, m, _ in rows}

    def build():
        return Aggregate("collector", schedule=Every.counter("frames", 10), step_key="frames", scope="both")

    first = build()
    first.contribute(0, window(((3, 0, 0), (1.0,))), {"frames": 5}, process="a")
    rows = first.contribute(1, window(((4, 1, 0), (2.0,)), ((8, 1, 1), (3.0,))), {"frames": 8}, process="b")
    assert returns(rows)["collector"] == [1.0, 2.0, 3.0]
    Checkpoint(aggregate=first).save(tmp_path / "ckpt")
    resumed = build()
    Checkpoint(aggregate=resumed).load(tmp_path / "ckpt")
    # the copies of the resumed run stamp their episodes from 0 again
    rows = resumed.contribute(0, window(((2, 0, 0), (10.0,))), {"frames": 5}, process="c")
    assert returns(rows) == {"collector/worker_0": [1.0, 10.0]}
    rows = resumed.contribute(1, window(((1, 1, 0), (20.0,))), {"frames": 6}, process="d")
    assert returns(rows) == {"collector/worker_1": [2.0, 3.0, 20.0], "collector": [3.0, 20.0, 10.0]}
