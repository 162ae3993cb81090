"""Sources whose data lives in other processes: multiprocessing and Ray.

Observers of these sources run next to the data, in the worker processes and
Ray actors; only reduced scalars cross a process boundary.
"""

from __future__ import annotations

from typing import Any

__all__ = ["kind_of"]


def kind_of(target: Any) -> Any | None:
    """Returns how to attach observers to ``target`` when its data is remote, else ``None``."""
    return None
