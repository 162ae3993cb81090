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
    for page in ("quickstart", "concepts", "migration", "distributed", "custom", "monitor", "performance", "faq", "torchrl_differences", "api"):
        assert (out / f"{page}.html").is_file(), page
