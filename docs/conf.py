"""Sphinx configuration of the rl_observers documentation.

Build with ``make docs`` (warnings are errors). Nothing here needs the
network: there is no intersphinx mapping to fetch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from docutils import nodes
from sphinx.directives.code import LiteralInclude

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rl_observers  # noqa: E402

project = "rl_observers"
author = "rl_observers contributors"
copyright = "rl_observers contributors"
release = rl_observers.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build"]
templates_path: list[str] = []
html_theme = "alabaster"
html_static_path: list[str] = []
html_title = f"rl_observers {release}"

# -- autodoc / napoleon ------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# ``Attributes:`` sections become ``:ivar:`` fields, so a dataclass documented with
# ``:members:`` does not describe its fields twice.
napoleon_use_ivar = True

# Cross-references to torch, torchrl, tensordict and blinker are left as text
# (no intersphinx: the build must work offline).
nitpicky = False


class OptionalLiteralInclude(LiteralInclude):
    """``literalinclude`` of a file that may not exist yet; else the directive's content.

    Used for ``benchmarks/README.md``, which is written alongside the
    benchmarks: the page shows it verbatim when it exists and the fallback
    paragraph otherwise, without a warning.
    """

    has_content = True

    def run(self) -> list[nodes.Node]:
        env = self.state.document.settings.env
        _, path = env.relfn2path(self.arguments[0])
        if os.path.exists(path):
            self.content = []
            return super().run()
        fallback = nodes.container()
        self.state.nested_parse(self.content, self.content_offset, fallback)
        return fallback.children


def setup(app):  # noqa: ANN001, ANN201  (Sphinx's extension hook)
    app.add_directive("optional-literalinclude", OptionalLiteralInclude)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
