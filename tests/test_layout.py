"""The package layout: the rules a module follows, checked with :mod:`ast`, not line counts.

* Every module of ``rl_observers`` is imported in a fresh interpreter state,
  once as usual (the package's ``__init__`` first) and once with a bare
  stand-in for the top package, so that a module that only imports because
  ``rl_observers/__init__.py`` happened to import something else first fails.
* Every import statement of the package (module level, inside functions and
  under ``if TYPE_CHECKING:``) is parsed into a module graph, which must have
  no cycle and must follow the layer rules below. ``importlib`` calls that
  name an ``rl_observers`` module (a way to hide an edge) are refused.
* Ray is imported only inside ``rl_observers/remote/``, the wing for what
  crosses a process.
* No function reaches into 4 or more private attributes of an object it is
  handed (a "friend" function: a method living outside its class).
* Only ``sources/observed.py`` switches an object's ``__class__``, and the
  table of ``targets.py`` is the only registration.

A module is as long as its one idea needs: there is no line cap.

Layers, in order; a layer may import the layers before it, except where a
rule narrows it. A rule for a package layer applies once that package exists.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "rl_observers"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: The layers, bottom first: each may import from earlier ones (and from itself).
LAYERS: tuple[str, ...] = (
    "lifecycle",
    "signals",
    "observer",
    "stats",
    "sources",
    "metrics",
    "schedule",
    "channel",
    "logging",
    "remote",
    "targets",
    "profiler",
    "testing",
)
#: Narrower rules: the only modules (and their submodules) a layer may import besides itself.
ALLOWED: dict[str, tuple[str, ...]] = {
    "lifecycle": (),
    "signals": (),
    "observer": ("signals",),
    "stats": ("signals",),
    "sources": ("signals", "observer", "stats"),
    # sources.observed: a metric set reads what its source's observer list counts (dropped rollouts)
    "metrics": ("signals", "stats", "sources.placement", "sources.observed"),
    "schedule": (),
    # the channel is local: the cross-process wing (remote) plugs into it, never the reverse
    "channel": ("lifecycle", "observer", "stats.partials"),  # observer: the one OnError policy
}


def module_names() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


MODULES = module_names()


def _path_of(module: str) -> Path:
    base = ROOT.parent.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _resolve(name: str) -> str | None:
    """The ``rl_observers`` module that ``name`` (a module or ``module.attribute``) lands in."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, source: str | None = None) -> list[tuple[str, int, str]]:
    """``(imported module, line, how)`` for every import in ``module``, functions included.

    ``source`` stands in for the module's text (the tests of this file use it).
    """
    path = _path_of(module)
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    # ``if TYPE_CHECKING:`` imports count too: they never run, but a newcomer reading the
    # module sees the dependency all the same (a Protocol or a string annotation avoids them).
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        how = "import"
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base = ".".join(base_parts[: len(base_parts) - node.level + 1])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    targets, how = [arg.value], "importlib"
        for target in targets:
            resolved = _resolve(target)
            if resolved is not None and resolved != module:
                found.append((resolved, node.lineno, how))
    return found


def graph() -> dict[str, set[str]]:
    return {module: {target for target, _, _ in imports_of(module)} for module in MODULES}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_package(layer: str) -> bool:
    return (ROOT / layer).is_dir()


def _within(target: str, allowed: str) -> bool:
    full = f"{PACKAGE}.{allowed}"
    return target == full or target.startswith(full + ".")


def violations() -> list[str]:
    found = []
    for module in MODULES:
        layer = layer_of(module)
        if not layer:
            continue  # the package's __init__ imports everything it re-exports
        for target, line, how in imports_of(module):
            where = f"{module} (line {line})"
            if how == "importlib":
                found.append(f"{where} imports {target} through importlib")
                continue
            if target == PACKAGE:
                found.append(f"{where} imports the top package {PACKAGE}")
                continue
            target_layer = layer_of(target)
            if target_layer == layer:
                continue
            if layer not in LAYERS:
                continue  # a module the layout does not place (yet)
            if layer in ALLOWED:
                if (layer in ("lifecycle", "signals", "observer") or _is_package(layer)) and not any(
                    _within(target, allowed) for allowed in ALLOWED[layer]
                ):
                    found.append(f"{where} imports {target}: {layer} may import only {ALLOWED[layer]}")
                continue
            if target_layer in LAYERS and LAYERS.index(target_layer) > LAYERS.index(layer):
                found.append(f"{where} imports {target}, a later layer than {layer}")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``edges`` (one per strongly connected component, Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions():
    source = ROOT / "sources" / "collectors.py"
    assert source.exists()
    tree = ast.parse("def f():\n    from rl_observers.remote import shipping as remote\n")
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _resolve(f"{node.module}.{node.names[0].name}") == "rl_observers.remote.shipping"


def test_the_graph_sees_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from rl_observers.channel.channel import MetricsChannel\n"
    )
    found = imports_of("rl_observers.remote.handle", source)
    assert ("rl_observers.channel.channel", 3, "import") in found


def test_no_import_cycles_including_imports_inside_functions():
    assert cycles(graph()) == []


def test_layers_import_one_way():
    assert violations() == []


def test_the_channel_and_logging_import_nothing_from_the_remote_wing():
    # the channel is local and comes first; the cross-process wing plugs into it and into logging
    found = [
        f"{module} imports {target} (line {line})"
        for module in MODULES
        if layer_of(module) in ("channel", "logging")
        for target, line, _ in imports_of(module)
        if layer_of(target) == "remote"
    ]
    assert found == []


def test_the_remote_wing_knows_no_metric_set_by_name():
    # a set declares how it merges (MetricSet, Partial); the wing applies it, whatever the set
    found = [
        f"{module} imports {target} (line {line})"
        for module in MODULES
        if layer_of(module) == "remote"
        for target, line, _ in imports_of(module)
        if layer_of(target) == "metrics" and target != f"{PACKAGE}.metrics.base"
    ]
    assert found == []


_IMPORT_EACH = r"""
import importlib, json, sys, traceback, types
modules, bare = json.loads(sys.argv[1]), sys.argv[2] == "bare"
failures = {}
keep = set(sys.modules)

def forget():
    for loaded in [m for m in sys.modules if m not in keep]:
        if loaded == "rl_observers" or loaded.startswith("rl_observers."):
            del sys.modules[loaded]

if not bare:
    # importing rl_observers.x runs the package's __init__ first: a module that __init__
    # imports is imported, from a clean state, exactly as it is there, so one import of
    # the package holds the claim for all of them
    forget()
    try:
        importlib.import_module("rl_observers")
    except BaseException:
        failures["rl_observers"] = traceback.format_exc()
    modules = [name for name in modules if name not in sys.modules]
for name in modules:
    forget()
    if bare and name != "rl_observers":
        stand_in = types.ModuleType("rl_observers")
        stand_in.__path__ = [sys.argv[3]]
        sys.modules["rl_observers"] = stand_in
    try:
        importlib.import_module(name)
    except BaseException:
        failures[name] = traceback.format_exc()
print(json.dumps(failures))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["package_first", "bare"])
def test_every_module_imports_on_its_own(mode):
    # One interpreter; before each module, every rl_observers module is forgotten, so each
    # import starts from a clean rl_observers state (torch and torchrl stay loaded: they are
    # not ours, and reloading them for every module would take minutes).
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(MODULES), mode, str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT.parent,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n\n".join(f"{name}:\n{text}" for name, text in failures.items())


# -- Ray in one subpackage ----------------------------------------------------------------------

#: The one subpackage that may import Ray: everything that crosses a process.
RAY_HOME = f"{PACKAGE}.remote"


def ray_imports(module: str, source: str | None = None) -> list[int]:
    """Lines of ``module`` that import Ray: ``import ray[.x]``, ``from ray[.x] import ...`` or
    ``importlib.import_module("ray[.x]")``, at module level, in functions or under ``TYPE_CHECKING``.

    ``source`` stands in for the module's text (the tests of this file use it).
    """
    path = _path_of(module)
    tree = ast.parse(path.read_text() if source is None else source, str(path))

    def is_ray(name: str) -> bool:
        return name == "ray" or name.startswith("ray.")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(is_ray(alias.name) for alias in node.names):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and is_ray(node.module or ""):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and is_ray(arg.value)
            ):
                found.append(node.lineno)
    return sorted(found)


def test_the_ray_scan_sees_every_way_to_import_it():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import rayon\n"  # not Ray
        "from .ray import sender\n"  # the package's own ray/ folder, not Ray
        "if TYPE_CHECKING:\n"
        "    from ray.actor import ActorHandle\n"
        "def f():\n"
        "    import ray\n"
        "    import importlib\n"
        "    return importlib.import_module('ray.util')\n"
    )
    assert ray_imports(f"{PACKAGE}.remote.handle", source) == [5, 7, 9]


def test_ray_is_imported_only_inside_the_remote_wing():
    outside = {
        module: lines
        for module in MODULES
        if not (module == RAY_HOME or module.startswith(RAY_HOME + "."))
        and (lines := ray_imports(module))
    }
    assert outside == {}, f"Ray imported outside {RAY_HOME} (module: lines): {outside}"
    assert any(ray_imports(module) for module in MODULES if module.startswith(RAY_HOME + ".")), (
        "the scan found no Ray import in the remote wing at all: is it still scanning?"
    )


# -- no friend functions -----------------------------------------------------------------------

#: A function that reaches into this many private attributes of one object it is handed knows
#: that object's insides from outside its class: give the object a method, or make the
#: collaborator an object with a public interface.
FRIEND_LIMIT = 4


def friend_functions(module: str, source: str | None = None) -> list[str]:
    """``function(argument): attributes`` for each function of ``module`` that reaches into
    ``FRIEND_LIMIT`` or more private attributes (``_x``, not ``__x``) of one of its arguments
    other than ``self`` and ``cls``. Nested functions count on their own and in the function
    that holds them.

    ``source`` stands in for the module's text (the tests of this file use it).
    """
    path = _path_of(module)
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            if arg.arg in ("self", "cls"):
                continue
            private = sorted(
                {
                    node.attr
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == arg.arg
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                }
            )
            if len(private) >= FRIEND_LIMIT:
                found.append(f"{fn.name}({arg.arg}): {', '.join(private)}")
    return found


def test_the_friend_scan_counts_private_attributes_of_an_argument():
    source = (
        "def friend(obj, other):\n"
        "    obj._a = obj._b + obj._c\n"
        "    return obj._d(other._a, other._b, other._c)\n"  # other: 3, not a friend
        "class C:\n"
        "    def method(self, x):\n"
        "        return self._a, self._b, self._c, self._d, x.__dict__, x.__class__, x._p\n"
        "async def also(*, kw):\n"
        "    kw._a; kw._b; kw._c\n"
        "    def inner():\n"
        "        return kw._d\n"
    )
    assert friend_functions(f"{PACKAGE}.remote.handle", source) == [
        "friend(obj): _a, _b, _c, _d",
        "also(kw): _a, _b, _c, _d",
    ]


def test_no_function_reaches_into_four_private_attributes_of_what_it_is_handed():
    found = {module: friends for module in MODULES if (friends := friend_functions(module))}
    assert found == {}, "\n".join(f"{module}: {'; '.join(friends)}" for module, friends in found.items())


# -- the table of observed classes -------------------------------------------------------------


def _class_assignments() -> list[str]:
    """``module (line)`` of every ``<obj>.__class__ = ...`` in the package."""
    found = []
    for module in MODULES:
        path = _path_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for inner in ast.walk(target):
                    if isinstance(inner, ast.Attribute) and inner.attr == "__class__":
                        found.append(f"{module} (line {node.lineno})")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("setattr", "object.__setattr__"):
                args = node.args
                if len(args) > 1 and isinstance(args[1], ast.Constant) and args[1].value == "__class__":
                    found.append(f"{module} (line {node.lineno}, setattr)")
    return found


def test_only_sources_observed_switches_a_class():
    outside = [where for where in _class_assignments() if not where.startswith("rl_observers.sources.observed ")]
    assert outside == []
    assert _class_assignments(), "the scan found no __class__ assignment at all: is it still scanning?"


def _calls_of(name: str) -> list[str]:
    found = []
    for module in MODULES:
        path = _path_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if called == name:
                    found.append(f"{module} (line {node.lineno})")
    return found


def test_the_table_is_the_only_registration():
    # One call hands the table to the mechanism; no module registers mixins or kinds of its own.
    assert _calls_of("use_table") == [f"{PACKAGE}.targets (line {_line_of_use_table()})"]
    assert _calls_of("register_mixin") == [] and _calls_of("register_kind") == []
    # Nothing outside the table module fills a class attribute of the observer lists from afar.
    for module in MODULES:
        path = _path_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        assert not target.value.id.endswith("Observers"), f"{module} (line {node.lineno})"


def _line_of_use_table() -> int:
    path = _path_of(f"{PACKAGE}.targets")
    (line,) = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "use_table"
    ]
    return line


def test_the_table_names_every_class_it_decides_for():
    # Every torchrl class the table names exists in this torchrl (a renamed module would turn
    # a known class into a refused one), and its rows are what attaching uses.
    import importlib

    import rl_observers  # noqa: F401
    from rl_observers.sources.observed import how_observed
    from rl_observers.targets import TABLE

    for context, rows in TABLE.items():
        for name, how in rows.items():
            module_name, _, qualname = name.partition(":")
            cls = getattr(importlib.import_module(module_name), qualname)
            assert how_observed(cls, context) is how, (context, name)


# -- public faces --------------------------------------------------------------------------------

#: ``MetricsChannel``'s public members: the Channel contract of DESIGN.md (submit, flush, close,
#: handle, health, logger, name, capacity, closed), the shared channel of a logger
#: (``for_logger``), the explicit drive of ``background=False`` (``step``) and what observer
#: copies submit (``submit_window``).
CHANNEL_CONTRACT = frozenset(
    {
        "capacity",
        "close",
        "closed",
        "flush",
        "for_logger",
        "handle",
        "health",
        "logger",
        "name",
        "step",
        "submit_metrics",
        "submit_window",
    }
)
#: What only ``logging/`` uses of a channel, behind ``channel._logging``.
CHANNEL_LOGGING_SIDE = frozenset(
    {
        "add_close_callback",
        "add_router",
        "add_watcher",
        "copies_attached",
        "copies_expected",
        "copies_gone",
        "has_pending",
        "receive",
        "router",
    }
)


def test_the_channel_s_public_members_are_its_contract():
    from rl_observers.channel import MetricsChannel
    from rl_observers.channel.logging_side import LoggingSide

    public = {name for name in dir(MetricsChannel) if not name.startswith("_")}
    assert public == CHANNEL_CONTRACT, (
        f"not in the contract: {sorted(public - CHANNEL_CONTRACT)}; "
        f"missing: {sorted(CHANNEL_CONTRACT - public)}"
    )
    side = {name for name in dir(LoggingSide) if not name.startswith("_")}
    assert side == CHANNEL_LOGGING_SIDE
    assert isinstance(MetricsChannel.__dict__["_logging"], property)
