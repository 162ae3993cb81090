"""Rebuilds torchrl's C++ extension against the installed torch, when the shipped one cannot load.

torchrl 0.14.1's wheel ships ``torchrl/_torchrl*.so`` built against another torch
than the CPU torch 2.13.0 this project installs; the import fails with an
undefined symbol, and torchrl then has no segment trees, so prioritized replay
buffers cannot be built. The wheel ships the C++ sources (``torchrl/csrc``), so
this script compiles them with ``torch.utils.cpp_extension`` and puts the
module where torchrl looks for it. It does nothing when the extension loads.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tempfile


def extension_loads() -> bool:
    probe = "import torch, torchrl._torchrl as ext; ext.SumSegmentTreeFp32(4)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main() -> int:
    if extension_loads():
        print("torchrl C++ extension loads: nothing to build.")
        return 0
    from torch.utils.cpp_extension import load

    package = pathlib.Path(importlib.util.find_spec("torchrl").origin).parent
    sources = [str(package / "csrc" / "pybind.cpp"), str(package / "csrc" / "utils.cpp")]
    build = pathlib.Path(tempfile.mkdtemp(prefix="torchrl_ext_"))
    print(f"Building torchrl C++ extension against torch in {build} ...", flush=True)
    module = load(
        name="_torchrl",
        sources=sources,
        build_directory=str(build),
        extra_cflags=["-O2"],
        verbose=False,
    )
    built = pathlib.Path(module.__file__)
    for stale in package.glob("_torchrl*.so"):
        stale.unlink()
    target = package / built.name
    shutil.copy2(built, target)
    shutil.rmtree(build, ignore_errors=True)
    ok = extension_loads()
    print(f"installed {target}: {'loads' if ok else 'still fails to load'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
