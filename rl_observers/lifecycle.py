"""What rl_observers does when a process forks or exits: every such hook is registered here.

At exit, hooks run once, phase by phase: observed sources shut down so
their workers' copies send their last windows (``SOURCES``), copies here
send theirs (``COPIES``), channels deliver (``CHANNELS``).

Examples:
    >>> from rl_observers import lifecycle
    >>> lifecycle.SOURCES < lifecycle.COPIES < lifecycle.CHANNELS
    True
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
from collections.abc import Callable

__all__ = ["CHANNELS", "COPIES", "SOURCES", "after_fork_in_child", "at_exit"]

SOURCES, COPIES, CHANNELS = 0, 1, 2

_FORK_HOOKS: list[Callable[[], None]] = []
_EXIT_HOOKS: list[tuple[int, Callable[[], None]]] = []
_FINALIZER_PID: int | None = None  # the process whose multiprocessing finalizer is registered
_EXITED_PID: int | None = None


def after_fork_in_child(hook: Callable[[], None]) -> None:
    """Runs ``hook()`` in every child forked from this process from now on, after earlier hooks."""
    _FORK_HOOKS.append(hook)


def at_exit(hook: Callable[[], None], phase: int) -> None:
    """Runs ``hook()`` once when this process exits, after the hooks of earlier phases; what it raises is ignored.

    Each new hook moves the run after every exit handler registered before
    (such as multiprocessing's, which would wait for workers never shut down).
    """
    global _FINALIZER_PID
    if all(known != hook for _, known in _EXIT_HOOKS):
        _EXIT_HOOKS.append((phase, hook))
        _EXIT_HOOKS.sort(key=lambda entry: entry[0])  # stable: added order within a phase
        atexit.unregister(_run_exit_hooks)
        atexit.register(_run_exit_hooks)
    if _FINALIZER_PID != os.getpid():
        _FINALIZER_PID = os.getpid()
        # multiprocessing's children exit through its finalizers, never through atexit
        multiprocessing.util.Finalize(None, _run_exit_hooks, exitpriority=100)


def _run_exit_hooks() -> None:
    global _EXITED_PID
    if _EXITED_PID == os.getpid():
        return
    _EXITED_PID = os.getpid()
    for _, hook in list(_EXIT_HOOKS):
        try:
            hook()
        except Exception:  # never fail the process's exit
            pass


def _run_fork_hooks() -> None:
    global _FINALIZER_PID
    _FINALIZER_PID = None  # a multiprocessing child clears the finalizers it inherited
    for hook in list(_FORK_HOOKS):
        hook()


os.register_at_fork(after_in_child=_run_fork_hooks)
