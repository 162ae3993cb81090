"""Where events come from, in process: the torchrl objects that emit them.

An in-process source becomes its observed class while it has observers
(:mod:`~rl_observers.sources.observed`, the one place a ``__class__`` is
switched), and emits as :mod:`~rl_observers.sources.collectors` and
:mod:`~rl_observers.sources.replay_buffers` say.
:mod:`~rl_observers.sources.placement` tells an observer where its source
runs. Sources whose data lives in other processes or Ray actors are
:mod:`rl_observers.remote`'s; what each torchrl class becomes, and the
methods installed on torchrl's classes, are :mod:`rl_observers.targets`'.
"""

from __future__ import annotations

from rl_observers.sources.observed import observers_of
from rl_observers.sources.placement import SourceInfo, source_info

__all__ = ["SourceInfo", "observers_of", "source_info"]
