"""Shared fixtures: small real torchrl objects."""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import warnings

import pytest
import torch
from torchrl._utils import logger as torchrl_logger

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RL_WARNINGS", "0")
# Ray starts its workers at niceness 15: on a machine the suite keeps busy, they would wait
# behind every other process (an actor's start, for tens of seconds) while a test waits on them.
os.environ.setdefault("RAY_worker_niceness", "0")

import rl_observers  # noqa: E402,F401  (installs add_observer on torchrl's classes)
from tests import helpers  # noqa: E402
from tests.remote import multinode  # noqa: E402

# torchrl starts its workers with the global start method (spawn when unset). Tests
# about a start method set it themselves (tests.helpers.start_method).
helpers.preloaded_forkserver()


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names the groups from the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Orders the run for ``pytest -n`` (``--dist loadgroup``): one worker per module fixture, slow work first.

    A test marked ``xdist_group`` keeps its group (the two-node cluster's modules run one
    at a time). A module whose tests share a module-scoped fixture (``ray_cluster``,
    ``fresh_runs``, a reference run) is one ``xdist_group``, so one worker sets it up once;
    other tests are scheduled one by one. The units that start processes (marked ``slow`` or
    ``real_collector``) go first, most such tests first, so the longest do not start last.
    The order depends on the collection only: every worker computes the same one.
    """
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        if group is not None:
            unit = group.args[0]
        elif any(fixture.scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values() for fixture in defs):
            unit = item.module.__name__
            item.add_marker(pytest.mark.xdist_group(unit))
        else:
            unit = item.nodeid
        units.setdefault(unit, []).append(item)

    def processes(unit: list[pytest.Item]) -> int:
        return sum(any(item.get_closest_marker(m) for m in ("slow", "real_collector")) for item in unit)

    items[:] = [item for unit in sorted(units.values(), key=processes, reverse=True) for item in unit]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Stops the shared two-node cluster (:func:`tests.remote.multinode.shared_cluster`) after its group's last test."""
    try:
        return (yield)
    finally:
        if nextitem is None or not multinode.in_cluster_group(nextitem):
            multinode.stop_shared_cluster()


@pytest.fixture
def counting_env():
    from torchrl.testing.mocking_classes import CountingEnv

    return CountingEnv(max_steps=7)


@pytest.fixture
def make_collector():
    """Builds real ``Collector`` objects (:func:`tests.helpers.make_collector`) and shuts them down after the test."""
    made = []

    def make(env, frames_per_batch=16, total_frames=64, **kwargs):
        collector = helpers.make_collector(env, frames_per_batch, total_frames, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.shutdown(raise_on_error=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gate():
    """An Event a hung logger waits on; released at teardown so its thread ends."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def warnings_seen():
    """Messages of the warnings sent through torchrl's logger (it does not propagate)."""
    messages: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = _Handler(level=logging.WARNING)
    torchrl_logger.addHandler(handler)
    yield messages
    torchrl_logger.removeHandler(handler)


@pytest.fixture
def told(warnings_seen):
    """What the user is told: torchrl logger warnings and ``warnings`` messages, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield warnings_seen
    warnings_seen.extend(str(w.message) for w in caught)


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster (:func:`tests.helpers.local_ray`) shared by the module's tests.

    The modules named in the test module's ``RAY_BY_VALUE`` travel to Ray's workers by
    value. A module given as such also travels by value in the ``cloudpickle`` torchrl
    wraps env makers with; one given as the name of a fixture is that fixture's to register.
    """
    import cloudpickle

    named = getattr(request.module, "RAY_BY_VALUE", ())
    by_value = [request.getfixturevalue(item) if isinstance(item, str) else item for item in named]
    own = [item for item in named if not isinstance(item, str)]
    for module in own:
        cloudpickle.register_pickle_by_value(module)
    try:
        with helpers.local_ray(*by_value) as ray:
            yield ray
    finally:
        for module in own:
            cloudpickle.unregister_pickle_by_value(module)


#: Fresh interpreters a module runs at once: they mostly wait, yet each has a driver and
#: workers, and the suite must pass with one of two cores busy.
FRESH_RUNS_AT_ONCE = 3


@pytest.fixture(scope="module")
def fresh_runs(request, tmp_path_factory):
    """The fresh interpreters (:class:`tests.helpers.FreshRun`) the module's selected tests read, a few side by side.

    The test module's ``fresh_run_of(item)`` gives a selected test's ``(function, *args)``
    or ``None``; each runs once, with a new output directory as its last argument, at most
    :data:`FRESH_RUNS_AT_ONCE` at a time, in the order the tests read them. A test calls
    ``fresh_runs(function, *args)``: the run's directory, once it ended well.
    """
    wanted: list[tuple[str, ...]] = []
    for item in request.session.items:
        run_of = request.module.fresh_run_of(item) if getattr(item, "module", None) is request.module else None
        if run_of is not None and run_of not in wanted:
            wanted.append(run_of)
    runs: dict[tuple[str, ...], tuple[helpers.FreshRun, str]] = {}

    def start_up_to(count: int) -> None:
        for run_of in wanted[:count]:
            if run_of not in runs:
                out = str(tmp_path_factory.mktemp("fresh"))
                runs[run_of] = (helpers.FreshRun(*run_of, out), out)

    def result(*run_of: str):
        start_up_to(wanted.index(run_of) + 1)
        run, out = runs[run_of]
        try:
            run.wait()
        finally:
            start_up_to(wanted.index(run_of) + 1 + FRESH_RUNS_AT_ONCE)
        return pathlib.Path(out)

    start_up_to(FRESH_RUNS_AT_ONCE)
    yield result
    for run, _ in runs.values():
        run.stop()
