"""Where events come from, in process: the torchrl objects that emit them.

Step **source** of the flow: :mod:`~rl_observers.sources.observed` switches
classes, :mod:`~rl_observers.sources.collectors` and
:mod:`~rl_observers.sources.replay_buffers` emit,
:mod:`~rl_observers.sources.placement` says where a source runs.
"""

from __future__ import annotations

from rl_observers.sources.observed import observers_of
from rl_observers.sources.placement import SourceInfo, source_info

__all__ = ["SourceInfo", "observers_of", "source_info"]
