"""The Sphinx documentation builds with warnings as errors (what ``make docs`` runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.slow
@pytest.mark.timeout(120)
# Sphinx's own napoleon still uses an interface Sphinx deprecates; not ours to fix.
@pytest.mark.filterwarnings("ignore:The mapping interface for autodoc options")
def test_docs_build_without_warnings(tmp_path):
    build = pytest.importorskip("sphinx.cmd.build")
    out = tmp_path / "html"
    args = ["-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)]
    assert build.build_main(args) == 0, "sphinx reported warnings or errors (see the output above)"
    assert (out / "index.html").is_file()
    for page in ("quickstart", "concepts", "migration", "distributed", "custom", "monitor", "performance", "training", "histograms", "console", "health", "faq", "torchrl_differences", "api"):
        assert (out / f"{page}.html").is_file(), page


API = DOCS / "api.rst"
#: The modules whose ``__all__`` the API page must show, name for name (their submodules too).
API_SCOPE = ("rl_observers", "rl_observers.metrics", "rl_observers.stats", "rl_observers.profiler")


def _documented() -> dict[str, object]:
    """What ``docs/api.rst`` documents: qualified name -> object (directives and ``:members:``)."""
    import importlib
    import re

    def resolve(qualified: str) -> object:
        module, _, attr = qualified.rpartition(".")
        try:
            return importlib.import_module(qualified)
        except ImportError:
            return getattr(importlib.import_module(module), attr)

    current, last_module, found = "rl_observers", None, {}
    for line in API.read_text().splitlines():
        match = re.match(r"\s*\.\. (currentmodule|automodule)::\s*(\S+)", line)
        if match:
            kind, name = match.groups()
            if kind == "currentmodule":
                current = name
            else:
                found[name] = resolve(name)
                last_module = name
            continue
        match = re.match(r"\s*\.\. (?:auto\w+|py:\w+)::\s*([\w.]+)", line)
        if match:
            name = match.group(1)
            name = name if name.startswith("rl_observers.") else f"{current}.{name}"
            try:
                found[name] = resolve(name)
            except (ImportError, AttributeError):
                found[name] = None  # a py:attribute of a class, documented by hand
            last_module = None
            continue
        match = re.match(r"\s*:members:\s*(\S.*)", line)
        if match and last_module is not None:  # automodule ... :members: a, b
            for name in match.group(1).split(","):
                found[f"{last_module}.{name.strip()}"] = resolve(f"{last_module}.{name.strip()}")
    return found


def _modules_in_scope() -> list[object]:
    import importlib
    import pkgutil

    modules = []
    for name in API_SCOPE:
        module = importlib.import_module(name)
        modules.append(module)
        if name != "rl_observers" and hasattr(module, "__path__"):
            for info in pkgutil.walk_packages(module.__path__, f"{name}."):
                modules.append(importlib.import_module(info.name))
    return modules


def test_api_page_shows_every_public_name():
    """Each name in the ``__all__`` of the package, ``metrics``, ``stats`` and ``profiler`` is on the API page."""
    documented = {id(obj) for obj in _documented().values() if obj is not None}
    missing = [
        f"{module.__name__}.{name}"
        for module in _modules_in_scope()
        for name in getattr(module, "__all__", ())
        if id(getattr(module, name)) not in documented
    ]
    assert not missing, f"in an __all__ but not in docs/api.rst: {missing}"


def test_api_page_names_are_public():
    """What the API page documents in those modules is in the documenting module's ``__all__``."""
    import importlib

    scoped = {module.__name__ for module in _modules_in_scope()}
    private = []
    for qualified in _documented():
        module, _, name = qualified.rpartition(".")
        if qualified in scoped:  # a module (automodule): its page, not a name
            continue
        if module in scoped and module != "rl_observers":
            if name not in getattr(importlib.import_module(module), "__all__", ()):
                private.append(qualified)
    assert not private, f"documented in docs/api.rst but not in its module's __all__: {private}"


# -- the code blocks of README.md and docs/quickstart.rst run as written -------------------------

README = DOCS.parent / "README.md"
QUICKSTART = DOCS / "quickstart.rst"
#: The mark of a block that is deliberately a fragment (not run): the line before it is
#: ``<!-- fragment: why -->`` in Markdown, ``.. fragment: why`` (an rst comment) in rst.
FRAGMENT = "fragment:"


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, code, is_fragment)`` of each Python block of a Markdown or rst file, in order."""
    import re
    import textwrap

    lines = path.read_text().splitlines()
    blocks = []
    previous = ""  # the last non-blank line before a block
    i = 0
    while i < len(lines):
        line = lines[i]
        if path.suffix == ".md" and line.strip() in ("```python", "```py"):
            end = lines.index("```", i + 1)
            fragment = previous.startswith("<!--") and FRAGMENT in previous
            blocks.append((i + 1, "\n".join(lines[i + 1 : end]), fragment))
            i = end
        elif path.suffix == ".rst" and re.match(r"\.\. code-block:: python\s*$", line.strip()):
            body = []
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                body.append(lines[j])
                j += 1
            fragment = previous.startswith("..") and FRAGMENT in previous
            blocks.append((i + 1, textwrap.dedent("\n".join(body)).strip("\n"), fragment))
            i = j - 1
        if line.strip():
            previous = line.strip()
        i += 1
    return blocks


def run_blocks(path: Path) -> dict:
    """Runs the Python blocks of ``path`` that are not marked fragments, in order, in one namespace."""
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for line, code, fragment in python_blocks(path):
        if fragment:
            continue
        exec(compile(code, f"{path.name}:{line}", "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran, f"no Python block ran in {path}"
    return namespace


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``tag`` in every TensorBoard event file under ``log_dir``, in write order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = []
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            rows.extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return rows


def test_fragments_are_found_by_their_mark(tmp_path):
    page = tmp_path / "page.rst"
    page.write_text(
        ".. code-block:: python\n\n   x = 1\n\n.. fragment: a piece of the block above\n\n"
        ".. code-block:: python\n\n   y = ...\n"
    )
    assert python_blocks(page) == [(1, "x = 1", False), (7, "y = ...", True)]
    readme = tmp_path / "README.md"
    readme.write_text("```python\nx = 1\n```\n<!-- fragment: not a program -->\n```python\ny\n```\n")
    assert python_blocks(readme) == [(1, "x = 1", False), (5, "y", True)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_example_is_a_complete_program(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README)
    assert blocks and not any(fragment for _, _, fragment in blocks)
    run_blocks(README)
    # what the README says TensorBoard shows, and a pole angle that is not a constant
    angles = [value for _, value in tensorboard_scalars(tmp_path / "runs", "collector/pole_angle_abs")]
    assert len(angles) == 4 and len(set(angles)) > 1 and all(0 < a < 0.25 for a in angles)
    assert tensorboard_scalars(tmp_path / "runs", "collector/episode_return_mean_last_100")
    assert tensorboard_scalars(tmp_path / "runs", "replay_buffer/sample_age_mean")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_runs_as_written_and_its_resume_goes_on(tmp_path, monkeypatch):
    """Every Python block of the quickstart, in order, as a reader would paste them.

    The last one is the documented resume: saved after 4,000 frames, loaded into a
    collector built the same way, the collector's steps go on at 5,000.
    """
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(QUICKSTART)
    frames = [step for step, _ in tensorboard_scalars(tmp_path / "runs", "collector/frames")]
    # the long form (every 5,000 of 20,000 frames), the one-line form (5,000), then the
    # first run of the resume (every 1,000 until 4,000) and the resumed one
    assert frames == [5000, 10000, 15000, 20000, 5000, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
    assert namespace["collector"].state_dict is not None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_one_line_form_logs_the_long_forms_series_but_the_rewards_it_names(tmp_path):
    """``buffer.attach_logger(logger)`` vs the quickstart's long form: the same series, less reward_*."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.record import CSVLogger

    import rl_observers  # noqa: F401
    from rl_observers import Every, LoggerObserver, MetricsChannel, SampleMetrics, WriteMetrics

    def run(attach) -> set[str]:
        logger = CSVLogger(exp_name="one_line", log_dir=str(tmp_path / str(len(list(tmp_path.iterdir())))))
        buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=16)
        attach(buffer, logger)
        for i in range(5):
            reward = torch.arange(100.0).add(i).unsqueeze(-1)
            buffer.extend(TensorDict({"obs": torch.ones(100, 3), "next": {"reward": reward}}, batch_size=[100]))
            for _ in range(4):
                buffer.sample()
        buffer.shutdown()
        assert MetricsChannel.for_logger(logger).close(timeout=30)
        return set(logger.experiment.scalars)

    schedule = Every.counter("sample_calls", 20)
    long_form = run(lambda rb, logger: rb.add_observer(LoggerObserver(
        logger, schedule=schedule, metrics=[WriteMetrics(reward_key=("next", "reward")), SampleMetrics()]
    )))
    one_line = run(lambda rb, logger: rb.attach_logger(logger, schedule=schedule))
    rewards = {f"replay_buffer/reward_{s}" for s in ("mean", "std", "min", "max")}
    assert rewards <= long_form
    assert one_line == long_form - rewards  # what the quickstart says it leaves out, and only that


TRAINING = DOCS / "training.rst"


def test_training_page_runs_as_written_and_its_rows_land_where_it_says(monkeypatch, tmp_path):
    """The first block of docs/training.rst is a program; its rows are the recorded data's."""
    import math
    import statistics

    from rl_observers import TrainingMetrics

    recorded = []  # what the page's loop hands to record, kept beside the real call
    record = TrainingMetrics.record

    def recording(self, step, /, **values):
        recorded.append((step, {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in values.items()}))
        record(self, step, **values)

    monkeypatch.setattr(TrainingMetrics, "record", recording)
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(TRAINING)
    assert blocks and not blocks[0][2]  # the first block is a program, not a fragment
    namespace = run_blocks(TRAINING)
    rows = namespace["logger"].experiment.scalars
    steps = [1200, 2100, 3000, 3300]  # the first record at or past each 1,000, then close()
    assert [s for s, _ in rows["train/loss"]] == steps
    previous = 0
    for row, step in enumerate(steps):
        window = [values for s, values in recorded if previous < s <= step]
        previous = step
        losses = [v["loss"].item() for v in window]
        errors = torch.cat([v["error"].double() for v in window])
        truth = {
            "train/loss": math.fsum(losses) / len(losses),
            "train/grad_norm": max(v["grad_norm"].item() for v in window),
            "train/lr": window[-1]["lr"],
            "train/error_mean": errors.mean().item(),
            "train/error_std": statistics.pstdev(errors.tolist()),  # the population one, as it says
            "train/error_min": errors.min().item(),
            "train/error_max": errors.max().item(),
        }
        for name, value in truth.items():
            assert rows[name][row] == (step, pytest.approx(value, rel=1e-12, abs=1e-15)), name
    assert torch.std(errors, correction=1).item() != pytest.approx(rows["train/error_std"][-1][1], rel=1e-6)


def test_health_page_says_which_axis_per_worker_rows_are_on():
    """What docs/distributed.rst says of per-worker steps is on the page a health user reads."""
    text = " ".join((DOCS / "health.rst").read_text().split())
    assert "Per-worker rows are on **each worker's own frames axis**" in text
