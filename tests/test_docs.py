"""The Sphinx documentation builds with warnings as errors (what ``make docs`` runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
